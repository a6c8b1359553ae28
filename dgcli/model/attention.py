"""The one attention entry point: every row of a pass, every phase, over the paged KV cache, read in place.

One rule covers every phase: a row at position p of a sequence reads that sequence's key positions lo..hi-1, where
- causal rows (prompt chunks, committed blocks): hi = p + 1; lo = p - W + 1 on sliding layers of window W, else 0;
- canvas rows (one canvas at positions P..P+C-1): hi = P + C for every row; lo = P - (W - 1) on sliding layers (the
  reference's rectangle, not a per-row window; spec §6), else 0.
Full layers write every row's key and value to the cache before any row reads (a canvas at the positions its block
will commit to). Sliding layers keep a ring of the last W-1 positions: a segment reads the ring's keys before its
start and its own from this pass's k, v; causal segments write theirs after reading, then the canvases read (so a
commit and the next block's canvas can share a pass). No step copies a prefix.
Backends (`backend`): CUDA runs the Triton kernel (kernels/paged_attention.py) over block tables; elsewhere torch's
SDPA, segments of one shape (rows, keys, mask) batched into one call (`PassLayout.sdpa_plan`). On CPU the keys, their
order and the mask are the reference's own attention call's: the bits are SDPA's on those keys, whatever the batch
(tests/model/test_paged.py). Must not: know about requests, the sampler or blocks of the diffusion schedule.
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
    spans: tuple = ()  # causal rows only: (a, b) position runs inside it that see each other (an image's tokens)

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


# Full layers batch same-shaped segments into one SDPA call only while each one's keys and values take at most
# this many bytes: their keys are gathered from the pool (a copy), which pays where a call's fixed cost is larger
# than the copy (short prefixes); longer ones read their views of the pool, one call each.
GATHER_BYTES = 64 * 1024


_MASKS: dict[tuple, torch.Tensor] = {}  # small CPU masks, made once per process


def causal_mask(n: int, off: int, window: int | None, device: torch.device, spans: tuple = ()) -> torch.Tensor:
    """[n - off, n] bool: causal rows at key offsets off..n-1 of n keys read keys <= their own, within `window`,
    and every key of their span (`spans`: (a, b) key offsets). Small CPU masks are kept (read-only: SDPA does not
    write its mask); not one made under a tensor subclass's mode (fake tensors, tracing), which must not outlive it."""
    key = (n, off, window, device, spans)
    mask = _MASKS.get(key)
    if mask is None:
        kpos = torch.arange(n, device=device)
        qpos = torch.arange(off, n, device=device)[:, None]
        mask = kpos <= qpos if window is None else (kpos <= qpos) & (kpos > qpos - window)
        for a, b in spans:
            mask = mask | ((qpos >= a) & (qpos < b) & (kpos >= a) & (kpos < b))
        if device.type == "cpu" and type(mask) is torch.Tensor and (n - off) * n <= 1 << 16 and len(_MASKS) < 256:
            _MASKS[key] = mask
    return mask


def _batch_key(s: Segment, lo: int, hi: int) -> tuple:
    """Segments with equal keys may share one SDPA call: the same rows, keys lo..hi-1 and mask."""
    return s.length, hi - lo, s.start - lo, s.canvas, tuple((a - s.start, b - s.start) for a, b in s.spans)


@dataclass(frozen=True)
class _Call:
    m: int  # segments batched
    rows: int  # rows per segment
    n: int  # keys per segment
    keys: int | tuple  # offset of its first key in the gathered keys, or a lone segment's runs in the pool
    mask: torch.Tensor | None  # [rows, n], shared by the batch; None for canvases


@dataclass(frozen=True)
class _Plan:
    a: int  # the kind's rows a..b-1 of the pass
    b: int
    qperm: torch.Tensor | None
    gather: torch.Tensor | slice | None
    order: torch.Tensor | None
    calls: list
    q_sizes: list  # each call's rows (m · rows)
    k_sizes: list  # each call's keys (m · n) that reads the gathered keys


class PassLayout:
    """One pass's rows: segments in row order (causal before canvas), positions, write slots per cache group, the
    key runs and masks and the SDPA calls (CPU) or kernel row arrays (CUDA): host work once per pass. A captured
    pass (model/graphs.py) keeps one layout's device tensors and `load`s each later pass into them."""

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
        pos = [p for s in segments for p in range(s.start, s.start + s.length)]
        self.positions = to_device(pos, torch.long, self.device)  # [N]
        self.backend = backend(self.device)
        self._slots: dict[str, torch.Tensor] = {}
        self._reads: dict[tuple[int, int | None], tuple] = {}
        self._rows: dict[tuple, tuple] = {}  # (group, window) -> the kernel's row arrays and block tables
        self._tiles: dict[tuple, tuple] = {}  # (tile, kind) -> row tiles
        self._plans: dict[tuple, _Plan] = {}  # (group, window, kind) -> the CPU path's SDPA calls

    def slots(self, group: str) -> torch.Tensor:
        """Device int64 slots where this pass writes: every row's position on full layers [N]; on sliding layers
        the causal rows' only, the last ring's worth of each segment (a ring never takes a canvas)."""
        if group not in self._slots:
            if group == "full":
                host = [x for s in self.segments for x in self._slot_list(group, s.seq, s.start, s.start + s.length)]
                rows = None
            else:
                keep = self.cache.ring_blocks * self.cache.block_size
                spans = [(r0 + max(0, s.length - keep), s, max(s.start, s.start + s.length - keep))
                         for s, r0 in zip(self.segments, self.row0) if not s.canvas]
                host = [x for _, s, lo in spans for x in self._slot_list(group, s.seq, lo, s.start + s.length)]
                rows = [x for r, s, lo in spans for x in range(r, r + s.start + s.length - lo)]
                rows = to_device(rows, torch.long, self.device) if rows else None
            self._slots[group] = (to_device(host, torch.long, self.device), rows)
        return self._slots[group]

    def _slot_list(self, group: str, seq: int, lo: int, hi: int) -> list[int]:
        """`cache.slots(group, seq, lo, hi)` as a host list, expanded from its runs (no tensor op per segment)."""
        out = [x for a, b in self.cache.runs(group, seq, lo, hi) for x in range(a, b)]
        if out and min(out) < 0:  # a block the sequence does not hold (-1): cache.slots says which
            self.cache.slots(group, seq, lo, hi)
        return out

    def reads(self, j: int, group: str, window: int | None) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        """Segment j's key runs in the cache (sliding layers: those before the segment; its own come from this pass)
        and its mask [rows, keys] (None for canvas rows: they read every key)."""
        key = (j, window)
        if key not in self._reads:
            s = self.segments[j]
            lo, hi = s.keys(window)
            spans = tuple((a - lo, b - lo) for a, b in s.spans)
            mask = None if s.canvas else causal_mask(hi - lo, s.start - lo, window, self.device, spans)
            self._reads[key] = (self.cache.runs(group, s.seq, lo, hi if group == "full" else s.start), mask)
        return self._reads[key]

    def sdpa_plan(self, layer: int, canvas: bool | None) -> _Plan:
        """The segments of one kind (`canvas`; None: all) as SDPA calls, built once per pass and kind of layer.
        Segments of one shape (rows, keys, mask) share a call, unless that would copy more than GATHER_BYTES of a
        full layer's keys per segment: then each reads its views of the pool alone. `qperm`: the calls' rows as
        kind rows (None: in order). Keys: full layers, the batched calls' gathered from the pool (`gather`, a
        slice where one run), a lone segment's as runs of the pool; sliding layers, [every segment's ring keys
        (`gather`) | the kind's own rows] picked by `order` into each segment's ring keys then its own."""
        cache = self.cache
        group, window = cache.kind[layer], cache.windows[layer]
        key = (group, window, canvas)  # a group's layers share one key shape (the geometry is the kind's: config.py)
        if key not in self._plans:
            pool = cache.k[layer]
            per_key = 2 * pool.shape[0] * pool.shape[2] * pool.element_size()  # a key's and its value's bytes
            self._plans[key] = self._sdpa_plan(group, window, canvas, per_key)
        return self._plans[key]

    def _sdpa_plan(self, group: str, window: int | None, canvas: bool | None, key_bytes: int) -> _Plan:
        fresh = group != "full"
        kind = [(j, s, r0) for j, (s, r0) in enumerate(zip(self.segments, self.row0))
                if canvas is None or s.canvas == canvas]
        a = kind[0][2]
        shapes: dict[tuple, list] = {}  # batch key -> its segments, in row order
        for j, s, r0 in kind:
            lo, hi = s.keys(window)
            shapes.setdefault(_batch_key(s, lo, hi), []).append((j, s, r0, lo))
        batches = []  # (rows, keys, segments)
        for members in shapes.values():
            s, lo = members[0][1], members[0][3]
            shape = (s.length, s.keys(window)[1] - lo)
            if len(members) > 1 and not fresh and shape[1] * key_bytes > GATHER_BYTES:
                batches += [(*shape, [m]) for m in members]
            else:
                batches.append((*shape, members))
        qrows, gather, order, calls = [], [], [], []
        ring = sum(s.start - lo for *_, members in batches for _, s, _, lo in members) if fresh else 0
        for rows, n, members in batches:
            mask = self.reads(members[0][0], group, window)[1]  # the batch's one mask
            if fresh or len(members) > 1:
                keys = len(order) if fresh else len(gather)
                for j, s, r0, lo in members:
                    if fresh:  # ring keys at their place in `gather`, own keys after every ring key
                        order += range(len(gather), len(gather) + s.start - lo)
                        order += range(ring + r0 - a, ring + r0 - a + s.length)
                    gather += [x for p, e in self.reads(j, group, window)[0] for x in range(p, e)]
            else:
                keys = tuple(self.reads(members[0][0], group, window)[0])
            calls.append(_Call(len(members), rows, n, keys, mask))
            qrows += [x for _, s, r0, _ in members for x in range(r0 - a, r0 - a + s.length)]
        as_dev = functools.partial(to_device, dtype=torch.long, device=self.device)
        same = qrows == list(range(len(qrows)))
        if not gather:
            gather = None
        elif gather == list(range(gather[0], gather[0] + len(gather))):  # one run of the pool: a view
            gather = slice(gather[0], gather[0] + len(gather))
        else:
            gather = as_dev(gather)
        return _Plan(a, a + len(qrows), None if same else as_dev(qrows), gather,
                     None if order == list(range(len(order))) else as_dev(order), calls,
                     [c.m * c.rows for c in calls], [c.m * c.n for c in calls if isinstance(c.keys, int)])

    def kernel_meta(self, group: str, window: int | None, tile: int, canvas: bool | None = None) -> tuple:
        """Per-row (sequence index, lo, hi, fresh position, fresh row) int32 on the device, the group's block
        tables, and row tiles of at most `tile` consecutive rows of one segment (of one kind, if `canvas` is
        given); sliding layers read a segment's own positions from this pass's k, v (fresh). Built once per pass."""
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
                else:  # an image's rows also read their whole span (within this segment)
                    a, b = next(((a, b) for a, b in s.spans if a <= p < b), (p, p + 1))
                    row_lo.append(min(a, 0 if window is None else max(0, p - window + 1))), row_hi.append(b)
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
    """q [1, n, N, d], this pass's k, v [1, n_kv, N, d] of layer `layer` -> attention output [1, n, N, d], in the
    module docstring's order. Scale 1.0 (QK-norm absorbs 1/sqrt(d)); no softcap; GQA by head groups."""
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
    if (canvas is False and not layout.n_causal) or (canvas is True and layout.n_causal == layout.rows):
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
    plan = layout.sdpa_plan(layer, canvas)
    whole = plan.a == 0 and plan.b == layout.rows
    rows = (lambda t: t) if whole else (lambda t: t[:, :, plan.a:plan.b])  # [1, heads, rows, d]: the kind's rows
    qs, dst = rows(q), rows(out)
    if plan.qperm is not None:  # in call order
        qs, dst = qs[0].index_select(1, plan.qperm)[None], torch.empty_like(dst)  # (3-d: index_select's fast path)
    keys = values = None
    if fresh:  # the ring's keys the segments read (gathered), then the kind's own from this pass, in call order
        keys, values = rows(k), rows(v)
        if plan.gather is not None:
            keys = torch.cat((_take(pool_k, plan.gather), keys), dim=2)
            values = torch.cat((_take(pool_v, plan.gather), values), dim=2)
        if plan.order is not None:
            keys, values = keys[0].index_select(1, plan.order)[None], values[0].index_select(1, plan.order)[None]
    elif plan.gather is not None:  # the keys of the batched calls, gathered (each bounded by GATHER_BYTES)
        keys, values = _take(pool_k, plan.gather), _take(pool_v, plan.gather)
    pieces = (lambda t, sizes: (t,)) if len(plan.calls) == 1 else (lambda t, sizes: t.split(sizes, dim=2))
    if keys is not None:
        keys, values = iter(pieces(keys, plan.k_sizes)), iter(pieces(values, plan.k_sizes))
    strides, (_, hq, _, d), hk = None, q.shape, k.shape[1]  # a batched call's views: a tensor's pieces share strides
    heads = (hq, hq, hk, hk)
    for c, qc, oc in zip(plan.calls, pieces(qs, plan.q_sizes), pieces(dst, plan.q_sizes)):
        if isinstance(c.keys, int):  # c.m segments' keys, one after another
            kc, vc = next(keys), next(values)
        else:  # a lone segment's runs in the pool: views (concatenated when its blocks are not consecutive)
            kc = [pool_k[None, :, a:b] for a, b in c.keys]
            vc = [pool_v[None, :, a:b] for a, b in c.keys]
            kc, vc = (torch.cat(kc, dim=2), torch.cat(vc, dim=2)) if len(kc) > 1 else (kc[0], vc[0])
        if c.m > 1:  # [1, heads, m·rows, d] -> [m, heads, rows, d]: views
            if strides is None:
                strides = [t.stride() for t in (qc, oc, kc, vc)]
            qc, oc, kc, vc = (t.as_strided((c.m, h, r, d), (r * st[2], *st[1:])) for t, h, r, st in zip(
                (qc, oc, kc, vc), heads, (c.rows, c.rows, c.n, c.n), strides))
        oc.copy_(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=1.0, enable_gqa=True))
    if plan.qperm is not None:
        rows(out)[0].index_copy_(1, plan.qperm, dst[0])


def _take(pool: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    """The pool's keys at `slots` [1, n_kv, len, d]: a view for one run, else gathered."""
    return pool[None, :, slots] if isinstance(slots, slice) else pool.index_select(1, slots)[None]
