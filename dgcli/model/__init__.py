"""The model layer, the math: the DiffusionGemma network (config, attention, CUDA graphs) and its weight formats
behind one Linear / Experts interface (FP8, NVFP4 and GGML block modules). dgcli/checkpoint/ builds and fills it.

Owns: everything between token ids and hidden states / logits. Must not: read or write files, tokenize, sample,
print, or import from checkpoint/, sampling/, runtime/, cli/, measure/, render/ or train/.

The model alone (`dgcli.load_model(path)`): `forward_canvas(prompt_ids, canvas_ids, self_conditioning_logits=None)`
-> float32 logits [B, C, V], exactly transformers' `DiffusionGemmaForBlockDiffusion(...).logits`. Lower level:
`model.new_cache(seqs, max_len)`, `model.forward_pass(ids, segments, cache, soft)` (one pass over segments of rows
`(seq, start, length, canvas)`, returning the canvases' hidden states: tests/passes.py) and `model.logits(hidden)`.
"""
