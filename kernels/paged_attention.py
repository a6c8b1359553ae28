"""Attention over a paged KV cache as a Triton kernel (CUDA), plus a combine kernel for long intervals:
`paged_attention` (spec: `reference_ops.paged_attention_reference`) and the row-tile helpers `rows_per_tile` / `row_tiles` the engine uses
to build the tile list once per plan. Must not: write the cache, allocate blocks, know phases (prompt, commit and
canvas are all "row i attends positions lo..hi-1 of its sequence"), or sync with the host when the tiles are given
(the engine captures it in a CUDA graph).

Kernel: grid (tiles, kv heads, key pieces x V_PARTS). A program owns one row tile (consecutive rows of one sequence)
and one kv head, and stacks the tile's rows x the head's GROUP query heads into the M dimension, so each key/value tile is loaded once
for all of them (GQA). It walks the key positions min(lo)..max(hi)-1 of its rows in BLOCK_N steps, gathers each
key's slot through the block table, masks per row and keeps an online softmax. A tile larger than the block is done
in chunks (any tile list is correct; `rows_per_tile` rows is the fast one); a tile of 0 rows does nothing (padding
to a fixed grid for capture). With FRESH (sliding layers), a tile's keys at and past its segment's first position
come from the pass's own k, v (k_new / v_new): the cache has not been written there yet (model/attention.py).
Split over keys: a row chunk whose interval spans >= 2·MIN_CHUNK keys is cut into up to SPLITS pieces (`_chunks`),
one program each, writing (unnormalized sum, max, total) to a scratch; `_combine_kernel` sums the pieces in order.
The cut is a function of the chunk's own interval; the grid's SPLITS axis (`launches`) of a shape bound on any
interval (the table's reach): no host read, and a row's bits do not depend on its batch-mates. V_PARTS programs
share a tile's output dims (each its part of P·V, all the same scores) so d 512 fits registers on wgmma tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_common  # noqa: F401  (the interpreter's bf16 dots made exact)

# (BLOCK_M query slots = rows x group, BLOCK_N keys, num_warps, num_stages, V_PARTS: programs sharing a tile's
# output dims) by storage dtype and padded head dim. Not timed: chosen so each compiles for sm_90 and sm_80 without
# spills (benchmarks/kernel_targets.py), bf16 on wgmma (BLOCK_M 64) on sm_90; d 512 splits its [64, 512] fp32
# accumulator over 4 programs (each recomputes the scores). fp32's full-precision FMA dots need fewer keys per tile.
TILES = {"bf16": {128: (64, 64, 8, 3, 1), 256: (64, 16, 8, 2, 1), 512: (64, 16, 8, 2, 4)},
         "fp32": {128: (64, 32, 8, 2, 1), 256: (64, 16, 8, 2, 1), 512: (16, 32, 8, 1, 1)}}
# Split over keys (flash-decoding): a row chunk whose interval spans >= 2·MIN_CHUNK keys is cut into up to SPLITS
# pieces, one program each, and _combine_kernel sums them. A function of the chunk's own interval only: the same
# rows give the same bits whatever else is in the pass.
SPLITS, MIN_CHUNK = 4, 1024


@triton.jit
def _chunks(lo_min, hi_max, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row chunk's keys start..hi_max-1 cut into n pieces of `length` keys (BLOCK_N multiples): n = 1 below
    2·MIN_CHUNK keys, else one per MIN_CHUNK up to SPLITS. Functions of the chunk's own interval only."""
    start = lo_min // BLOCK_N * BLOCK_N
    span = tl.maximum(hi_max - start, 0)
    n = tl.minimum(tl.maximum(span // MIN_CHUNK, 1), SPLITS)
    return start, tl.cdiv(tl.cdiv(span, n), BLOCK_N) * BLOCK_N, n


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_ptr, lo_ptr, hi_ptr, tab_ptr, t0_ptr, tn_ptr,
                            kn_ptr, vn_ptr, fp_ptr, fr_ptr, part_ptr, ml_ptr,
                            ring_blocks, D, stride_qn, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                            stride_on, stride_oh, stride_t, stride_kn, stride_knh, stride_vn, stride_vnh, stride_ps,
                            GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, RING: tl.constexpr,
                            FRESH: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                            MIN_CHUNK: tl.constexpr, V_PARTS: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2) // V_PARTS  # the keys' piece, and below the output dims' part (registers)
    n_heads = tl.num_programs(1) * GROUP
    row0 = tl.load(t0_ptr + tile)
    n_rows = tl.load(tn_ptr + tile)
    slot_m = tl.arange(0, BLOCK_M)  # query slot m = (row r of the chunk, query head g of this kv head)
    r = slot_m // GROUP
    head = (kvh * GROUP + slot_m % GROUP).to(tl.int64)  # x stride_qh: q may be a [n, N, d] tensor transposed
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    dv = tl.program_id(2) % V_PARTS * (BLOCK_D // V_PARTS) + tl.arange(0, BLOCK_D // V_PARTS)
    dv_ok = dv < D
    seq = tl.load(seq_ptr + row0, mask=n_rows > 0, other=0)  # every row of a tile is of this sequence
    tab = tab_ptr + seq.to(tl.int64) * stride_t
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    if FRESH:  # positions >= fresh_pos are this pass's own keys (rows fresh_row.. of k_new), not the cache's
        fresh_pos = tl.load(fp_ptr + row0, mask=n_rows > 0, other=0)  # one segment per tile: its values
        fresh_row = tl.load(fr_ptr + row0, mask=n_rows > 0, other=0)
        kn_base = kn_ptr + kvh.to(tl.int64) * stride_knh
        vn_base = vn_ptr + kvh.to(tl.int64) * stride_vnh
    for c0 in range(0, n_rows, ROWS):
        rows = row0 + c0 + r
        m_ok = (r < ROWS) & (c0 + r < n_rows)  # r < ROWS: the unused slots when GROUP is not a power of 2
        lo = tl.load(lo_ptr + rows, mask=m_ok, other=2**30)  # unused slots: an empty interval
        hi = tl.load(hi_ptr + rows, mask=m_ok, other=0)
        start, length, n_split = _chunks(tl.min(lo, axis=0), tl.max(hi, axis=0), SPLITS, MIN_CHUNK, BLOCK_N)
        if split < n_split:  # this program's piece of the keys: start + split·length ..
            q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qn + head[:, None] * stride_qh + dd[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
            if not DOT_BF16:  # fp32: full-precision products
                q = q.to(tl.float32)
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D // V_PARTS), tl.float32)
            first = start + split * length
            for p0 in range(first, tl.minimum(first + length, tl.max(hi, axis=0)), BLOCK_N):
                pos = p0 + tl.arange(0, BLOCK_N)
                attend = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])  # [BM, BN]
                # Only positions some row attends are read: a slot between intervals may hold another position
                # (a ring) or garbage (NaN x a zero probability is NaN), an entry past the table's end no block.
                k_ok = tl.max(attend.to(tl.int32), axis=0) > 0  # [BN]
                logical = pos // BLOCK_SIZE
                if RING:
                    logical = logical % ring_blocks
                in_cache = k_ok
                if FRESH:
                    new = pos >= fresh_pos
                    in_cache = k_ok & (pos < fresh_pos)
                blk = tl.load(tab + logical, mask=in_cache, other=0)
                slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [BN]
                k_off = k_base + slot * stride_ks  # [BN] row starts
                v_off = v_base + slot * stride_vs
                if FRESH:  # the pass's own rows instead: one pointer per key, so one load
                    nrow = (fresh_row + pos - fresh_pos).to(tl.int64)  # [BN]
                    k_off = tl.where(new, kn_base + nrow * stride_kn, k_off)
                    v_off = tl.where(new, vn_base + nrow * stride_vn, v_off)
                # keys as rows, the head dim contiguous (vector loads)
                k = tl.load(k_off[:, None] + dd[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BD]
                v = tl.load(v_off[:, None] + dv[None, :], mask=k_ok[:, None] & dv_ok[None, :], other=0.0)  # [BN, BV]
                if DOT_BF16:  # bf16 operands as loaded: tensor cores, fp32 accumulation
                    s = tl.dot(q, tl.trans(k))
                else:  # full fp32 products, not TF32
                    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
                s = tl.where(attend, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: no inf - inf
                p = tl.exp(s - m_safe[:, None])  # 0 where not attended
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None]
                if DOT_BF16:
                    acc = tl.dot(p.to(tl.bfloat16), v, acc)
                else:
                    acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
                m_i = m_new
            o_off = rows[:, None].to(tl.int64) * stride_on + head[:, None] * stride_oh + dv[None, :]  # [BM, BV]
            if n_split == 1:  # the whole interval: the output
                out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
                tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
            else:  # a piece for _combine_kernel: its unnormalized sum (laid out as the output), max and total
                tl.store(part_ptr + split * stride_ps + o_off, acc, mask=m_ok[:, None] & dv_ok[None, :])
                ml = ml_ptr + ((rows.to(tl.int64) * n_heads + head) * SPLITS + split) * 2  # [BM]
                tl.store(ml, m_i, mask=m_ok & (tl.program_id(2) % V_PARTS == 0))  # once
                tl.store(ml + 1, l_i, mask=m_ok & (tl.program_id(2) % V_PARTS == 0))


@triton.jit
def _combine_kernel(o_ptr, lo_ptr, hi_ptr, t0_ptr, tn_ptr, part_ptr, ml_ptr, D, stride_on, stride_oh, stride_ps,
                    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, CHUNK_D: tl.constexpr):
    """The split tiles' outputs from their pieces, in piece order: out = Σ acc_s·e^(m_s−M) / Σ l_s·e^(m_s−M)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    n_heads = tl.num_programs(1) * GROUP
    row0 = tl.load(t0_ptr + tile)
    n_rows = tl.load(tn_ptr + tile)
    slot_m = tl.arange(0, BLOCK_M)
    r = slot_m // GROUP
    head = (kvh * GROUP + slot_m % GROUP).to(tl.int64)
    for c0 in range(0, n_rows, ROWS):
        rows = row0 + c0 + r
        m_ok = (r < ROWS) & (c0 + r < n_rows)
        lo = tl.load(lo_ptr + rows, mask=m_ok, other=2**30)
        hi = tl.load(hi_ptr + rows, mask=m_ok, other=0)
        _, _, n_split = _chunks(tl.min(lo, axis=0), tl.max(hi, axis=0), SPLITS, MIN_CHUNK, BLOCK_N)
        if n_split > 1:
            ml = ml_ptr + (rows.to(tl.int64) * n_heads + head) * SPLITS * 2  # [BM]: this row's pieces
            big = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            for s in range(0, n_split):
                big = tl.maximum(big, tl.load(ml + 2 * s, mask=m_ok, other=float("-inf")))
            big = tl.where(big == float("-inf"), 0.0, big)
            for d0 in tl.static_range(0, BLOCK_D, CHUNK_D):  # the head dim in chunks: registers
                dd = d0 + tl.arange(0, CHUNK_D)
                o_off = rows[:, None].to(tl.int64) * stride_on + head[:, None] * stride_oh + dd[None, :]
                ok = m_ok[:, None] & (dd < D)[None, :]
                total = tl.zeros((BLOCK_M,), tl.float32)
                acc = tl.zeros((BLOCK_M, CHUNK_D), tl.float32)
                for s in range(0, n_split):
                    w = tl.exp(tl.load(ml + 2 * s, mask=m_ok, other=float("-inf")) - big)  # [BM]
                    total = total + tl.load(ml + 2 * s + 1, mask=m_ok, other=0.0) * w
                    acc = acc + tl.load(part_ptr + s * stride_ps + o_off, mask=ok, other=0.0) * w[:, None]
                out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
                tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=ok)


def _blocks(head_dim: int, group: int, dtype: torch.dtype) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages, V_PARTS) for a head dim, a GQA group and a dtype."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    table = TILES["bf16" if dtype == torch.bfloat16 else "fp32"]
    if block_d > max(table):
        raise ValueError(f"paged_attention supports head dims up to {max(table)}, got {head_dim}")
    bm, bn, warps, stages, parts = table[min(k for k in table if k >= block_d)]
    return max(bm, triton.next_power_of_2(group)), bn, block_d, warps, stages, parts


def launches(head_dim: int, group: int, dtype: torch.dtype, reach: int) -> list[tuple[str, dict, dict]]:
    """What `paged_attention` launches on CUDA for these shapes (reach: a bound on any row's interval, in keys):
    (kernel, shape constexprs with CUDA's DOT_BF16, launch options), the combine second where keys may be split.
    benchmarks/kernel_targets.py compiles exactly these."""
    bm, bn, bd, warps, stages, parts = _blocks(head_dim, group, dtype)
    splits = SPLITS if reach >= 2 * MIN_CHUNK - bn else 1  # else no interval can reach 2·MIN_CHUNK keys
    rows = dict(GROUP=group, ROWS=bm // group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, SPLITS=splits, MIN_CHUNK=MIN_CHUNK)
    out = [("_paged_attention_kernel", dict(rows, DOT_BF16=dtype == torch.bfloat16, V_PARTS=parts),
            dict(num_warps=warps, num_stages=stages))]
    if splits > 1:
        out.append(("_combine_kernel", dict(rows, CHUNK_D=min(bd, 128)), dict(num_warps=4)))
    return out


def rows_per_tile(n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """How many rows one program's block holds: the tile size to give `row_tiles`. Any tile list is correct
    (a larger tile is walked in chunks by one program); tiles of this size fill the blocks and the grid."""
    group = n_heads // n_kv
    return _blocks(head_dim, group, dtype)[0] // group


def row_tiles(rows_per_seq, tile: int, device: torch.device | str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side tile list: the sequences' row counts in row order (ints) -> (tile_row0, tile_rows) [n_tiles]
    int32, each sequence's rows cut into tiles of at most `tile` rows."""
    row0, rows, start = [], [], 0
    for count in rows_per_seq:
        for a in range(0, int(count), tile):
            row0.append(start + a)
            rows.append(min(tile, int(count) - a))
        start += int(count)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(row0), as_t(rows)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, row_seq: torch.Tensor,
                    row_lo: torch.Tensor, row_hi: torch.Tensor, tables: torch.Tensor, block_size: int,
                    ring_blocks: int = 0, tile_row0: torch.Tensor | None = None,
                    tile_rows: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, fresh_pos: torch.Tensor | None = None,
                    fresh_row: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`reference_ops.paged_attention_reference` (same arguments and semantics) by the kernel. tile_row0/tile_rows
    [n_tiles] int32 (`row_tiles`): given, nothing is read back to the host and only the tiles' rows are computed;
    None, they are built from row_seq (a host read). Every row of a tile must share fresh_pos / fresh_row (tiles
    are cut per segment). `out` [N, n_heads, d]: written in place (the tiles' rows), else a new tensor."""
    if q.dtype not in (torch.float32, torch.bfloat16) or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"paged_attention needs q, k_pool, v_pool all float32 or all bfloat16, got "
                        f"{q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2, got {block_size}")
    n, n_heads, d = q.shape
    n_kv = k_pool.shape[0]
    if n_heads % n_kv or k_pool.shape[2] != d or v_pool.shape != k_pool.shape:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, "
                         f"v_pool {tuple(v_pool.shape)}")
    group = n_heads // n_kv
    out = torch.empty(n, n_heads, d, dtype=q.dtype, device=q.device) if out is None else out  # [N, H, d]
    fresh = k_new is not None
    if fresh and (v_new is None or fresh_pos is None or fresh_row is None or k_new.shape != (n, n_kv, d)):
        raise ValueError("fresh keys need k_new, v_new [N, n_kv, d], fresh_pos and fresh_row")
    if not fresh:  # unused pointers: any tensors of the right kinds
        k_new = v_new = k_pool
        fresh_pos = fresh_row = row_lo
    if tile_row0 is None:
        counts = torch.unique_consecutive(row_seq.cpu(), return_counts=True)[1].tolist() if n else []
        tile_row0, tile_rows = row_tiles(counts, rows_per_tile(n_heads, n_kv, d, q.dtype), q.device)
    if n == 0 or tile_row0.numel() == 0:
        return out
    q, k_pool, v_pool, k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous()
                                       for t in (q, k_pool, v_pool, k_new, v_new))
    tables = _int32(tables)
    reach = (ring_blocks if ring_blocks > 0 else tables.shape[1]) * block_size + (n if fresh else 0)  # interval bound
    (_, flags, opts), *combine = launches(d, group, q.dtype, reach)
    flags.update(RING=ring_blocks > 0, FRESH=fresh, BLOCK_SIZE=block_size)
    splits = flags["SPLITS"]
    slab = (n - 1) * out.stride(0) + (n_heads - 1) * out.stride(1) + d  # a piece: laid out as `out`
    part = out.new_empty(splits * slab if splits > 1 else 0, dtype=torch.float32)  # [splits, slab]
    ml = part.new_empty(n * n_heads * splits * 2 if splits > 1 else 0)  # [N, n_heads, splits, 2] (max, total)
    kn_s = (k_new.stride(0), k_new.stride(1)) if fresh else (0, 0)
    vn_s = (v_new.stride(0), v_new.stride(1)) if fresh else (0, 0)
    t0, tn, lo, hi = _int32(tile_row0), _int32(tile_rows), _int32(row_lo), _int32(row_hi)
    _paged_attention_kernel[(t0.numel(), n_kv, splits * flags["V_PARTS"])](
        q, k_pool, v_pool, out, _int32(row_seq), lo, hi, tables, t0, tn, k_new, v_new, _int32(fresh_pos),
        _int32(fresh_row), part, ml, max(int(ring_blocks), 1), d, q.stride(0), q.stride(1), k_pool.stride(0),
        k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1), tables.stride(0), *kn_s,
        *vn_s, slab, **flags, **opts)
    for _, flags, opts in combine:  # where the keys may be split: the pieces summed
        _combine_kernel[(t0.numel(), n_kv)](out, lo, hi, t0, tn, part, ml, d, out.stride(0), out.stride(1),
                                            slab, **flags, **opts)
    return out
