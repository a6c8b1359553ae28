"""Routed experts for CPU: token-expert pairs grouped by expert.

Owns: `experts_segments` (torch's grouped GEMM over contiguous per-expert segments: no padding, no host read, so it
compiles into the decoder's graph), and for a session that packed its weights at load (dgcli/model/packed.py)
`experts_packed` (bf16 weights prepacked for oneDNN, one GEMM pair per expert) and `experts_native` (fp32, the C
GEMM of kernels/gemm_native.py). All equal `reference_ops.experts_reference`: same GEMM inputs, activation, the
fp32 routing-weight product rounded to x.dtype, a token's k contributions added in ascending expert order with one
rounding each; only the GEMM kernel may differ.
Must not: route, run on CUDA (kernels/moe.py does), import torch._dynamo (~1 s) in a process that never compiles,
or change any thread's torch thread count.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import gemm_native
from .linear_cpu import linear
from .reference_ops import experts_reference, gelu_mul


def _sorted_pairs(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx [N, k] -> (flat [N*k] experts of the pairs, each row's slots in ascending expert order: the reference's
    addition order; order [N*k] the pairs grouped by expert (a stable sort); ws [N*k, 1] fp32 weights in that order)."""
    idx_sorted, perm = idx.sort(dim=1)  # [N, k]
    flat = idx_sorted.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return flat, order, w.gather(1, perm).reshape(-1).index_select(0, order).unsqueeze(1)


def _sum_slots(ys: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """ys [N*k, H] weighted contributions in x.dtype, in expert order (`order`: the pair of each row) -> [N, H]:
    a token's k rows added in ascending expert order, one rounding per addition."""
    return _sum_rows(ys, _inverse(order, k))


def _inverse(order: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k]: the row of ys (rows in expert order, `order` their pair indices) holding token t's slot j."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return inverse.view(-1, k)


def _sum_rows(ys: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[T, H]: the sum over slots j of ys[inverse[:, j]] (inverse [T, k]), in slot order, one
    rounding per addition (0 + y is exact, as the reference's first index_add_)."""
    first = inverse[:, 0]
    out = ys.index_select(0, first)
    if inverse.shape[1] > 1:
        tmp = torch.empty_like(out)
        for j in range(1, inverse.shape[1]):
            out.add_(torch.index_select(ys, 0, inverse[:, j], out=tmp))
    return out


def _outside_compiled_graphs(fn):
    """`torch.compiler.disable(fn)` without importing torch._dynamo where nothing compiles. If dynamo is
    already loaded, disable now; otherwise nothing can be tracing yet, so eager calls go straight to fn
    and the first call made while tracing builds the disabled wrapper (one extra graph break, once)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    disabled = {}  # filled by the first traced call (dynamo replays the store after its graph break)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():  # a plain flag read: importing nothing
            return fn(*args, **kwargs)
        if "fn" not in disabled:
            disabled["fn"] = torch.compiler.disable(fn)
        return disabled["fn"](*args, **kwargs)

    return wrapper


def segments_fit(hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """`F.grouped_mm` needs every row stride to be a multiple of 16 bytes (true of released shapes),
    and inside torch.compile bf16 inputs (its shape function rejects fp32, which eager CPU accepts)."""
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False
    size = dtype.itemsize  # no tensor allocated per call
    return (hidden * size) % 16 == 0 and (inter * size) % 16 == 0


def experts_segments(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor) -> torch.Tensor:
    """Two `F.grouped_mm` calls over the pairs sorted into per-expert segments (static shapes: no graph break); each
    segment's GEMM is the reference's per-expert GEMM (bit-equal on this CPU)."""
    k = idx.shape[1]
    num_experts, h, inter = gate_up_proj.shape[0], x.shape[1], down_proj.shape[2]
    if not segments_fit(h, inter, x.dtype):
        return experts_reference(x, w, idx, gate_up_proj, down_proj)
    flat, order, ws = _sorted_pairs(idx, w)  # [N*k], [N*k], [N*k, 1]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E] (bincount's size depends on the data)
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's segment
    # [N*k, H] rows copied whole (x[order // k] copies element by element), freed after the GEMM
    gu = F.grouped_mm(x.index_select(0, order // k), gate_up_proj.transpose(1, 2), offs=offs)  # [N*k, 2I]
    act = gelu_mul(gu[:, :inter], gu[:, inter:])  # [N*k, I]: gelu_tanh(gate) * up
    y = F.grouped_mm(act, down_proj.transpose(1, 2), offs=offs)  # [N*k, H]
    # fp32 product rounded to x.dtype in place: a mixed-dtype in-place mul computes in fp32 and rounds once
    return _sum_slots(y.mul_(ws), order, k)


def experts_native(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   inter: int) -> torch.Tensor | None:
    """`experts_segments` through the C fp32 GEMM on weights packed as its panels (gate_up, down: packed stacks),
    the rows gathered inside it; None where it does not apply. Bits: the C GEMM's k order; the rest the reference's."""
    k = idx.shape[1]
    flat, order, ws = _sorted_pairs(idx, w)
    ends = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum_(0)  # [E] end of each expert's segment
    gu = gemm_native.grouped(x, order // k, gate_up, ends, 2 * inter)  # [N*k, 2I]
    if gu is None:
        return None
    act = gelu_mul(gu[:, :inter], gu[:, inter:])  # [N*k, I]
    y = gemm_native.grouped(act, None, down, ends, x.shape[1])
    return None if y is None else _sum_slots(y.mul_(ws), order, k)


def experts_packed(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Sequence[torch.Tensor],
                   down: Sequence[torch.Tensor], inter: int) -> torch.Tensor:
    """The reference's loop with each expert's weights prepacked for oneDNN (`linear_cpu.pack` checked F.linear's
    bits): one GEMM pair per expert that got tokens, one expert after another on all threads, its rows weighted and
    added into the output (ascending experts: the reference's sums) while in cache (no [N*k, H] buffer: at 2,048 rows
    it would be ~90 MB, page-faulted each call)."""
    counts = torch.bincount(idx.reshape(-1), minlength=len(gate_up)).tolist()
    k = idx.shape[1]
    out = torch.zeros_like(x)  # [N, H]
    flat = idx.reshape(-1)  # [N*k] pair p = token p // k
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    tok = order // k  # [N*k] each pair's token, grouped by expert
    ws = w.reshape(-1, 1).index_select(0, order)  # [N*k, 1] fp32 routing weights in the same order
    lo = 0
    for e, c in enumerate(counts):
        if c:
            rows = tok[lo:lo + c]
            gu = linear(x.index_select(0, rows), gate_up[e])  # [c, 2I]
            act = gelu_mul(gu[:, :inter], gu[:, inter:])  # [c, I]
            # fp32 product rounded once to x.dtype (explicit upcast: faster than a mixed-dtype mul)
            y = linear(act, down[e]).float().mul_(ws[lo:lo + c]).to(x.dtype)  # [c, H]
            out.index_add_(0, rows, y)
            lo += c
    return out
