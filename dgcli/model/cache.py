"""Preallocated KV cache of the encoder prefix (prompt + committed blocks), one row per request.

Owns: the K/V buffers and each row's filled length. A row is a slot the batched loop gives one running
request (and frees when it finishes). Positions are per row: row b holds positions 0..lens[b]-1, so a
row's numbers never depend on its batch-mates' lengths (the reference's left padding shifts every
position of a row by the same amount, which RoPE's relative attention does not see). Only encoder
passes write it; decoder (canvas) passes read it.

Two kinds of layer buffer: a full layer keeps every position (position p at slot p, [B, n_kv, max_len,
d]); a sliding layer of window W keeps a ring of its last R = min(W-1, max_len) positions (position p
at slot p mod R, [B, n_kv, R, d]), all that any later query reads (a canvas reads the last W-1 prefix
positions; an encoder token at p reads p-W+1..p, its own pass's tokens from the fresh K/V). `parts`
hands back a range of positions in chronological order, as one or two views of the ring, so the
attention sees the same keys in the same order as with a full buffer (RoPE is applied before caching).
A row's ring is only ever read over positions its current request wrote (a reader asks for at most
the last R positions below lens[b]), so a reused slot's stale contents are never seen.
Must not: know about attention masks or the model.
"""

from __future__ import annotations

import torch

from dgcli.kernels.transfer import to_device


class KVCache:
    def __init__(self, shapes: list[tuple[int, int]], batch_size: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype, windows: list[int | None] | None = None):
        # shapes: per layer (num_kv_heads, head_dim); windows: per layer the sliding window W (a ring of
        # min(W-1, max_len) positions) or None (every position); windows=None keeps every position everywhere.
        windows = [None] * len(shapes) if windows is None else list(windows)
        self.ring = [None if w is None else min(w - 1, max_len) for w in windows]  # ring length, or None
        self.k = [torch.zeros(batch_size, n, max_len if r is None else r, d, device=device, dtype=dtype)
                  for (n, d), r in zip(shapes, self.ring)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.max_len = max_len
        self.lens = [0] * batch_size  # row b: positions 0..lens[b]-1 are filled (host ints: no device reads)

    def write(self, layer: int, starts: list[int], k: torch.Tensor, v: torch.Tensor,
              rows: list[int] | None = None, lengths: list[int] | None = None) -> None:
        """k, v [B, n_kv, T, d] as positions starts[b]..starts[b]+T-1 of each row (of cache rows `rows`,
        default all). `lengths[b]` (default T) of row b's tokens are real: a full layer stores the padding
        too (one copy when all rows start together; it sits past the row's length until its next write), a
        ring only the real tokens' last R (padding would push real positions out)."""
        t = k.shape[2]
        if max(starts) + t > self.max_len:
            raise ValueError(f"KV cache overflow: {max(starts) + t} > {self.max_len} positions")
        r = self.ring[layer]
        if r is not None:
            lengths = [t] * len(starts) if lengths is None else lengths
            if rows is None and len(set(starts)) == 1 and len(set(lengths)) == 1:
                self._ring_write(layer, slice(None), starts[0], lengths[0], k, v)
                return
            for b, (s, n) in enumerate(zip(starts, lengths)):
                row = b if rows is None else rows[b]
                self._ring_write(layer, slice(row, row + 1), s, n, k[b:b + 1], v[b:b + 1])
            return
        if rows is None and len(set(starts)) == 1:
            s = starts[0]
            self.k[layer][:, :, s:s + t] = k
            self.v[layer][:, :, s:s + t] = v
            return
        for b, s in enumerate(starts):
            row = b if rows is None else rows[b]
            self.k[layer][row, :, s:s + t] = k[b]
            self.v[layer][row, :, s:s + t] = v[b]

    def _ring_write(self, layer: int, rows: slice, s: int, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The last min(n, R) of positions s..s+n-1 (k, v [b, n_kv, >= n, d]) into rows' rings."""
        j = n - min(n, self.ring[layer])  # the first token kept
        for a, b in self._spans(layer, s + j, s + n):
            self.k[layer][rows, :, a:b] = k[:, :, j:j + b - a]
            self.v[layer][rows, :, a:b] = v[:, :, j:j + b - a]
            j += b - a

    def _spans(self, layer: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Buffer slots of positions lo..hi-1, in order: one span on a full layer, one or two on a ring."""
        r = self.ring[layer]
        if r is None:
            return [(lo, hi)]
        if hi - lo > r or lo < 0:
            raise ValueError(f"positions {lo}..{hi - 1}: a ring of {r} holds only the last {r} positions")
        if hi == lo:
            return []
        a = lo % r
        return [(a, a + hi - lo)] if a + hi - lo <= r else [(a, r), (0, a + hi - lo - r)]

    def parts(self, layer: int, lo: int, hi: int, rows: list[int] | None = None):
        """K and V of positions lo..hi-1 as lists of [B, n_kv, *, d] pieces in chronological order: views
        for all rows or one row, copies for other `rows`. A ring holds the last R positions of a row:
        lo must be >= lens[b] - R for the rows read."""
        buf_k, buf_v = self.k[layer], self.v[layer]
        if rows is None:
            sel = slice(None)
        elif len(rows) == 1:
            sel = slice(rows[0], rows[0] + 1)
        else:
            sel = to_device(rows, torch.long, buf_k.device)
        spans = self._spans(layer, lo, hi)
        return [buf_k[sel, :, a:b] for a, b in spans], [buf_v[sel, :, a:b] for a, b in spans]

    def read(self, layer: int, lo: int, hi: int, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n_kv, hi - lo, d] of positions lo..hi-1 (a view where `parts` gives one view, else a copy)."""
        pk, pv = self.parts(layer, lo, hi, rows)
        if len(pk) == 1:
            return pk[0], pv[0]
        if not pk:
            idx = slice(None) if rows is None else to_device(rows, torch.long, self.k[layer].device)
            return self.k[layer][idx, :, :0], self.v[layer][idx, :, :0]
        return torch.cat(pk, dim=2), torch.cat(pv, dim=2)
