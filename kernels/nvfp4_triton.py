"""Weight-only NVFP4 linears as one Triton GEMM (W4A16, CUDA): codes and e4m3 scales decoded per tile in registers
(integer ops, as the CPU table and fp8_linear's `e4m3_to_f32`: exact, the same in the interpreter), fp32 accumulation.

Owns: `linear_w4a16`, the kernel twin of `kernels/nvfp4.py::linear` (each weight rounded to bf16 as `decode` rounds
it); the routed experts call it once per expert. Must not: pick devices (kernels/dispatch.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_linear import GROUP_M, e4m3_to_f32
from .triton_common import grouped_tile, round_bf16, round_to

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by activation dtype: none spills on sm_90 or sm_80
# (benchmarks/kernel_targets.py; fp8_linear's [64, 128] bf16 tile spills on sm_80 here, its fp32 one ~13 KB a thread)
CONFIGS = {"bf16": (64, 64, 64, 4, 3), "fp32": (64, 64, 32, 4, 1)}


@triton.jit
def _w4a16_kernel(x_ptr, p_ptr, s_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_ym,
                  DIVIDE: tl.constexpr, IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    g = tl.load(g_ptr + cols, mask=col_ok, other=1.0)  # [BN] each output row's global scale
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        m2 = col_ok[None, :] & k_ok[:, None]
        b = tl.load(p_ptr + cols[None, :].to(tl.int64) * stride_pn + ks[:, None] // 2, mask=m2, other=0)  # [BK, BN]
        c = ((b.to(tl.int32) >> ((ks[:, None] % 2) * 4)) & 15)  # column k's code: the low nibble for even k
        half = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
        sc = e4m3_to_f32(tl.load(s_ptr + cols[None, :].to(tl.int64) * stride_sn + ks[:, None] // 16, mask=m2, other=0))
        f = sc / g[None, :] if DIVIDE else sc * g[None, :]  # fp32, as `factors`
        w = round_bf16(half.to(tl.float32) * (f * 16384.0))  # [BK, BN] the bf16 weights, exactly as `decode`
        if DOT_BF16:  # exact: both operands hold bf16 values; full-rate tensor cores
            acc = tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        else:  # fp32 activations: full fp32 products, not TF32
            acc = tl.dot(a, w, acc, input_precision="ieee")
    y = round_to(acc, IS_BF16)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def linear_w4a16(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor, divide: bool, *,
                 config: tuple | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp32) by NVFP4 weights (packed uint8 [N, K/2], scale e4m3 [N, K/16], glob fp32 [N]) ->
    [..., N] in x.dtype. `config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), default CONFIGS'."""
    n, k = packed.shape[0], packed.shape[1] * 2
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    p, s = packed.contiguous(), scale.contiguous().view(torch.uint8)
    g = glob.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    is_bf16 = x.dtype == torch.bfloat16
    bm, bn, bk, warps, stages = config or CONFIGS["bf16" if is_bf16 else "fp32"]
    if m:
        _w4a16_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
            x2, p, s, g, y, m, n, k, x2.stride(0), p.stride(0), s.stride(0), y.stride(0), DIVIDE=divide,
            IS_BF16=is_bf16, DOT_BF16=is_bf16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP=GROUP_M, num_warps=warps, num_stages=stages)
    return y.view(*shape[:-1], n)
