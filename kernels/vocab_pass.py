"""The fused vocabulary pass as Triton kernels (CUDA): `vocab_pass_triton`, the twin of `reference.vocab_pass`
(same arguments and `VocabPassOut`) without a [N, V] float32 tensor. Must not: know about the denoising loop or
sync with the host (every launch grid depends on shapes only).

1. `_stats_kernel`, grid (row blocks, vocabulary splits): the head GEMM tile by tile, the online max / first argmax
   / Σexp / entropy sums per split and the draw's per-tile sums; `_combine_kernel` merges the splits row by row,
   in split order. With the soft embedding it also stores bf16(L) (the logits as the reference keeps them) into a
   [rows, V] scratch: at a 256-row canvas ~0.27 GB moved against a second head GEMM's 1.5 GB read and 0.38 TFLOP.
2. `_probs_kernel` turns the scratch into p = bf16(exp(bf16(L) - Mb)/Zb) in place, then `soft_gemm`: p times E,
   split-K over the vocabulary, the partials added in split order. Not bit for bit with the reference, whose
   softmax sums exp in its own order (~0.2 % of the bf16 probabilities move by one step at V = 262,144).
3. The draw: the reference's inverse CDF located through the per-tile sums (kernels/categorical.py), the chosen
   tile's logits recomputed by `_group_logits_kernel` in one launch.
Bits: a row's numbers depend on BLOCK_N, BLOCK_K, the stats kernel's warp layout and the two split counts, so these
are constants (not functions of the SM or row count): the same bits for a row alone or in a batch. The soft kernel
has no cross-thread reduction, so its other tile sizes are autotuned on CUDA (SOFT_TUNE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .categorical import draw_from_groups
from .reference import VocabPassOut, row_temperature
from .triton_common import interpreting, round_to, tanh

# Constants, not functions of the GPU or the rows: the split orders are part of the bits. 64 vocabulary splits:
# 4,096 columns each at V = 262,144, ~2 waves on 132 SMs at a 256-row canvas; 8 soft splits: 1,408 programs there.
VOCAB_SPLITS = 64
SOFT_SPLITS = 8
GROUP_BLOCK_K = 128  # the draw's group kernel: [64, 128] embedding tiles
SCRATCH_BYTES = 512 * 2**20  # the bf16(L) scratch of one row chunk: 1,024 rows at V = 262,144 in bf16
# The tile the wrapper launches when none is given (the stats kernel always; the soft kernel off the autotuner);
# benchmarks/kernel_targets.py compiles what this says.
TILE = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)
# The soft kernel's autotuned (BLOCK_M, BLOCK_N, num_warps, num_stages) by model dtype (BLOCK_K fixed: it sets the
# K order); none spills (benchmarks/kernel_targets.py: fp32's FMA dots do at [64, 128] on 4 warps).
SOFT_TUNE = {"bf16": ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (64, 128, 8, 4)),
             "fp32": ((64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 4))}


@triton.jit
def _logits_tile(h_ptr, e_ptr, rows, row_ok, cols, col_ok, H, stride_h, stride_e, temp, softcap,
                 HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """L = softcap·tanh(bf16(h·Eᵀ)/softcap)/temp for a [BLOCK_M, BLOCK_N] tile (fp32)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        b = tl.load(e_ptr + cols[None, :].to(tl.int64) * stride_e + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)  # [BK, BN]
        if DOT_BF16:  # the bf16 operands as loaded: the tensor cores at full rate, fp32 accumulation
            acc = tl.dot(a, b, acc)
        else:  # fp32 storage: full fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    raw = round_to(acc, IS_BF16)  # the reference's head GEMM output is in the model dtype
    if HAS_SOFTCAP:
        raw = tanh(raw / softcap) * softcap
    return raw / temp


@triton.jit
def _stats_kernel(h_ptr, e_ptr, temp_ptr, m_ptr, z_ptr, s_ptr, amax_ptr, zb_ptr, tm_ptr, tz_ptr, l_ptr,
                  N, V, H, n_tiles, cols_per_split, stride_h, stride_e, stride_l, softcap,
                  HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, WANT_SOFT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)[:, None]  # [BM, 1] one per row
    v_lo = split * cols_per_split
    v_hi = tl.minimum(V, v_lo + cols_per_split)
    neg_inf = float("-inf")
    m = tl.full((BLOCK_M,), neg_inf, tl.float32)
    z = tl.zeros((BLOCK_M,), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    zb = tl.zeros((BLOCK_M,), tl.float32)
    amax = tl.zeros((BLOCK_M,), tl.int32)
    for v0 in range(v_lo, v_hi, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_ok = cols < v_hi
        L = _logits_tile(h_ptr, e_ptr, rows, row_ok, cols, col_ok, H, stride_h, stride_e, temp, softcap,
                         HAS_SOFTCAP, IS_BF16, DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
        L = tl.where(col_ok[None, :], L, neg_inf)
        tmax = tl.max(L, axis=1)
        targ = tl.argmax(L, axis=1).to(tl.int32) + v0  # first index on ties
        amax = tl.where(tmax > m, targ, amax)  # strict: the earlier tile keeps ties
        m_new = tl.maximum(m, tmax)
        first = m == neg_inf
        alpha = tl.where(first, 0.0, tl.exp(m - m_new))
        dm = tl.where(first, 0.0, m - m_new)
        d = tl.where(col_ok[None, :], L - m_new[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(d), 0.0)
        s = alpha * (s + z * dm) + tl.sum(e * d, axis=1)  # Σ exp(L-m)(L-m) under the new max
        tile_z = tl.sum(e, axis=1)
        z = alpha * z + tile_z
        # The draw's statistics for this tile: its mass relative to m_new (>= the tile's own max).
        at = rows.to(tl.int64) * n_tiles + v0 // BLOCK_N
        tl.store(tm_ptr + at, m_new, mask=row_ok)
        tl.store(tz_ptr + at, tile_z, mask=row_ok)
        if WANT_SOFT:
            # Σ exp(bf16(L) - bf16(m)): the reference's softmax reads the rounded logits and subtracts their
            # max, which is the rounded max of L (rounding is monotone); the same shift, the same exp args.
            lb = round_to(L, IS_BF16)  # L as the reference stores it between steps
            tl.store(l_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :], lb.to(l_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])  # exact: lb holds model-dtype values
            mb_new = round_to(m_new, IS_BF16)
            alpha_b = tl.where(first, 0.0, tl.exp(round_to(m, IS_BF16) - mb_new))
            eb = tl.where(col_ok[None, :], tl.exp(lb - mb_new[:, None]), 0.0)
            zb = alpha_b * zb + tl.sum(eb, axis=1)
        m = m_new
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(z_ptr + out, z, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(amax_ptr + out, amax, mask=row_ok)
    tl.store(zb_ptr + out, zb, mask=row_ok)


@triton.jit
def _probs_kernel(l_ptr, mb_ptr, zb_ptr, N, V, stride_l, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """The scratch's bf16(L) -> p = bf16(exp(bf16(L) - Mb)/Zb), in place: once per logit."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ks < V
    lb = tl.load(l_ptr + row * stride_l + ks, mask=ok, other=0.0).to(tl.float32)
    p = round_to(tl.exp(lb - tl.load(mb_ptr + row)) / tl.load(zb_ptr + row), IS_BF16)  # softmax_fp32(bf16 L)
    tl.store(l_ptr + row * stride_l + ks, p.to(l_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _soft_kernel(p_ptr, e_ptr, part_ptr, N, V, H, cols_per_split, stride_p, stride_e, stride_ps, stride_pn,
                 DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[split, rows, cols] = Σ over this split's vocabulary of p·E: a plain split-K GEMM."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden channels
    col_ok = cols < H
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * cols_per_split
    k_hi = tl.minimum(V, k_lo + cols_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        p = tl.load(p_ptr + rows[:, None].to(tl.int64) * stride_p + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        b = tl.load(e_ptr + ks[:, None].to(tl.int64) * stride_e + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # [BK, BN]
        if DOT_BF16:  # p holds bf16 values: exact as bf16
            acc = tl.dot(p.to(tl.bfloat16), b, acc)
        else:
            acc = tl.dot(p.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    ptrs = part_ptr + split.to(tl.int64) * stride_ps + rows[:, None].to(tl.int64) * stride_pn + cols[None, :]
    tl.store(ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])


def soft_gemm(p: torch.Tensor, embed: torch.Tensor, block_k: int = 64, soft_tile: tuple | None = None) -> torch.Tensor:
    """Σ_v p[n, v]·E[v] -> fp32 [n, H] (p [n, V] in E's dtype): SOFT_SPLITS split-K partials over the
    vocabulary, each one tl.dot chain in BLOCK_K steps, added elementwise in split order: a row's bits do not
    depend on the other rows (batch-invariant)."""
    (n, v), h = p.shape, embed.shape[1]
    kernel, tile = soft_tile or _soft_launcher(interpreting(), None, None, embed.dtype)
    per_soft = triton.cdiv(triton.cdiv(v, SOFT_SPLITS), block_k) * block_k
    soft_splits = triton.cdiv(v, per_soft)
    part = torch.empty(soft_splits, n, h, dtype=torch.float32, device=p.device)  # [S, n, H] split-K partials
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), triton.cdiv(h, meta["BLOCK_N"]), soft_splits)  # noqa: E731
    kernel[grid](p, embed, part, n, v, h, per_soft, p.stride(0), embed.stride(0), part.stride(0), part.stride(1),
                 DOT_BF16=embed.dtype == torch.bfloat16, BLOCK_K=block_k, **tile)
    acc = part[0].clone()
    for k in range(1, soft_splits):  # elementwise, splits in order (a torch .sum(0) picks its order by shape)
        acc += part[k]
    return acc


@triton.jit
def _combine_kernel(m_ptr, z_ptr, s_ptr, amax_ptr, zb_ptr, mb_ptr, ent_ptr, arg_ptr, zbt_ptr, N, S,
                    IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Merge the splits' statistics [S, N] per row, splits in ascending order: a row's result depends on its
    own statistics only (a torch reduction over the splits may pick its order by the tensor's shape, i.e. by
    the batch). The soft embedding's max and sum are those of the logits rounded to the model dtype."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    for k in range(0, S):
        mx = tl.maximum(mx, tl.load(m_ptr + k * N + rows, mask=ok, other=0.0))
    mb = round_to(mx, IS_BF16)  # the max of the rounded logits (rounding is monotone)
    zt = tl.zeros((BLOCK,), tl.float32)
    st = tl.zeros((BLOCK,), tl.float32)
    zbt = tl.zeros((BLOCK,), tl.float32)
    arg = tl.zeros((BLOCK,), tl.int32)
    found = tl.zeros((BLOCK,), tl.int1)
    for k in range(0, S):
        m = tl.load(m_ptr + k * N + rows, mask=ok, other=0.0)
        z = tl.load(z_ptr + k * N + rows, mask=ok, other=0.0)
        alpha = tl.exp(m - mx)
        zt += alpha * z
        st += alpha * (tl.load(s_ptr + k * N + rows, mask=ok, other=0.0) + z * (m - mx))
        zbt += tl.exp(round_to(m, IS_BF16) - mb) * tl.load(zb_ptr + k * N + rows, mask=ok, other=0.0)
        first = (m == mx) & (found == 0)  # the earliest split holding the max: the first argmax
        arg = tl.where(first, tl.load(amax_ptr + k * N + rows, mask=ok, other=0), arg)
        found = found | first
    tl.store(mb_ptr + rows, mb, mask=ok)
    zt = tl.where(ok, zt, 1.0)  # rows past N: no log(0) (never stored)
    tl.store(ent_ptr + rows, tl.log(zt) - st / zt, mask=ok)
    tl.store(arg_ptr + rows, arg.to(tl.int64), mask=ok)
    tl.store(zbt_ptr + rows, zbt, mask=ok)


def _combine(m, z, s, amax, zb, soft_dtype):
    """Per-split statistics [S, N] -> (mb, entropy, argmax, zbt) [N] (see `_combine_kernel`)."""
    splits, n = m.shape
    mb, entropy, zbt = (torch.empty(n, dtype=torch.float32, device=m.device) for _ in range(3))
    argmax = torch.empty(n, dtype=torch.int64, device=m.device)
    block = 128
    _combine_kernel[(triton.cdiv(n, block),)](m, z, s, amax, zb, mb, entropy, argmax, zbt, n, splits,
                                              IS_BF16=soft_dtype == torch.bfloat16, BLOCK=block)
    return mb, entropy, argmax, zbt


@triton.jit
def _group_logits_kernel(h_ptr, e_ptr, g_ptr, temp_ptr, out_ptr, V, H, stride_h, stride_e, softcap,
                         HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr, WIDTH: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One row's processed logits over the WIDTH columns of its chosen group (-inf past V), as
    `categorical.group_logits` computes them: head in the model dtype, softcap, temperature."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.load(g_ptr + row) * WIDTH + tl.arange(0, WIDTH)
    col_ok = cols < V
    acc = tl.zeros((WIDTH,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        h = tl.load(h_ptr + row * stride_h + ks, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        e = tl.load(e_ptr + cols[:, None].to(tl.int64) * stride_e + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [W, BK]
        acc += tl.sum(e * h[None, :], axis=1)
    raw = round_to(acc, IS_BF16)
    if HAS_SOFTCAP:
        raw = tanh(raw / softcap) * softcap
    L = raw / tl.load(temp_ptr + row)
    tl.store(out_ptr + row * WIDTH + tl.arange(0, WIDTH), tl.where(col_ok, L, float("-inf")))


def _group_logits(rows, embed, group, width, softcap, temperature):
    """`categorical.group_logits` as one kernel launch: L [N, width] fp32 of each row's group `group` [N]."""
    n, h = rows.shape
    out = torch.empty(n, width, dtype=torch.float32, device=rows.device)  # [N, W]
    temp = temperature.reshape(n).contiguous()  # [N] (the pass hands one per row)
    if n:
        _group_logits_kernel[(n,)](rows, embed, group.contiguous(), temp, out, embed.shape[0], h, rows.stride(0),
                                   embed.stride(0), float(softcap) if softcap else 1.0, HAS_SOFTCAP=bool(softcap),
                                   IS_BF16=embed.dtype == torch.bfloat16, WIDTH=width, BLOCK_K=GROUP_BLOCK_K)
    return out


def _soft_launcher(interpreting: bool, block_m: int | None, block_n: int | None, dtype: torch.dtype):
    """The soft kernel and its fixed tile, or (on CUDA, no tile asked for) its autotuned twin, keyed by
    (H, V, rows), and no tile. The autotuner times its configurations at the first call of each key: the
    static step's warm-up runs (outside any CUDA-graph capture) make that call; its picks stay in Triton's on-disk
    cache for later processes on the same GPU."""
    if block_m is not None or interpreting:
        return _soft_kernel, dict(BLOCK_M=block_m or TILE["BLOCK_M"], BLOCK_N=block_n or TILE["BLOCK_N"])
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    if name not in _SOFT_TUNED:
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                   for bm, bn, w, st in SOFT_TUNE[name]]
        _SOFT_TUNED[name] = triton.autotune(configs, key=["H", "V", "N"], cache_results=True)(_soft_kernel)
    return _SOFT_TUNED[name], {}


_SOFT_TUNED: dict = {}  # model dtype -> the autotuned soft kernel


def _pass_rows(rows, embed, temp, u, softcap, want_soft, splits, bm, bn, bk, soft_tile):
    """One chunk of rows [n, H] through both kernels -> (sample, argmax, entropy [n], fp32 soft sum [n, H])."""
    n, h = rows.shape
    v = embed.shape[0]
    dev = rows.device
    is_bf16 = embed.dtype == torch.bfloat16
    row_blocks = triton.cdiv(n, bm)
    cols_per_split = triton.cdiv(triton.cdiv(v, splits), bn) * bn
    splits = triton.cdiv(v, cols_per_split)
    m, z, s, zb = (torch.empty(splits, n, dtype=torch.float32, device=dev) for _ in range(4))
    amax = torch.empty(splits, n, dtype=torch.int32, device=dev)
    n_tiles = triton.cdiv(v, bn)  # tiles start at multiples of bn (cols_per_split is one)
    tile_m, tile_z = (torch.empty(n, n_tiles, dtype=torch.float32, device=dev) for _ in range(2))
    scratch = torch.empty(n, v, dtype=embed.dtype, device=dev) if want_soft else rows  # [n, V] bf16(L)
    cap = float(softcap) if softcap else 1.0
    _stats_kernel[(row_blocks, splits)](rows, embed, temp, m, z, s, amax, zb, tile_m, tile_z, scratch, n, v, h,
                                        n_tiles, cols_per_split, rows.stride(0), embed.stride(0),
                                        scratch.stride(0) if want_soft else 0, cap, HAS_SOFTCAP=bool(softcap),
                                        IS_BF16=is_bf16, DOT_BF16=is_bf16, WANT_SOFT=want_soft, BLOCK_M=bm,
                                        BLOCK_N=bn, BLOCK_K=bk)
    mb, entropy, argmax, zbt = _combine(m, z, s, amax, zb, embed.dtype)
    sample = draw_from_groups(tile_m, tile_z, u, bn, rows, embed, softcap, temp[:, None], logits_fn=_group_logits)
    if not want_soft:
        return sample, argmax, entropy, None
    _probs_kernel[(n, triton.cdiv(v, 1024))](scratch, mb, zbt, n, v, scratch.stride(0), IS_BF16=is_bf16, BLOCK=1024)
    acc = soft_gemm(scratch, embed, bk, soft_tile)
    return sample, argmax, entropy, acc


def vocab_pass_triton(hidden: torch.Tensor, embed: torch.Tensor, *, softcap: float | None,
                      temperature: float | torch.Tensor, embed_scale: torch.Tensor | float, uniform: torch.Tensor,
                      want_soft: bool = True, row_chunk: int | None = None, splits: int | None = None,
                      block_m: int | None = None, block_n: int | None = None,
                      block_k: int | None = None) -> VocabPassOut:
    """`reference.vocab_pass` by the kernels. `row_chunk`: rows per pass (default: the bf16(L) scratch under
    SCRATCH_BYTES; changes nothing). Blocks (>= 16) default to TILE; given, they also fix the soft kernel's tile.
    `splits`: the stats kernel's vocabulary splits (default VOCAB_SPLITS, fewer when V has fewer tiles)."""
    if embed.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"vocab_pass_triton supports float32 and bfloat16 embeddings, got {embed.dtype}")
    b, c, h = hidden.shape
    v = embed.shape[0]
    dev = hidden.device
    rows = hidden.reshape(b * c, h).to(embed.dtype).contiguous()  # [N, H]
    embed = embed.contiguous()
    n = rows.shape[0]
    bm, bn, bk = block_m or TILE["BLOCK_M"], block_n or TILE["BLOCK_N"], block_k or TILE["BLOCK_K"]
    splits = splits or max(1, min(triton.cdiv(v, bn), VOCAB_SPLITS))
    soft_tile = _soft_launcher(interpreting(), block_m, block_n, embed.dtype)
    temp = row_temperature(temperature, b, c, dev).expand(n, 1).reshape(n).contiguous()  # [N]: one per row
    u = uniform.reshape(n).to(device=dev, dtype=torch.float64)  # [N]
    step = n if not want_soft else max(1, min(n, row_chunk or SCRATCH_BYTES // (v * embed.element_size())))
    outs = [_pass_rows(rows[lo:lo + step], embed, temp[lo:lo + step], u[lo:lo + step], softcap, want_soft, splits,
                       bm, bn, bk, soft_tile) for lo in range(0, n, step)]
    sample, argmax, entropy, acc = (torch.cat(t) if len(outs) > 1 else t[0] for t in zip(*outs))
    soft = None
    if want_soft:
        scale = torch.as_tensor(embed_scale, device=dev).to(embed.dtype)
        soft = (acc.to(embed.dtype) * scale).view(b, c, h)  # the reference's bf16 GEMM output, then × scale in bf16
    return VocabPassOut(sample=sample.view(b, c), argmax=argmax.view(b, c), entropy=entropy.view(b, c), soft=soft)
