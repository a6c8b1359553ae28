"""Preallocated KV cache of the encoder prefix (prompt + committed blocks).

Owns: the K/V buffers and the running length. Only encoder passes write it; decoder (canvas) passes
read it. Sliding layers keep every position too (simple and exact): the model slices the last W-1
entries when a canvas reads them. Must not: know about attention masks or the model.
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
        self.length = 0  # positions 0..length-1 are filled

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[2]
        if start + t > self.max_len:
            raise ValueError(f"KV cache overflow: {start + t} > {self.max_len} positions")
        self.k[layer][:, :, start:start + t] = k
        self.v[layer][:, :, start:start + t] = v

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi]
