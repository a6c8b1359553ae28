"""Torch references for the MoE, norm, attention and fused kernels, as plain functions of tensors: the spec each
kernel is tested against. `experts_reference` and `rms_norm_reference` restate the model's `Experts` and `RMSNorm`
op for op (tests/kernels/test_kernel_moe.py checks it). Must not: import the model, pick devices, or be fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

REFERENCE_BYTES = 256 * 2**20  # paged_attention_reference's gathered fp32 K+V per chunk of rows


def routed(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, num_experts: int,
           mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed sum: per expert e that got tokens, ascending, y = mlp(e, tok) [c, H] in x.dtype for its tokens
    `tok` (in token order), times their fp32 routing weights, rounded to x.dtype and added into the output: a token's
    k contributions summed in ascending expert order, one rounding per addition (the transformers reference's)."""
    k, flat = idx.shape[1], idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [N*k] the (token, slot) pairs grouped by expert
    out, start = torch.zeros_like(x), 0
    for e, c in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if c:
            sel = order[start:start + c]
            out.index_add_(0, sel // k, (mlp(e, sel // k) * w.reshape(-1)[sel, None]).to(out.dtype))
        start += c
    return out


def experts_reference(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts: x [N, H], routing weights w [N, k] fp32, expert ids idx [N, k], gate_up_proj [E, 2I, H] (gate
    rows first), down_proj [E, H, I] -> [N, H] in x.dtype; per expert y = down(gelu_tanh(gate·x) ⊙ up·x) (`routed`)."""
    def mlp(e: int, tok: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x[tok], gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.gelu(gate, approximate="tanh") * up, down_proj[e])

    return routed(x, w, idx, gate_up_proj.shape[0], mlp)


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


def group_by_expert_reference(flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.group_by_expert` in torch ops (the spec: a stable sort of the pairs by expert, each expert's run padded
    to a multiple of block_m) -> (pair_of_slot, block_expert) int32, -1 for padding and unused blocks."""
    nk, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [N·k] pairs grouped by expert
    expert = flat[order]
    rank = torch.arange(nk, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    dest = (pad_end - padded)[expert] + rank  # [N·k] slot of each sorted pair
    n_blocks = -(-(nk + num_experts * (block_m - 1)) // block_m)
    pair_of_slot = torch.full((n_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    pair_of_slot[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(pad_end, torch.arange(n_blocks, device=dev) * block_m, right=True)
    return pair_of_slot, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


def paged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, row_seq: torch.Tensor,
                              row_lo: torch.Tensor, row_hi: torch.Tensor, tables: torch.Tensor, block_size: int,
                              ring_blocks: int = 0, *, k_new: torch.Tensor | None = None,
                              v_new: torch.Tensor | None = None, fresh_pos: torch.Tensor | None = None,
                              fresh_row: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a paged KV cache: q [N, n_heads, d], k_pool/v_pool [n_kv, S_phys, d] (q's dtype), row_seq /
    row_lo / row_hi [N] int32, tables [num_seqs, max_blocks] int32 -> [N, n_heads, d] in q's dtype: row i attends
    positions row_lo[i]..row_hi[i]-1 of sequence row_seq[i], whose key/value at position p lives at slot
    tables[s, L]·block_size + p % block_size, L = p // block_size (sliding layers: L % ring_blocks). Scale 1.0
    (QK-norm absorbs 1/sqrt(d)), no softcap, query head h reads kv head h // (n_heads // n_kv), fp32 scores,
    softmax and sum, one rounding. With k_new/v_new [N, n_kv, d] and fresh_pos/fresh_row [N], row i's positions
    p >= fresh_pos[i] are read from row fresh_row[i] + p - fresh_pos[i] of k_new/v_new instead of the cache.
    Reads the longest interval on the host; gathers rows in chunks of ~REFERENCE_BYTES."""
    n, n_heads, d = q.shape
    n_kv = k_pool.shape[0]
    group = n_heads // n_kv
    out = torch.empty(n, n_heads, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    span = int((row_hi - row_lo).max())
    chunk = max(1, REFERENCE_BYTES // (2 * n_kv * span * d * 4))
    steps = torch.arange(span, device=q.device)
    tables = tables.long()
    for a in range(0, n, chunk):
        lo, hi, seq = (t[a:a + chunk].long() for t in (row_lo, row_hi, row_seq))
        c = lo.numel()
        pos = lo[:, None] + steps  # [c, span]
        valid = pos < hi[:, None]
        pos = torch.where(valid, pos, lo[:, None])  # padding reads a position the row does attend
        logical = pos // block_size
        if ring_blocks > 0:
            logical = logical % ring_blocks
        slot = tables[seq[:, None], logical] * block_size + pos % block_size  # [c, span]
        k = k_pool[:, slot].float()  # [n_kv, c, span, d]
        v = v_pool[:, slot].float()
        if k_new is not None:  # this pass's own keys at and past fresh_pos
            fp, fr = fresh_pos[a:a + chunk].long()[:, None], fresh_row[a:a + chunk].long()[:, None]
            new = pos >= fp  # [c, span]
            nrow = torch.where(new, fr + pos - fp, 0)
            k = torch.where(new[None, :, :, None], k_new[nrow].permute(2, 0, 1, 3).float(), k)
            v = torch.where(new[None, :, :, None], v_new[nrow].permute(2, 0, 1, 3).float(), v)
        qc = q[a:a + c].float().reshape(c, n_kv, group, d)
        s = torch.einsum("ckgd,kcld->ckgl", qc, k)  # scale 1.0
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        o = torch.einsum("ckgl,kcld->ckgd", torch.softmax(s, dim=-1), v)
        out[a:a + c] = o.reshape(c, n_heads, d).to(q.dtype)
    return out
