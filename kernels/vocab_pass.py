"""The fused vocabulary pass as Triton kernels (CUDA): tied head + softcap + temperature, online argmax,
entropy, a Gumbel-max draw and the self-conditioning soft embedding, without a [N, V] float32 tensor.

Owns: `vocab_pass_triton`, the kernel twin of `kernels/reference.py::vocab_pass` (same arguments and
`VocabPassOut`). Must not: know about the denoising loop or sync with the host (the uniforms and the
temperature stay on the device; every launch grid depends on shapes only).

Three kernels:
1. `_stats_kernel`, grid (row blocks, vocabulary splits): head GEMM tile by tile, per split the online
   max / first argmax / Σexp(L-m) / Σexp(L-m)(L-m) (entropy) / Σexp(bf16(L)-m), and per tile of BLOCK_N
   columns the running max m and Σexp(L-m) (the draw's statistics); a tiny torch combine merges the splits.
2. `_probs_kernel`, per vocabulary chunk: recomputes the head tile (cheaper than storing [N, V]) and
   writes p = bf16(exp(bf16(L) - Mb)/Zb) for the chunk, Mb = bf16(max L), the max the reference's softmax
   subtracts: the reference's normalised, rounded probabilities. Not bit for bit: the reference's softmax
   sums exp in its own order (torch's CPU fp32 softmax is off the exact sum by ~1e-5 relative at
   V = 262,144, which moves ~0.2 % of the bf16 probabilities by one step) and with its own exp.
3. `_soft_gemm_kernel`: acc[N, H] (fp32) += p_chunk @ E_chunk. soft = bf16(acc)·scale at the end.
Draws: the reference's inverse CDF at the given uniforms, located through the per-tile sums
(kernels/categorical.py, torch): the same draws as every other path, up to rounding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .categorical import draw_from_groups
from .reference import VocabPassOut, row_temperature
from .triton_common import round_to

SPLIT_ROWS = 256  # the row count the default split count is sized for (one real canvas)
# Vocabulary columns per probability chunk: bounds the one [N, chunk] bf16 buffer (16 MiB at N = 256).
CHUNK = 32768


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tanh(y):
    return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


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
                    other=0.0).to(tl.float32)  # [BM, BK]
        b = tl.load(e_ptr + cols[None, :].to(tl.int64) * stride_e + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0).to(tl.float32)  # [BK, BN]
        if DOT_BF16:  # exact: bf16 values; bf16 operands run the tensor cores at full rate
            acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
        else:  # fp32 storage (or the interpreter): full fp32 products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
    raw = round_to(acc, IS_BF16)  # the reference's head GEMM output is in the model dtype
    if HAS_SOFTCAP:
        raw = _tanh(raw / softcap) * softcap
    return raw / temp


@triton.jit
def _stats_kernel(h_ptr, e_ptr, temp_ptr, m_ptr, z_ptr, s_ptr, amax_ptr, zb_ptr, tm_ptr, tz_ptr,
                  N, V, H, n_tiles, cols_per_split, stride_h, stride_e, softcap,
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
def _probs_kernel(h_ptr, e_ptr, temp_ptr, mb_ptr, zb_ptr, p_ptr, N, c0, c1, H, stride_h, stride_e, stride_p, softcap,
                  HAS_SOFTCAP: tl.constexpr, IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = c0 + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < c1
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)[:, None]  # [BM, 1]
    L = _logits_tile(h_ptr, e_ptr, rows, row_ok, cols, col_ok, H, stride_h, stride_e, temp, softcap,
                     HAS_SOFTCAP, IS_BF16, DOT_BF16, BLOCK_M, BLOCK_N, BLOCK_K)
    mb = tl.load(mb_ptr + rows, mask=row_ok, other=0.0)
    zb = tl.load(zb_ptr + rows, mask=row_ok, other=1.0)
    p = round_to(tl.exp(round_to(L, IS_BF16) - mb[:, None]) / zb[:, None], IS_BF16)  # softmax_fp32(bf16 L) -> bf16
    ptrs = p_ptr + rows[:, None].to(tl.int64) * stride_p + (cols - c0)[None, :]
    tl.store(ptrs, p.to(p_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _soft_gemm_kernel(p_ptr, e_ptr, acc_ptr, N, K, H, stride_p, stride_e, stride_acc,
                      DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden channels
    col_ok = cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(p_ptr + rows[:, None].to(tl.int64) * stride_p + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BM, BK]
        b = tl.load(e_ptr + ks[:, None].to(tl.int64) * stride_e + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)  # [BK, BN]
        if DOT_BF16:
            acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    ptrs = acc_ptr + rows[:, None].to(tl.int64) * stride_acc + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + acc, mask=mask)


def _combine(m, z, s, amax, zb, soft_dtype):
    """Merge per-split statistics [S, N] -> per-row results (torch ops, no host sync). The soft embedding's
    max and sum are those of the logits rounded to `soft_dtype` (each split's zb is relative to its rounded m)."""
    mx = m.max(dim=0).values  # [N]
    alpha = torch.exp(m - mx)  # [S, N]
    zt = (alpha * z).sum(0)
    st = (alpha * (s + z * (m - mx))).sum(0)
    entropy = torch.log(zt) - st / zt
    first = torch.argmax((m == mx).to(torch.int8), dim=0)  # earliest split holding the max: first argmax
    argmax = amax.gather(0, first[None])[0].long()
    mb = mx.to(soft_dtype).float()  # [N] the max of the rounded logits
    zbt = (torch.exp(m.to(soft_dtype).float() - mb) * zb).sum(0)
    return mb, entropy, argmax, zbt


def vocab_pass_triton(
    hidden: torch.Tensor,
    embed: torch.Tensor,
    *,
    softcap: float | None,
    temperature: float | torch.Tensor,
    embed_scale: torch.Tensor | float,
    uniform: torch.Tensor,
    want_soft: bool = True,
    row_chunk: int | None = None,
    splits: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 64,
    chunk: int = CHUNK,
) -> VocabPassOut:
    """`kernels.reference.vocab_pass` with Triton kernels; `row_chunk` is ignored (no row chunking).
    Block sizes must be >= 16 (tl.dot); `splits` = vocabulary splits of the stats kernel (default: enough
    programs to fill the device for a 256-row canvas, whatever the row count)."""
    del row_chunk
    if embed.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"vocab_pass_triton supports float32 and bfloat16 embeddings, got {embed.dtype}")
    b, c, h = hidden.shape
    v = embed.shape[0]
    dev = hidden.device
    rows = hidden.reshape(b * c, h).to(embed.dtype).contiguous()  # [N, H]
    embed = embed.contiguous()
    n = rows.shape[0]
    is_bf16 = embed.dtype == torch.bfloat16
    dot_bf16 = is_bf16 and not _interpreting()
    temp = row_temperature(temperature, b, c, dev).expand(n, 1).reshape(n).contiguous()  # [N]: one per row
    row_blocks = triton.cdiv(n, block_m)
    if splits is None:
        # Sized for one 256-row canvas whatever the batch: the split count sets the order in which a row's
        # statistics are combined, and a row's numbers must not depend on how many rows share the pass.
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        splits = max(1, min(triton.cdiv(v, block_n), triton.cdiv(2 * sms, triton.cdiv(SPLIT_ROWS, block_m))))
    cols_per_split = triton.cdiv(triton.cdiv(v, splits), block_n) * block_n
    splits = triton.cdiv(v, cols_per_split)
    m, z, s, zb = (torch.empty(splits, n, dtype=torch.float32, device=dev) for _ in range(4))
    amax = torch.empty(splits, n, dtype=torch.int32, device=dev)
    n_tiles = triton.cdiv(v, block_n)  # tiles start at multiples of block_n (cols_per_split is one)
    tile_m, tile_z = (torch.empty(n, n_tiles, dtype=torch.float32, device=dev) for _ in range(2))
    cap = float(softcap) if softcap else 1.0
    meta = dict(HAS_SOFTCAP=bool(softcap), IS_BF16=is_bf16, DOT_BF16=dot_bf16,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    _stats_kernel[(row_blocks, splits)](rows, embed, temp, m, z, s, amax, zb, tile_m, tile_z, n, v, h, n_tiles,
                                        cols_per_split, rows.stride(0), embed.stride(0), cap,
                                        WANT_SOFT=want_soft, **meta)
    mb, entropy, argmax, zbt = _combine(m, z, s, amax, zb, embed.dtype)
    u = uniform.reshape(n).to(device=dev, dtype=torch.float64)  # [N]
    sample = draw_from_groups(tile_m, tile_z, u, block_n, rows, embed, softcap, temp[:, None])

    soft = None
    if want_soft:
        acc = torch.zeros(n, h, dtype=torch.float32, device=dev)  # [N, H]
        width = min(chunk, v)
        probs = torch.empty(n, width, dtype=embed.dtype, device=dev)  # [N, chunk]
        for c0 in range(0, v, width):
            c1 = min(v, c0 + width)
            _probs_kernel[(row_blocks, triton.cdiv(c1 - c0, block_n))](
                rows, embed, temp, mb, zbt, probs, n, c0, c1, h, rows.stride(0), embed.stride(0), probs.stride(0),
                cap, **meta)
            _soft_gemm_kernel[(row_blocks, triton.cdiv(h, block_n))](
                probs, embed[c0:], acc, n, c1 - c0, h, probs.stride(0), embed.stride(0), acc.stride(0),
                DOT_BF16=dot_bf16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        scale = torch.as_tensor(embed_scale, device=dev).to(embed.dtype)
        soft = acc.to(embed.dtype) * scale  # the reference's bf16 GEMM output, then × scale in bf16
    return VocabPassOut(
        sample=sample.view(b, c),
        argmax=argmax.view(b, c),
        entropy=entropy.view(b, c),
        soft=None if soft is None else soft.view(b, c, h),
    )
