"""The model layer, the math: the DiffusionGemma network (its config dataclass, attention, paged KV cache, graphs)
and its weight formats behind one Linear / Experts interface (FP8 and GGML block modules). Checkpoints are
read and written by dgcli/checkpoint/, which builds this network and fills it.

Owns: everything between token ids and hidden states / logits. Must not: read or write files, tokenize, sample,
print, or import from checkpoint/, sampling/, runtime/, cli/, measure/, render/ or train/.

The model alone (`dgcli.load_model(path, device="cuda", dtype="bfloat16")`):
`forward_canvas(prompt_ids, canvas_ids, self_conditioning_logits=None)` -> float32 logits [B, C, V], meaning
exactly transformers' `DiffusionGemmaForBlockDiffusion(input_ids=..., decoder_input_ids=...,
self_conditioning_logits=...).logits`. Lower level: `cache = model.new_cache(seqs, max_len)` (a paged KV cache;
`cache.reserve(seq, positions)` gives a sequence its blocks), `model.forward_pass(ids, segments, cache, soft)`
(one pass over segments of rows, each `(seq, start, length, canvas)`: causal prompt or commit rows, then
canvases; returns the canvases' hidden states; tests/passes.py shows encode/decode with it),
`model.logits(hidden)`.
A checkpoint is a directory with `config.json` (top-level `diffusion_gemma`, nested `text_config`),
`model.safetensors` or shards plus `model.safetensors.index.json`, `generation_config.json`, `tokenizer.json`
and `chat_template.jinja`; the released 26B-A4B `config.json` and `generation_config.json` ship in
`dgcli/data/diffusiongemma-26B-A4B/` (`--dummy 26B-A4B`).
"""
