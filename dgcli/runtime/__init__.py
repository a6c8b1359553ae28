"""The library's request API: settings precedence (defaults < checkpoint < preset < flags/request), a
`Session` (model + tokenizer + resolved settings on a device), and one request through the loop
(`request.run_request`: encode, run, cut at stop ids and max_tokens, decode).

Every command, and the future server, calls this layer; commands only parse flags and print.
Must not: print, parse command lines, or contain a denoising loop (sampling/ owns the one loop).
"""
