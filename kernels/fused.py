"""Small fused kernels of the CUDA path (Triton), each one launch where torch makes several: `rms_norm` (with a
residual, a pre-add or a scale: `dispatch.rms_norm_add`), `qkv_norm_rope`, `gelu_mul_fused`, `router_input` and
`route`, twins of their `reference_ops` references (the same roundings to the storage dtype; softmax and top-k in
fp32). Must not: pick devices (kernels/dispatch.py does), allocate more than their outputs, or sync with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import gelu_mul_rounded, round_to


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


@triton.jit
def _qkv_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, cos_rows, stride_x,
                          stride_c, eps, D, NQ: tl.constexpr, NKV: tl.constexpr, HAS_V: tl.constexpr,
                          IS_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    rcols = (cols + D // 2) % D  # roll(x, d/2)[c] = x[(c + d/2) mod d]
    is_q, is_v = head < NQ, head >= NQ + NKV
    is_k = ~is_q & ~is_v
    src = tl.where(is_v, head - NKV + HAS_V * NKV, head).to(tl.int64)  # without v_proj, v is the raw k
    base = x_ptr + tok * stride_x + src * D
    x = tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
    xr = tl.load(base + rcols, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(qw_ptr + cols, mask=m & is_q, other=0.0).to(tl.float32) + tl.load(
        kw_ptr + cols, mask=m & is_k, other=0.0).to(tl.float32)
    wr = tl.load(qw_ptr + rcols, mask=m & is_q, other=0.0).to(tl.float32) + tl.load(
        kw_ptr + rcols, mask=m & is_k, other=0.0).to(tl.float32)
    y = round_to(x * inv * tl.where(is_v, 1.0, w), IS_BF16)
    yr = round_to(xr * inv * wr, IS_BF16)
    prow = (tok % cos_rows) * stride_c
    c = tl.load(cos_ptr + prow + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + prow + cols, mask=m, other=0.0).to(tl.float32)
    rot = round_to(round_to(y * c, IS_BF16) + round_to(yr * s, IS_BF16), IS_BF16)
    out = tl.where(is_v, y, rot).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + (tok * NQ + head) * D + cols, out, mask=m & is_q)
    tl.store(k_ptr + (tok * NKV + head - NQ) * D + cols, out, mask=m & is_k)
    tl.store(v_ptr + (tok * NKV + head - NQ - NKV) * D + cols, out, mask=m & is_v)


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, heads: int, kv_heads: int, has_v: bool, eps: float):
    """qkv [B, T, (heads + kv_heads·(1 + has_v))·d] -> q [B, T, heads, d], k and v [B, T, kv_heads, d]
    (contiguous, qkv.dtype); cos, sin: d-wide rows, one per token or one per position shared by the batch."""
    b, t, _ = qkv.shape
    d = q_weight.shape[0]
    x = qkv.reshape(b * t, -1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cs, sn = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    q = qkv.new_empty(b, t, heads, d)
    k, v = qkv.new_empty(b, t, kv_heads, d), qkv.new_empty(b, t, kv_heads, d)
    if b * t:
        _qkv_norm_rope_kernel[(b * t, heads + 2 * kv_heads)](
            x, q_weight, k_weight, cs, sn, q, k, v, cs.shape[0], x.stride(0), cs.stride(0), eps, d, NQ=heads,
            NKV=kv_heads, HAS_V=int(has_v), IS_BF16=qkv.dtype == torch.bfloat16, BLOCK_D=triton.next_power_of_2(d))
    return q, k, v


@triton.jit
def _gelu_mul_kernel(x_ptr, out_ptr, inner, stride_x, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=m, other=0.0).to(tl.float32)
    y = gelu_mul_rounded(gate, up, IS_BF16)
    tl.store(out_ptr + row * inner + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def gelu_mul_fused(gu: torch.Tensor, inner: int) -> torch.Tensor:
    """gelu_tanh(gu[..., :inner]) * gu[..., inner:] -> [..., inner] in gu.dtype."""
    x = gu.reshape(-1, 2 * inner)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = gu.new_empty(*gu.shape[:-1], inner)
    if x.shape[0]:
        _gelu_mul_kernel[(x.shape[0], triton.cdiv(inner, 1024))](x, out, inner, x.stride(0),
                                                                   IS_BF16=gu.dtype == torch.bfloat16, BLOCK=1024)
    return out


@triton.jit
def _router_input_kernel(x_ptr, s_ptr, out_ptr, H, root, eps, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)
    y = round_to(x / tl.sqrt(tl.sum(x * x, axis=0) / H + eps), IS_BF16)
    y = round_to(y * tl.load(s_ptr + cols, mask=m, other=0.0).to(tl.float32), IS_BF16)
    tl.store(out_ptr + row * H + cols, round_to(y * root, IS_BF16).to(out_ptr.dtype.element_ty), mask=m)


def router_input(r: torch.Tensor, scale: torch.Tensor, root: float, eps: float) -> torch.Tensor:
    """Norm_0(r [N, H]) · scale · root, each product rounded to r.dtype."""
    x = r.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _router_input_kernel[(x.shape[0],)](x, scale, out, x.shape[1], root, eps, IS_BF16=x.dtype == torch.bfloat16,
                                            BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def _route_kernel(l_ptr, s_ptr, w_ptr, i_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    x = tl.load(l_ptr + row * E + es, mask=es < E, other=float("-inf")).to(tl.float32)
    ex = tl.exp(x - tl.max(x, axis=0))
    p = ex / tl.sum(ex, axis=0)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(K):  # the largest left, the lowest id among equals
        best = tl.max(p, axis=0)
        e = tl.min(tl.where(p == best, es, BLOCK_E), axis=0)
        top, ids = tl.where(ks == j, best, top), tl.where(ks == j, e, ids)
        p = tl.where(es == e, -1.0, p)
    w = top / tl.sum(top, axis=0) * tl.load(s_ptr + ids, mask=ks < K, other=0.0).to(tl.float32)
    tl.store(w_ptr + row * K + ks, w, mask=ks < K)
    tl.store(i_ptr + row * K + ks, ids.to(tl.int64), mask=ks < K)


def route(logits: torch.Tensor, per_expert_scale: torch.Tensor, k: int):
    """Router logits [N, E] -> fp32 weights [N, k], int64 expert ids [N, k] (descending)."""
    x = logits.contiguous()
    n, e = x.shape
    w = x.new_empty(n, k, dtype=torch.float32)
    idx = x.new_empty(n, k, dtype=torch.int64)
    if n:
        _route_kernel[(n,)](x, per_expert_scale, w, idx, e, K=k, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=triton.next_power_of_2(k))
    return w, idx
