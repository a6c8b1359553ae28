"""Preallocated KV cache of the encoder prefix (prompt + committed blocks), one row per request.

Owns: the K/V buffers and each row's filled length. A row is a slot the batched loop gives one running
request (and frees when it finishes). Row b's tokens sit at slots 0..lens[b]-1, and a token's slot is
its position, so a row's numbers never depend on its batch-mates' lengths (the reference's left padding
shifts every position of a row by the same amount, which RoPE's relative attention does not see). Only encoder passes write it; decoder (canvas) passes read it. Sliding
layers keep every position too (simple and exact): the model slices the last W-1 entries when a
canvas reads them. Must not: know about attention masks or the model.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, shapes: list[tuple[int, int]], batch_size: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype):
        # shapes: per layer (num_kv_heads, head_dim); buffers are [B, n_kv, max_len, d].
        self.k = [torch.zeros(batch_size, n, max_len, d, device=device, dtype=dtype) for n, d in shapes]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.max_len = max_len
        self.lens = [0] * batch_size  # row b: slots 0..lens[b]-1 are filled (host ints: no device reads)

    def write(self, layer: int, starts: list[int], k: torch.Tensor, v: torch.Tensor,
              rows: list[int] | None = None) -> None:
        """k, v [B, n_kv, T, d] into slots starts[b]..starts[b]+T-1 of each row (of cache rows `rows`, default
        all; one copy when all rows start together; the slots past a row's real tokens hold padding until
        its next write)."""
        t = k.shape[2]
        if max(starts) + t > self.max_len:
            raise ValueError(f"KV cache overflow: {max(starts) + t} > {self.max_len} positions")
        if rows is None and len(set(starts)) == 1:
            s = starts[0]
            self.k[layer][:, :, s:s + t] = k
            self.v[layer][:, :, s:s + t] = v
            return
        for b, s in enumerate(starts):
            r = b if rows is None else rows[b]
            self.k[layer][r, :, s:s + t] = k[b]
            self.v[layer][r, :, s:s + t] = v[b]

    def read(self, layer: int, lo: int, hi: int, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n_kv, hi - lo, d] of slots lo..hi-1 (of cache rows `rows`: a copy; default all: a view)."""
        if rows is None:
            return self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi]
        idx = torch.tensor(rows, dtype=torch.long, device=self.k[layer].device)
        return self.k[layer][idx, :, lo:hi], self.v[layer][idx, :, lo:hi]
