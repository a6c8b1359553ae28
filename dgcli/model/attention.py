"""The one attention entry point: every row of a pass, every phase, over the paged KV cache, read in place.

Owns: `Segment` (a run of one sequence's rows in a pass), `PassLayout` (where each row's key and value go and
which keys it reads, built once per pass for every layer) and `attend`. One rule covers every phase: a row at
position p of a sequence reads that sequence's key positions lo..hi-1, where
- causal rows (prompt chunks, committed blocks): hi = p + 1; lo = p - W + 1 on sliding layers of window W, else 0;
- canvas rows (bidirectional, one canvas at positions P..P+C-1): hi = P + C for every row; lo = P - (W - 1) on
  sliding layers (the same last W-1 prefix positions for every canvas row: the reference's rectangle, not a
  per-row window; spec §6), else 0.
Full layers: every row's key and value are written to the cache before any row reads (a canvas writes its own
at the positions its block will commit to; the commit overwrites them), so every key is read from the cache.
Sliding layers keep a ring of only the last W-1 positions: a segment reads the ring's keys before its own start
and its own from this pass's k, v; causal segments write theirs after reading, then the canvases read (so a
commit and the next block's canvas can share a pass). No step copies a prefix.
Backends (`backend`): CUDA runs the Triton kernel (`kernels/paged_attention.py`), which walks block tables and
takes the pass's own keys for sliding layers; elsewhere torch's SDPA runs once per segment over strided views of
the pool (full layers: one run when the sequence's blocks are consecutive, else the pieces are concatenated,
a copy bounded by the request's own keys; sliding layers: the ring's one or two views and the segment's own keys
concatenated, fewer than W + rows keys), with a causal mask only for causal segments ([rows, keys]).
On CPU the keys, their order and the mask are those of the reference's own attention call, so the bits are
SDPA's on those keys (its CPU result does not depend on strides or on the batch: tests/model/test_paged.py).
Must not: know about requests, the sampler or blocks of the diffusion schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dgcli.kernels import ops
from dgcli.kernels.transfer import to_device


@dataclass(frozen=True)
class Segment:
    seq: int  # the cache's sequence id
    start: int  # position of its first row
    length: int  # rows (consecutive positions)
    canvas: bool  # bidirectional canvas rows; else causal rows (prompt chunk or committed block)

    def keys(self, window: int | None) -> tuple[int, int]:
        """The union lo..hi-1 of the key positions its rows read."""
        hi = self.start + self.length
        return (0 if window is None else max(0, self.start - window + 1)), hi


def backend(device: torch.device) -> str:
    """'triton-paged' (CUDA with Triton) or 'torch-sdpa': what `attend` runs on `device`."""
    return "triton-paged" if device.type == "cuda" and _kernel_ok() else "torch-sdpa"


@functools.cache
def _kernel_ok() -> bool:
    try:
        import triton  # noqa: F401

        from dgcli.kernels import paged_attention  # noqa: F401
    except ImportError:
        return False
    return True


class PassLayout:
    """One pass's rows: segments in row order (every causal segment before every canvas segment), positions,
    write slots per cache group and, per (segment, window), the key runs and mask. Host work once per pass.
    A captured pass (model/graphs.py) keeps one layout's device tensors and `load`s each later pass into them."""

    def __init__(self, segments: list[Segment], cache, device: torch.device, every_seq: bool = False):
        """`every_seq`: the kernel's block tables hold every sequence of the cache, indexed by sequence id, at a
        fixed width (one shape for every pass of a bucket: a CUDA graph's static inputs, model/graphs.py)."""
        self.segments, self.cache, self.device = segments, cache, torch.device(device)
        self.every_seq = every_seq
        self.row0, n = [], 0
        for s in segments:
            self.row0.append(n)
            n += s.length
        self.rows = n
        self.n_causal = sum(s.length for s in segments if not s.canvas)
        kinds = [s.canvas for s in segments]
        if kinds != sorted(kinds):
            raise ValueError("causal segments must come before canvas segments")
        pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        self.positions = to_device(pos, torch.long, self.device)  # [N]
        self.backend = backend(self.device)
        self._slots: dict[str, torch.Tensor] = {}
        self._reads: dict[tuple[int, int | None], tuple] = {}
        self._rows: dict[tuple, tuple] = {}  # (group, window) -> the kernel's row arrays and block tables
        self._tiles: dict[tuple, tuple] = {}  # (tile, kind) -> row tiles

    def slots(self, group: str) -> torch.Tensor:
        """Device int64 slots where this pass writes: every row's position on full layers [N]; on sliding layers
        the causal rows' only, the last ring's worth of each segment (a ring never takes a canvas)."""
        if group not in self._slots:
            if group == "full":
                parts = [self.cache.slots(group, s.seq, s.start, s.start + s.length) for s in self.segments]
                rows = None
            else:
                keep = self.cache.ring_blocks * self.cache.block_size
                spans = [(r0 + max(0, s.length - keep), s, max(s.start, s.start + s.length - keep))
                         for s, r0 in zip(self.segments, self.row0) if not s.canvas]
                parts = [self.cache.slots(group, s.seq, lo, s.start + s.length) for _, s, lo in spans]
                rows = [torch.arange(r, r + s.start + s.length - lo) for r, s, lo in spans]
                rows = to_device(torch.cat(rows), torch.long, self.device) if rows else None
            host = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
            self._slots[group] = (to_device(host, torch.long, self.device), rows)
        return self._slots[group]

    def reads(self, j: int, group: str, window: int | None) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        """Segment j's key runs in the cache and its mask [rows, keys] (None for canvas rows: they read every key).
        Full layers: every key from the cache (written first). Sliding layers: the cache's keys before the
        segment, then the segment's own (this pass's k, v), as the reference orders them."""
        key = (j, window)
        if key not in self._reads:
            s = self.segments[j]
            lo, hi = s.keys(window)
            mask = None
            if not s.canvas:
                kpos = torch.arange(lo, hi, device=self.device)
                qpos = torch.arange(s.start, hi, device=self.device)[:, None]
                mask = kpos <= qpos if window is None else (kpos <= qpos) & (kpos > qpos - window)
            self._reads[key] = (self.cache.runs(group, s.seq, lo, hi if group == "full" else s.start), mask)
        return self._reads[key]

    def kernel_meta(self, group: str, window: int | None, tile: int, canvas: bool | None = None) -> tuple:
        """Per-row (sequence index, lo, hi, fresh position, fresh row) int32 on the device, the group's block
        tables, and row tiles of at most `tile` consecutive rows of one segment (of one kind, if `canvas` is
        given). Sliding layers read a segment's own positions from this pass's k, v (fresh), full layers none.
        The rows are built once per (group, window), the tiles once per (tile, kind): both kinds' launches and
        every layer of a kind share them."""
        if (group, window) not in self._rows:
            self._rows[group, window] = self._row_arrays(group, window)
        if (tile, canvas) not in self._tiles:
            t0, tn = [], []
            for s, r0 in zip(self.segments, self.row0):
                if canvas is None or canvas == s.canvas:
                    for a in range(0, s.length, tile):  # tiles of one segment's consecutive rows
                        t0.append(r0 + a), tn.append(min(tile, s.length - a))
            self._tiles[tile, canvas] = (to_device(t0, torch.int32, self.device), to_device(tn, torch.int32, self.device))
        row_seq, lo, hi, tables, f_pos, f_row = self._rows[group, window]
        return (row_seq, lo, hi, tables, *self._tiles[tile, canvas], f_pos, f_row)

    def _row_arrays(self, group: str, window: int | None) -> tuple:
        seqs = list(range(self.cache.seqs)) if self.every_seq else sorted({s.seq for s in self.segments})
        index = {q: i for i, q in enumerate(seqs)}
        row_seq, row_lo, row_hi, f_pos, f_row = [], [], [], [], []
        for s, r0 in zip(self.segments, self.row0):
            lo, hi = s.keys(window)
            for p in range(s.start, s.start + s.length):
                row_seq.append(index[s.seq])
                if s.canvas:
                    row_lo.append(lo), row_hi.append(hi)
                else:
                    row_lo.append(0 if window is None else max(0, p - window + 1)), row_hi.append(p + 1)
                f_pos.append(1 << 30 if group == "full" else s.start), f_row.append(r0)
        as_dev = functools.partial(to_device, dtype=torch.int32, device=self.device)
        tables = self.cache.table_tensor(group, seqs, fixed=self.every_seq)
        return as_dev(row_seq), as_dev(row_lo), as_dev(row_hi), tables, as_dev(f_pos), as_dev(f_row)

    def load(self, fresh: PassLayout) -> None:
        """Copy `fresh` (a layout of the same rows, segment lengths and kinds: other sequences, positions, block
        tables) into the device tensors this layout has built, in place: a captured pass's static inputs."""
        if [(s.length, s.canvas) for s in fresh.segments] != [(s.length, s.canvas) for s in self.segments]:
            raise ValueError("a layout loads only a pass of the same segment lengths and kinds")
        self.positions.copy_(fresh.positions)
        for group, (slots, rows) in self._slots.items():
            new, new_rows = fresh.slots(group)
            slots.copy_(new)
            if rows is not None:
                rows.copy_(new_rows)
        for (group, window), arrays in self._rows.items():
            for mine, theirs in zip(arrays, fresh._row_arrays(group, window)):
                mine.copy_(theirs)
        # the tiles depend only on the segments' lengths and kinds: equal by the check above


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, layout: PassLayout) -> torch.Tensor:
    """q [1, n, N, d], this pass's k, v [1, n_kv, N, d] of layer `layer` -> attention output [1, n, N, d].
    Full layers: every row's k, v written first, then every segment reads the cache. Sliding layers (a ring of
    about W-1 positions): the causal segments read the ring and their own k, v, then write theirs, then the
    canvases read the ring (a same-pass commit included) and their own k, v. Scale 1.0 (QK-norm absorbs
    1/sqrt(d)); no softcap; GQA by head groups."""
    cache = layout.cache
    group, window = cache.kind[layer], cache.windows[layer]
    out = torch.empty_like(q)
    if group == "full":
        cache.write(layer, layout.slots(group)[0], k[0], v[0])
        _attend(q, k, v, layer, layout, None, out)
        return out
    _attend(q, k, v, layer, layout, False, out)
    slots, rows = layout.slots(group)
    if rows is not None:
        cache.write(layer, slots, k[0].index_select(1, rows), v[0].index_select(1, rows))
    _attend(q, k, v, layer, layout, True, out)
    return out


def _attend(q, k, v, layer: int, layout: PassLayout, canvas: bool | None, out: torch.Tensor) -> None:
    """The segments of one kind (`canvas`; None: all) into `out`."""
    cache = layout.cache
    group, window = cache.kind[layer], cache.windows[layer]
    pool_k, pool_v = cache.k[layer], cache.v[layer]
    segments = [(j, s, r0) for j, (s, r0) in enumerate(zip(layout.segments, layout.row0))
                if canvas is None or s.canvas == canvas]
    if not segments:
        return
    fresh = group != "full"
    if layout.backend == "triton-paged":
        from dgcli.kernels.paged_attention import rows_per_tile

        tile = rows_per_tile(q.shape[1], k.shape[1], q.shape[-1], q.dtype)  # the kernel's block, in rows
        row_seq, lo, hi, tables, t0, tn, f_pos, f_row = layout.kernel_meta(group, window, tile, canvas)
        ops.paged_attention(q[0].transpose(0, 1), pool_k, pool_v, row_seq, lo, hi, tables, cache.block_size,
                            cache.ring_blocks if fresh else 0, t0, tn, k[0].transpose(0, 1) if fresh else None,
                            v[0].transpose(0, 1) if fresh else None, f_pos, f_row, out[0].transpose(0, 1))
        return
    for j, s, r0 in segments:
        runs, mask = layout.reads(j, group, window)
        keys = [pool_k[None, :, a:b] for a, b in runs]
        values = [pool_v[None, :, a:b] for a, b in runs]
        if fresh:  # the segment's own keys from this pass
            keys.append(k[:, :, r0:r0 + s.length])
            values.append(v[:, :, r0:r0 + s.length])
        if len(keys) > 1:
            keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        else:
            keys, values = keys[0], values[0]
        out[:, :, r0:r0 + s.length] = F.scaled_dot_product_attention(
            q[:, :, r0:r0 + s.length], keys, values, attn_mask=mask, scale=1.0, enable_gqa=True)
