"""Routed experts for CPU: token-expert pairs grouped by expert, GEMMs over all experts at once.

Owns: `experts_segments` (the default for a model as loaded: pairs sorted into contiguous per-expert
segments, two `F.grouped_mm` calls, no padding, no host read, so it compiles into the decoder's graph),
`experts_grouped` (padded batched GEMMs; used where grouped_mm's 16-byte stride rule does not hold,
and for non-bf16 inputs inside torch.compile) and `experts_packed` (bf16 weights prepacked for oneDNN
at session start, one GEMM pair per expert on its gathered rows, each expert's rows weighted and added
into the output while in cache: what an eager CPU session runs; see kernels/linear_cpu.py and
dgcli/model/packed.py).
All equal `kernels/reference_ops.py::experts_reference` (and so the model's `Experts.forward`): same
GEMM inputs and dtypes, same activation, the fp32 routing-weight product rounded to x.dtype, and a
token's k contributions added in ascending expert order with one rounding per addition. Only the GEMM
kernel may differ, so fp32 agrees to accumulation order and bf16 to one rounding of a GEMM output.
Must not: route (the router is the model's), run on CUDA (kernels/moe.py does), or import
torch._dynamo (about 1 s) in a process that never compiles: `experts_grouped` is kept out of compiled
graphs by `_outside_compiled_graphs`, which touches the compiler only once something compiles.

Why grouped: on this CPU a bf16 GEMM with ~20-80 rows runs at a fraction of the AMX rate and a Python
loop over 128 experts pays that per expert. Measured on the 200 M benchmark config's experts (256
tokens, 12 experts top-4, H 1024, I 512, bf16, 1 thread, isolated; see benchmarks/RESULTS.md): per-expert loop
29.6 ms, padded bmm 17.2 ms, segments 16.3 ms eager and 13.8 ms compiled.
At the released config's shapes (128 experts top-8, H 2816, I 704; benchmarks/bench_experts_cpu.py) a
layer's 1.5 GB of expert weights are read once per call, ~16 rows per expert at 256 rows. On a 2-core
avx512_bf16 EPYC (no AMX), 2 threads: packed ~115-120 ms, ~47-48 % of a 2,048-row GEMM's rate; one read of
the weights through 1-row GEMMs takes 70-100 ms, so the GEMMs on ~16 rows reach neither the memory rate
nor the GEMM rate (their loads and math overlap only in part). Grouped calls (segments, padded bmm) do
worse: they cannot use prepacked weights. At 2,048 rows packed runs at ~78 % (1 thread: 57 % and 83 %).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .linear_cpu import linear
from .reference_ops import experts_reference

# Batched GEMMs compute E·cap rows for N·k useful ones; above this ratio the per-expert loop wins.
MAX_PADDING = 2.0


def _pairs(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-expert pairs in the reference's addition order: idx [N, k] -> flat [N*k] experts (pair p =
    token p // k, slot p % k, slots in ascending expert order) and their weights w_sorted [N, k]."""
    idx_sorted, perm = idx.sort(dim=1)  # [N, k]
    return idx_sorted.reshape(-1), w.gather(1, perm)


def _combine(pairs: torch.Tensor, w_sorted: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pairs [N*k, H] expert outputs in pair order -> [N, H]: each weighted by its fp32 routing weight,
    rounded to dtype (explicit upcast: faster than a mixed-dtype mul), then a token's k contributions
    added in ascending expert order with one rounding per addition, like the reference's index_add_."""
    n, k = w_sorted.shape
    pairs = (pairs.float() * w_sorted.reshape(-1, 1)).to(dtype).view(n, k, pairs.shape[1])
    out = pairs[:, 0]  # 0 + y is exact, as the reference's first index_add_
    for j in range(1, k):
        out = out + pairs[:, j]
    return out


def _sum_slots(ys: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """ys [N*k, H] weighted contributions already in the output dtype, in expert order (`order`: the pair
    index of each row) -> [N, H]: a token's k rows added in ascending expert order (its slots' order), one
    rounding per addition, like `_combine`. One gather per slot straight from ys: the rows are never put
    back in pair order first, and nothing is upcast (the weighting happened where the rows were made)."""
    # inverse [N, k]: the row of ys holding token t's slot j
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    inverse = inverse.view(-1, k)
    out = ys.index_select(0, inverse[:, 0])  # [N, H] 0 + y is exact, as the reference's first index_add_
    if k > 1:
        tmp = torch.empty_like(out)  # one buffer for the k - 1 gathers
        for j in range(1, k):
            out.add_(torch.index_select(ys, 0, inverse[:, j], out=tmp))
    return out


def _sorted_weights(w_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The fp32 routing weight of each row in expert order: [N*k, 1]."""
    return w_sorted.reshape(-1).index_select(0, order).unsqueeze(1)


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


@_outside_compiled_graphs  # reads the largest group size back to the host: keep it out of compiled graphs
def experts_grouped(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor) -> torch.Tensor:
    """x [N, H], w [N, k] fp32, idx [N, k] (distinct experts per row), gate_up_proj [E, 2I, H],
    down_proj [E, H, I] -> [N, H] in x.dtype."""
    n, k = idx.shape
    num_experts, h = gate_up_proj.shape[0], x.shape[1]
    inter = down_proj.shape[2]
    if n == 0:
        return torch.zeros_like(x)
    flat, w_sorted = _pairs(idx, w)  # [N*k], [N, k]
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
    return _combine(pairs, w_sorted, x.dtype)


def segments_fit(hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """`F.grouped_mm` needs every row stride to be a multiple of 16 bytes (true of released shapes),
    and inside torch.compile bf16 inputs (its shape function rejects fp32, which eager CPU accepts)."""
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False
    size = dtype.itemsize  # no tensor allocated per call
    return (hidden * size) % 16 == 0 and (inter * size) % 16 == 0


def experts_segments(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor) -> torch.Tensor:
    """`experts_grouped` with no padding and no host read: pairs sorted by expert into contiguous
    segments, two `F.grouped_mm` calls with the segment ends as offsets. Every shape is static, so it
    compiles into the decoder's graph (`--compile`) without a break; the GEMM per segment is the same
    as the reference's per-expert GEMM (bit-equal on this CPU)."""
    k = idx.shape[1]
    num_experts, h, inter = gate_up_proj.shape[0], x.shape[1], down_proj.shape[2]
    if not segments_fit(h, inter, x.dtype):
        return experts_grouped(x, w, idx, gate_up_proj, down_proj)
    flat, w_sorted = _pairs(idx, w)  # [N*k], [N, k]
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E] (bincount's size depends on the data)
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's segment
    # [N*k, H] rows copied whole (x[order // k] copies element by element), freed after the GEMM
    gu = F.grouped_mm(x.index_select(0, order // k), gate_up_proj.transpose(1, 2), offs=offs)  # [N*k, 2I]
    act = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]  # [N*k, I]
    y = F.grouped_mm(act, down_proj.transpose(1, 2), offs=offs)  # [N*k, H]
    # fp32 product rounded to x.dtype in place: a mixed-dtype in-place mul computes in fp32 and rounds once
    return _sum_slots(y.mul_(_sorted_weights(w_sorted, order)), order, k)


def experts_packed(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Sequence[torch.Tensor],
                   down: Sequence[torch.Tensor], inter: int) -> torch.Tensor:
    """The reference's loop with each expert's two weights prepacked for oneDNN (`linear_cpu.pack`; gate_up[e]
    packs gate_up_proj[e] [2I, H], down[e] packs down_proj[e] [H, I]): one GEMM pair per expert that got
    tokens, its rows gathered whole, weighted and added into the output while they are still in cache.
    Experts in ascending order, so `index_add_` sums each token's contributions as the reference does; each
    GEMM is `F.linear` on the same rows (pack checked the bits): the reference's bits.
    Why not one [N*k, H] buffer in expert order summed at the end (as `experts_segments`): at 2,048 rows
    that buffer and the gathered rows are ~90 MB each, freshly mapped and page-faulted on every call; here
    nothing bigger than one expert's rows is allocated. Counts are read on the host (free on CPU)."""
    n, k = idx.shape
    out = torch.zeros_like(x)  # [N, H]
    if n == 0:
        return out
    flat = idx.reshape(-1)  # [N*k] pair p = token p // k
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    tok = order // k  # [N*k] each pair's token, grouped by expert
    ws = w.reshape(-1, 1).index_select(0, order)  # [N*k, 1] fp32 routing weights in the same order
    lo = 0
    for e, c in enumerate(torch.bincount(flat, minlength=len(gate_up)).tolist()):
        if c:
            rows = tok[lo:lo + c]
            gu = linear(x.index_select(0, rows), gate_up[e])  # [c, 2I]
            act = F.gelu(gu[:, :inter], approximate="tanh").mul_(gu[:, inter:])  # [c, I]
            # fp32 product rounded once to x.dtype (explicit upcast: faster than a mixed-dtype mul)
            y = linear(act, down[e]).float().mul_(ws[lo:lo + c]).to(x.dtype)  # [c, H]
            out.index_add_(0, rows, y)
            lo += c
    return out
