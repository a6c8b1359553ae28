"""The library's request API: settings and their precedence (settings.py, preflight.py), a `Session` (session.py)
and requests through the engine (request.py). Every command calls this layer; commands only parse flags and print.
Must not: print, parse command lines, or contain a denoising loop.
"""
