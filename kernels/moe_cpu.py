"""Routed experts for CPU: token-expert pairs grouped by expert, two batched GEMMs over all experts.

Owns: `experts_grouped`, equal to `kernels/reference_ops.py::experts_reference` (and so to the model's
`Experts.forward`): same GEMM inputs and dtypes, same activation, the fp32 routing-weight product
rounded to x.dtype, and a token's k contributions added in ascending expert order with one rounding
per addition. Only the GEMM kernel differs (a batched GEMM instead of one GEMM per expert), so fp32
agrees to accumulation order and bf16 to one rounding of a GEMM output.
Must not: route (the router is the model's), or run on CUDA (it reads the largest group size back to
the host; CUDA uses kernels/moe.py).

Why batched: on this CPU a bf16 GEMM with ~20-80 rows runs at a fraction of the AMX rate and a Python
loop over 128 experts pays that per expert; one bmm over [E, rows, H] padded to the largest group is
several times faster as long as padding stays small. When the groups are very uneven (padding would
more than double the work) the per-expert loop is used instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference_ops import experts_reference

# Batched GEMMs compute E·cap rows for N·k useful ones; above this ratio the per-expert loop wins.
MAX_PADDING = 2.0


@torch.compiler.disable  # reads the largest group size back to the host: keep it out of compiled graphs
def experts_grouped(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor) -> torch.Tensor:
    """x [N, H], w [N, k] fp32, idx [N, k] (distinct experts per row), gate_up_proj [E, 2I, H],
    down_proj [E, H, I] -> [N, H] in x.dtype."""
    n, k = idx.shape
    num_experts, h = gate_up_proj.shape[0], x.shape[1]
    inter = down_proj.shape[2]
    if n == 0:
        return torch.zeros_like(x)
    # Ascending expert order inside each row = the order in which the reference adds contributions.
    idx_sorted, perm = idx.sort(dim=1)  # [N, k]
    w_sorted = w.gather(1, perm)  # [N, k]
    flat = idx_sorted.reshape(-1)  # [N*k] pair p = (token p // k, slot p % k)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    cap = int(counts.max())
    if cap * num_experts > MAX_PADDING * n * k:
        return experts_reference(x, w, idx, gate_up_proj, down_proj)

    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    expert = flat[order]  # [N*k]
    slot = torch.arange(n * k, device=x.device) - (counts.cumsum(0) - counts)[expert]  # [N*k] row in its group
    xs = x.new_zeros(num_experts, cap, h)  # [E, cap, H]
    xs[expert, slot] = x[order // k]
    gu = torch.bmm(xs, gate_up_proj.transpose(1, 2))  # [E, cap, 2I]
    act = F.gelu(gu[..., :inter], approximate="tanh") * gu[..., inter:]  # [E, cap, I]
    y = torch.bmm(act, down_proj.transpose(1, 2))  # [E, cap, H]

    pairs = torch.empty(n * k, h, dtype=y.dtype, device=x.device)  # [N*k, H] back in pair order
    pairs[order] = y[expert, slot]
    # fp32 product rounded to x.dtype, as the reference (explicit upcast: faster than mixed-dtype mul)
    pairs = pairs.float().mul_(w_sorted.reshape(-1, 1)).to(x.dtype).view(n, k, h)
    out = pairs[:, 0].clone()  # 0 + y is exact, as the reference's first index_add_
    for j in range(1, k):
        out += pairs[:, j]  # one rounding to x.dtype per addition, like index_add_
    return out
