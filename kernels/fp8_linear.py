"""FP8 Triton kernels for CUDA: the weight-only linear (W8A16) and dynamic FP8's per-token activation quantizer.

Owns: `linear_w8a16` (torch twin `kernels/fp8.py::linear_weight_only`, within the bound below), `quantize_rows` (one
launch, bit for bit `kernels/fp8.py::quantize_per_token`) and the e4m3 codecs. Must not: pick devices or semantics
(kernels/dispatch.py does). The codecs are integer ops on the bits, not Triton's fp8 type: exact, the same in the
interpreter (which rounds fp32 -> e4m3 wrongly), and they compile for sm_80. NaN bytes decode to finite values.
W8A16: each e4m3 byte becomes its value / 256 in bf16 (exact), bf16 tensor-core dots accumulate in fp32, and the
channel scale x 256 multiplies the accumulator (the epilogue): no fp32 weight tile. What changes against the
reference, which rounds each weight q·s to bf16 first (compressed-tensors' `dequantize`): an output moves by at most
2^-8 of sum |x·w| plus one rounding (tests/kernels/test_fp8_kernels.py holds the bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_MAX, MIN_SCALE
from .triton_common import grouped_tile, round_to

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on CUDA, by activation dtype: >= 88 programs at a 256-row canvas
# in bf16; fp32's FMA dots spill at [64, 128] or more than one stage (benchmarks/kernel_targets.py checks both).
CONFIGS = {"bf16": (64, 128, 64, 4, 3), "fp32": (64, 64, 32, 4, 1)}
GROUP_M = 8  # row blocks that walk the same column blocks back to back (the weight tile stays in L2)
_MAX, _MIN_SCALE = tl.constexpr(FP8_MAX), tl.constexpr(MIN_SCALE)  # the quantizer's clamp and floor, as constants


@triton.jit
def e4m3_over_256(b):
    """float8_e4m3fn values held as uint8 -> value / 256 as float16, exactly, as `fp8.fp8_over_256`."""
    x = b.to(tl.int32)
    return (((x & 0x7F) << 7) | ((x & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_to_f32(b):
    """float8_e4m3fn values held as uint8 -> their exact float32 values."""
    return e4m3_over_256(b).to(tl.float32) * 256.0


@triton.jit
def f32_to_e4m3(v):
    """float32 v with |v| <= 448 -> the e4m3 byte nearest (ties to even), as torch's `.to(float8_e4m3fn)`."""
    bits = v.to(tl.uint32, bitcast=True)
    a = bits & 0x7FFFFFFF
    # |v| >= 2^-6 (e4m3 normals): 3 mantissa bits kept, ties to even; the exponent rebased from 127 to 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # below: a multiple of 2^-9 (8 of them make the smallest normal, byte 0x08), from the 24-bit significand
    e = tl.maximum((a >> 23).to(tl.int32), 1)
    sig = tl.where((a >> 23) > 0, (a & 0x7FFFFF) | 0x800000, a)
    shift = tl.minimum(tl.maximum(141 - e, 1), 31).to(tl.uint32)  # 2^(e - 127 - 23) / 2^-9 = 2^-(141 - e)
    sub = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
    return (tl.where(a >= (121 << 23), normal, sub) | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    """One row: scale = max(absmax / 448, MIN_SCALE) (fp32, correctly rounded), q = e4m3(clamp(x / scale))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), _MAX), _MIN_SCALE)  # `/` compiles to approximate division
    tl.store(s_ptr + row, s)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -_MAX), _MAX)
        tl.store(q_ptr + row * stride_q + k0 + cols, f32_to_e4m3(v), mask=k0 + cols < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16/fp32) -> (q [..., K] float8_e4m3fn, scale [..., 1] fp32), as `fp8.quantize_per_token`."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)  # [M, K] the e4m3 bytes
    s = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)  # [M, 1]
    if x2.shape[0]:
        block = min(4096, triton.next_power_of_2(k))
        _quant_kernel[(x2.shape[0],)](x2, q, s, k, x2.stride(0), q.stride(0), BLOCK=block)
    return q.view(torch.float8_e4m3fn).view(x.shape), s.view(*x.shape[:-1], 1)


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
                  IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = e4m3_over_256(tl.load(q_ptr + cols[None, :].to(tl.int64) * stride_qn + ks[:, None],
                                  mask=col_ok[None, :] & k_ok[:, None], other=0))  # [BK, BN] the weights / 256
        if DOT_BF16:  # exact operands (bf16 activations, e4m3 / 256 in bf16); full-rate tensor cores
            acc = tl.dot(a, w.to(tl.bfloat16), acc)
        else:  # fp32 activations: full fp32 products, not TF32
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    s = tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * 256.0  # [BN] channel scales, x 256 exact
    y = round_to(acc * s[None, :], IS_BF16)  # one rounding, on the bits (the interpreter's own cast breaks ties)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def linear_w8a16(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, config: tuple | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp32) by q [N, K] float8_e4m3fn with scales s [N, 1] (bf16/fp32) -> [..., N] in
    x.dtype. `config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), default CONFIGS' (blocks >= 16)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or s.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"linear_w8a16 supports bf16/fp32 activations and scales, got {x.dtype} and {s.dtype}")
    n, k = q.shape
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    qb = q.contiguous().view(torch.uint8)  # [N, K] the e4m3 bytes
    s1 = s.reshape(-1).contiguous()  # [N]
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    is_bf16 = x.dtype == torch.bfloat16
    bm, bn, bk, warps, stages = config or CONFIGS["bf16" if is_bf16 else "fp32"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    if m:
        _w8a16_kernel[grid](x2, qb, s1, y, m, n, k, x2.stride(0), qb.stride(0), y.stride(0), IS_BF16=is_bf16,
                            DOT_BF16=is_bf16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                            GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return y.view(*shape[:-1], n)
