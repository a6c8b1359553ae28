"""The model layer: checkpoint config, loader (+ the checkpoint's quirks), the DiffusionGemma network, its KV
cache, and random weights in the released layout (for --dummy, tests and benchmarks).

Owns: everything between a checkpoint directory and hidden states / logits. Must not: tokenize, sample,
print, or import from sampling/, runtime/, cli/, measure/, render/ or train/.

The model alone (`dgcli.load_model(path, device="cuda", dtype="bfloat16")`):
`forward_canvas(prompt_ids, canvas_ids, self_conditioning_logits=None)` -> float32 logits [B, C, V], meaning
exactly transformers' `DiffusionGemmaForBlockDiffusion(input_ids=..., decoder_input_ids=...,
self_conditioning_logits=...).logits`. Lower level: `cache = model.new_cache(B, max_len)` (B slots, each with
its own length `cache.lens[b]`), `model.encode(ids, cache, lengths=None, rows=None)` (prefill, or commit of
right-padded rows into slots; writes the cache), `model.decode(canvas, cache, soft, rows=None)` (hidden
states of the canvas; the cache is read only; each row at its own positions), `model.logits(hidden)`.
A checkpoint is a directory with `config.json` (top-level `diffusion_gemma`, nested `text_config`),
`model.safetensors` or shards plus `model.safetensors.index.json`, `generation_config.json`, `tokenizer.json`
and `chat_template.jinja`; the released 26B-A4B `config.json` and `generation_config.json` ship in
`dgcli/data/diffusiongemma-26B-A4B/` (`--dummy 26B-A4B`).
"""
