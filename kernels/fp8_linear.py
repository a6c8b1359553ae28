"""Weight-only FP8 linears as one Triton GEMM (W8A16, CUDA): e4m3 weight bytes dequantized per tile in registers,
activations in the model dtype, fp32 accumulation, one rounding at the end.

Owns: `linear_w8a16`, the kernel twin of `kernels/fp8.py::linear_weight_only` (each weight rounded as `dequantize`
rounds it), and `e4m3_to_f32`. Must not: pick devices or semantics (kernels/dispatch.py does).
Why weight-only is the CUDA default, not FP8 activations (DGEMMA_FP8=dynamic, torch._scaled_mm): it is the default
on every device, so the same flags give the same numbers on CPU and GPU; each weight byte is read once (no bf16
copy of the matrix). The bytes are decoded with integer ops (as `fp8.fp8_over_256`), not Triton's fp8 type: exact,
the same in the interpreter, and it compiles for sm_80. NaN bytes decode to finite values (checkpoints clamp to 448).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import grouped_tile, interpreting, round_bf16, round_to

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) on CUDA, by activation dtype: >= 88 programs at a 256-row canvas
# in bf16; fp32's FMA dots spill at [64, 128] or more than one stage (benchmarks/kernel_targets.py checks both).
CONFIGS = {"bf16": (64, 128, 64, 4, 3), "fp32": (64, 64, 32, 4, 1)}
GROUP_M = 8  # row blocks that walk the same column blocks back to back (the weight tile stays in L2)


@triton.jit
def e4m3_to_f32(b):
    """float8_e4m3fn values held as uint8 -> their exact float32 values."""
    x = b.to(tl.int32)
    half = (((x & 0x7F) << 7) | ((x & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
                  IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, W_ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    s = tl.load(s_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BN] channel scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        b = tl.load(q_ptr + cols[None, :].to(tl.int64) * stride_qn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0)  # [BK, BN] e4m3 bytes
        w = e4m3_to_f32(b) * s[None, :]  # q·s, exact in fp32 for bf16 scales; fp32 scales: rounded once
        if W_ROUND:  # the reference's dequantized weight is bf16 (bf16 scale or bf16 activations)
            w = round_bf16(w)
        if DOT_BF16:  # exact: both operands hold bf16 values; full-rate tensor cores
            acc = tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        else:  # fp32 activations (or the interpreter): full fp32 products, not TF32
            acc = tl.dot(a, w, acc, input_precision="ieee")
    y = round_to(acc, IS_BF16)  # one rounding, on the bits (the interpreter's own cast breaks ties otherwise)
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
                            DOT_BF16=is_bf16 and not interpreting(), W_ROUND=is_bf16 or s.dtype == torch.bfloat16,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return y.view(*shape[:-1], n)
