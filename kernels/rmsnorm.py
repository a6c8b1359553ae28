"""RMSNorm as one Triton kernel: `rms_norm`, the twin of `reference_ops.rms_norm_reference` and, with a residual, a
pre-add or a scale, of `dispatch.rms_norm_add` (each add and product rounded to x.dtype as torch's ops round): one
launch where torch makes three. Must not: pick devices, allocate more than its output, or sync with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import round_to


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, pre_ptr, res_ptr, s_ptr, n_cols, stride_x, stride_o, eps,
                     HAS_WEIGHT: tl.constexpr, HAS_PRE: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
                     IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE:  # pre-add and residual: contiguous rows like out's
        x = round_to(x + tl.load(pre_ptr + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32), IS_BF16)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = x * inv
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(y, IS_BF16)
    if HAS_RES:
        y = round_to(tl.load(res_ptr + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32) + y, IS_BF16)
    if HAS_SCALE:  # the layer scalar, one value
        y = round_to(y * tl.load(s_ptr).to(tl.float32), IS_BF16)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             pre_add: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(residual + Norm(x + pre_add)) · scale over the last axis of x [..., H] (residual and pre_add: x's shape
    and dtype; scale: one value; any may be None)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"rms_norm supports float32 and bfloat16, got {x.dtype}")
    shape = x.shape
    h = shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [R, H]
    pre, res = (x2 if t is None else t.reshape(-1, h).contiguous() for t in (pre_add, residual))
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight if weight is not None else x2, out, pre, res, x2 if scale is None else scale, h, x2.stride(0),
        out.stride(0), eps, HAS_WEIGHT=weight is not None, HAS_PRE=pre_add is not None, HAS_RES=residual is not None,
        HAS_SCALE=scale is not None,
        IS_BF16=x.dtype == torch.bfloat16, BLOCK=triton.next_power_of_2(h))
    return out.view(shape)
