"""The paged KV cache's device side: one pool of key and one of value blocks per layer, on the model's device.

Owns: the pools (a layer's is [n_kv, blocks · B, d]; block b holds slots b·B .. b·B+B-1), writing a pass's keys
and values into them in place (`write`) and the block tables as device tensors (`table_tensor`); the rest is the
block manager's (the base class). Only the passes write it; attention reads it (`model/attention.py`).
Must not: know about attention masks, phases or the model; read device values.
"""

from __future__ import annotations

import torch

from dgcli.engine.block_manager import BlockManager
from dgcli.kernels.transfer import to_device


class PagedKVCache(BlockManager):
    def __init__(self, layers: list[tuple[int, int, int | None]], *, seqs: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype, block_size: int = 16, prefix_caching: bool = False,
                 pass_rows: int | None = None):
        """layers: per layer (num_kv_heads, head_dim, sliding window W or None); the rest as `BlockManager`'s."""
        super().__init__([w for _, _, w in layers], seqs=seqs, max_len=max_len, block_size=block_size,
                         prefix_caching=prefix_caching, pass_rows=pass_rows)
        self.k = [torch.zeros(n, self.groups[g].n * block_size, d, device=device, dtype=dtype)
                  for (n, d, _), g in zip(layers, self.kind)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.device = torch.device(device)

    def table_tensor(self, group: str, seqs: list[int], fixed: bool = False) -> torch.Tensor:
        """[len(seqs), max blocks] int32 block tables on the device (for kernels that walk them); `fixed`: as wide
        as a sequence's table can be (one shape whatever the sequences hold), a sequence without blocks zeros."""
        rows = [[max(0, blk) for blk in self.tables.get(s, {}).get(group, [])] for s in seqs]
        width = max(1, max(len(r) for r in rows))
        if fixed:
            width = max(width, self.full_blocks if group == "full" else self.ring_blocks)
        return to_device([r + [0] * (width - len(r)) for r in rows], torch.int32, self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n_kv, N, d] into layer's pool at device slots [N] (int64), in place."""
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
