"""Tests' shorthand for the model's one pass: encode prompts and blocks, then decode a canvas, row by row.

`Seqs(model, rows, max_len)` reserves one cache sequence per row; `encode(model, ids, kv, lengths=None)` runs
the rows' ids as causal segments (row b's first lengths[b] ids) at each row's next positions; `decode(model,
canvas, kv, soft=None)` runs the canvases as canvas segments and returns their hidden states. Both are one
`forward_pass` each: the engine's pass, with nothing of their own.
"""

from __future__ import annotations

import torch

from dgcli.model.attention import Segment


class Seqs:
    def __init__(self, model, rows: int, max_len: int, block_size: int = 16):
        c = model.config.canvas_length
        self.cache = model.new_cache(rows, max_len + c, block_size=block_size)
        for b in range(rows):
            assert self.cache.reserve(b, max_len + c)
        self.lens = [0] * rows


def encode(model, ids: torch.Tensor, kv: Seqs, lengths: list[int] | None = None) -> None:
    lengths = [ids.shape[1]] * ids.shape[0] if lengths is None else lengths
    segments = [Segment(b, kv.lens[b], n, False) for b, n in enumerate(lengths)]
    flat = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])
    model.forward_pass(flat, segments, kv.cache)
    kv.lens = [a + n for a, n in zip(kv.lens, lengths)]


def decode(model, canvas: torch.Tensor, kv: Seqs, soft: torch.Tensor | None = None) -> torch.Tensor:
    segments = [Segment(b, kv.lens[b], canvas.shape[1], True) for b in range(canvas.shape[0])]
    return model.forward_pass(canvas.flatten(), segments, kv.cache, soft)


def read(kv: Seqs, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [rows, n_kv, hi - lo, d] of every row's positions lo..hi-1 in `layer` (gathered: a test's copy)."""
    c = kv.cache
    group = c.kind[layer]
    ks, vs = [], []
    for b in range(len(kv.lens)):
        slots = c.slots(group, b, lo, hi).to(c.k[layer].device)
        ks.append(c.k[layer][:, slots]), vs.append(c.v[layer][:, slots])
    return torch.stack(ks), torch.stack(vs)
