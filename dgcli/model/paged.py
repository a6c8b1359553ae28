"""The paged KV cache: fixed-size blocks of positions in one pool per layer, a block table per sequence.

Owns: the pools, the allocation of blocks to sequences and where a position of a sequence lives. Two groups of
layers share allocation: the full layers (a sequence holds every position it reserved: position p in its
table's block p // B) and the sliding layers (a sequence holds a ring of `ring_blocks` blocks, the last W-1
positions rounded up to blocks: position p in block (p // B) mod ring_blocks), so a sliding layer keeps only
what a later query reads from the cache (a pass's own keys come from the pass: model/attention.py). A layer's pool is [n_kv, blocks · B, d]: the slots of
consecutive blocks are consecutive, so a run of a sequence's blocks that are also consecutive in the pool is
one strided view (what CPU attention reads without a copy; the allocator hands out runs when it can).
Sizes are fixed when the engine makes the cache (slots × the longest request it admits): nothing is
allocated per pass. Only the passes write it, in place (`write`); attention reads it (`model/attention.py`).
A reserved sequence owns its blocks until `release`; a released block's stale contents are never read (a
reader asks only for positions its sequence wrote in this request).
Must not: know about attention masks, phases or the model; read device values.
"""

from __future__ import annotations

import torch

from dgcli.kernels.transfer import to_device


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class BlockPool:
    """Free block ids of one group; `take(n)` prefers one run of consecutive ids (first fit)."""

    def __init__(self, n: int):
        self.n, self.free = n, list(range(n))

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        free = self.free
        run = 0
        for i in range(len(free)):  # first run of n consecutive ids, else the n lowest
            run = run + 1 if i and free[i] == free[i - 1] + 1 else 1
            if run == n:
                got = free[i - n + 1:i + 1]
                del free[i - n + 1:i + 1]
                return got
        got, self.free = free[:n], free[n:]
        return got

    def give(self, ids: list[int]) -> None:
        self.free = sorted(self.free + ids)


class PagedKVCache:
    def __init__(self, layers: list[tuple[int, int, int | None]], *, seqs: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype, block_size: int = 16):
        """layers: per layer (num_kv_heads, head_dim, sliding window W or None). Room for `seqs` sequences of up
        to `max_len` positions each; a sliding layer's ring holds the last W-1 positions in whole blocks (a pass
        reads its own new keys from its k, v and writes them after: attention.py)."""
        self.block_size, self.max_len, self.seqs = block_size, max_len, seqs
        windows = {w for _, _, w in layers if w is not None}
        self.ring_blocks = blocks_for(min(max(windows) - 1, max_len), block_size) if windows else 0
        self.full_blocks = blocks_for(max_len, block_size)  # per sequence
        self.groups = {"full": BlockPool(seqs * self.full_blocks), "ring": BlockPool(seqs * self.ring_blocks)}
        self.kind = ["full" if w is None else "ring" for _, _, w in layers]
        self.windows = [w for _, _, w in layers]
        self.k = [torch.zeros(n, self.groups[g].n * block_size, d, device=device, dtype=dtype)
                  for (n, d, _), g in zip(layers, self.kind)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.tables: dict[int, dict[str, list[int]]] = {}  # sequence id -> group -> block ids
        self.device = torch.device(device)

    # ---- allocation ---------------------------------------------------------------------------------------

    def reserve(self, seq: int, positions: int) -> bool:
        """Blocks for sequence `seq`'s positions 0..positions-1 (and its ring); False when the pool is short."""
        if positions > self.max_len:
            raise ValueError(f"{positions} positions > the cache's {self.max_len} per sequence")
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already holds blocks: release it first")
        got: dict[str, list[int]] = {}
        for g in sorted(set(self.kind)):
            ids = self.groups[g].take(blocks_for(positions, self.block_size) if g == "full" else self.ring_blocks)
            if ids is None:  # give back what this call took: all or nothing
                for g2, taken in got.items():
                    self.groups[g2].give(taken)
                return False
            got[g] = ids
        self.tables[seq] = got
        return True

    def release(self, seq: int) -> None:
        for g, ids in self.tables.pop(seq, {}).items():
            self.groups[g].give(ids)

    def free_blocks(self) -> dict[str, int]:
        return {g: len(p.free) for g, p in self.groups.items()}

    # ---- where positions live --------------------------------------------------------------------------------

    def slots(self, group: str, seq: int, lo: int, hi: int) -> torch.Tensor:
        """Physical slots (host int64 [hi - lo]) of sequence `seq`'s positions lo..hi-1 in `group`'s pools."""
        b = self.block_size
        table = torch.tensor(self.tables[seq][group], dtype=torch.long)
        pos = torch.arange(lo, hi)
        blk = pos // b if group == "full" else (pos // b) % self.ring_blocks
        return table[blk] * b + pos % b

    def runs(self, group: str, seq: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The slots of positions lo..hi-1 as maximal runs of consecutive slots [(start, end), ...] in position
        order (one run when the sequence's blocks are consecutive and, on a ring, the range does not wrap)."""
        b, table = self.block_size, self.tables[seq][group]
        out: list[tuple[int, int]] = []
        p = lo
        while p < hi:
            blk = p // b if group == "full" else (p // b) % self.ring_blocks
            a = table[blk] * b + p % b
            n = min(hi, (p // b + 1) * b) - p
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], a + n)
            else:
                out.append((a, a + n))
            p += n
        return out

    def table_tensor(self, group: str, seqs: list[int]) -> torch.Tensor:
        """[len(seqs), max blocks] int32 block tables on the device (for kernels that walk them)."""
        rows = [self.tables[s].get(group, []) for s in seqs]
        width = max(1, max(len(r) for r in rows))
        return to_device([r + [0] * (width - len(r)) for r in rows], torch.int32, self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n_kv, N, d] into layer's pool at device slots [N] (int64), in place."""
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
