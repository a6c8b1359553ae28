"""Torch references for the MoE and RMSNorm kernels, as plain functions of tensors (the spec they are
tested against). They restate `dgcli/model/gemma.py`'s `Experts.forward` and `RMSNorm.forward` op for op so
kernels and tests need no nn.Module; `tests/test_kernel_moe.py` checks that they still equal the model's.

Owns: `experts_reference` (and its routing order, `expert_groups`), `rms_norm_reference`, the fused kernels'
references (`qkv_norm_rope_reference`, `route_reference`, `router_input_reference`). Must not: import the model, pick devices, or be fast.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def expert_groups(idx: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(e, sel, tok) for each expert e that got tokens, ascending: `sel` the flat (token, slot) pairs routed to
    it (indices into idx.reshape(-1)), `tok` their tokens, in token order (a stable sort)."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k  # [N*k] token of each sorted pair
    start = 0
    for e, c in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if c:
            yield e, order[start:start + c], tokens[start:start + c]
        start += c


def experts_reference(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts: x [N, H], routing weights w [N, k] fp32, expert ids idx [N, k], gate_up_proj
    [E, 2I, H] (gate rows first), down_proj [E, H, I] -> [N, H] in x.dtype.

    Per expert e (ascending): y = down(gelu_tanh(gate·x) ⊙ up·x) in x.dtype, times w (fp32 result),
    cast to x.dtype and added into the output: a token's k contributions are summed in ascending
    expert order with one rounding to x.dtype per addition (the transformers reference's order)."""
    out = torch.zeros_like(x)
    for e, sel, tok in expert_groups(idx, gate_up_proj.shape[0]):
        gate, up = F.linear(x[tok], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, down_proj[e])
        y = y * w.reshape(-1)[sel, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Norm_w(x) = x·(mean(x²)+eps)^-½ ⊙ w in fp32, cast back to x.dtype; weight None is Norm_0."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up, the gated MLPs' activation (torch's ops on every device)."""
    y = F.gelu(gate, approximate="tanh")
    return y * up if torch.is_grad_enabled() else y.mul_(up)  # in place where no graph is kept: one buffer fewer


def qkv_norm_rope_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, heads: int, kv_heads: int, has_v: bool, eps: float):
    """One attention's q/k/v from its fused projection qkv [B, T, (heads + kv_heads·(1 + has_v))·d]: q =
    rope(Norm_wq(q)), k = rope(Norm_wk(k)), v = Norm_0(v, else the raw k) as [B, T, n, d] each, in qkv.dtype,
    with rotate-half RoPE by cos and signed sin tables broadcastable to [B, T, 1, d] (the model's `apply_rope`:
    x·cos + roll(x, d/2)·sin, each op rounded to the dtype)."""
    b, t, _ = qkv.shape
    d = q_weight.shape[0]
    x = qkv.view(b, t, -1, d)
    q, k = x[:, :, :heads], x[:, :, heads:heads + kv_heads]
    v = x[:, :, heads + kv_heads:] if has_v else k
    rope = lambda y: y * cos + y.roll(d // 2, -1) * sin  # noqa: E731
    return (rope(rms_norm_reference(q, q_weight, eps)), rope(rms_norm_reference(k, k_weight, eps)),
            rms_norm_reference(v, None, eps))


def route_reference(logits: torch.Tensor, per_expert_scale: torch.Tensor, k: int):
    """Router logits [N, E] -> fp32 weights [N, k] and expert ids [N, k]: softmax over every expert in fp32, the k
    largest (descending), renormalised, then times their experts' scales (the model's `Router`)."""
    w, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True) * per_expert_scale[idx], idx


def router_input_reference(r: torch.Tensor, scale: torch.Tensor, root: float, eps: float) -> torch.Tensor:
    """The router's input Norm_0(r) · scale · root, each product rounded to r.dtype (the model's `Router`)."""
    return rms_norm_reference(r, None, eps) * scale * root
