"""Routed experts for CPU: token-expert pairs grouped by expert.

Owns: `experts_segments` (torch's own grouped GEMM, for a model as loaded: pairs sorted into contiguous per-expert
segments, two `F.grouped_mm` calls, no padding, no host read, so it compiles into the decoder's graph; the
reference where grouped_mm's 16-byte stride rule does not hold) and the fast path of a session that packed its
weights at load (dgcli/model/packed.py): `experts_packed` (bf16 weights prepacked for oneDNN, one GEMM pair per
expert on its gathered rows, with its pool of one-thread workers (`_pool`) that share out the experts where each
gets few rows) and `experts_native` (fp32: the same segments through the C GEMM, kernels/gemm_native.py).
All equal `kernels/reference_ops.py::experts_reference` (and so the model's `Experts.forward`): same
GEMM inputs and dtypes, same activation, the fp32 routing-weight product rounded to x.dtype, and a
token's k contributions added in ascending expert order with one rounding per addition. Only the GEMM
kernel may differ, so fp32 agrees to accumulation order, bf16 to one rounding of a GEMM output.
Must not: route (the router is the model's), run on CUDA (kernels/moe.py does), import
torch._dynamo (about 1 s) in a process that never compiles (`_outside_compiled_graphs` touches the compiler only
once something compiles), or
change the torch thread count of any thread but its own workers.

Why grouped: on this CPU a bf16 GEMM with ~20-80 rows runs at a fraction of the AMX rate and a Python
loop over 128 experts pays that per expert. Measured on the 200 M benchmark config's experts (256
tokens, 12 experts top-4, H 1024, I 512, bf16, 1 thread, isolated; see benchmarks/RESULTS.md): per-expert loop
29.6 ms, padded bmm 17.2 ms, segments 16.3 ms eager and 13.8 ms compiled.
At the released config's shapes (128 experts top-8, H 2816, I 704; benchmarks/bench_experts_cpu.py) a
layer's 1.5 GB of expert weights are read once per call, ~16 rows per expert at 256 rows. On a 2-core
avx512_bf16 EPYC (no AMX), 2 threads, one expert at a time on both threads: ~115-130 ms, ~44-48 % of a
2,048-row GEMM's rate; one read of the weights through 1-row GEMMs takes 60-100 ms, so the GEMMs on ~16
rows reach neither the memory rate nor the GEMM rate (their loads and math overlap only in part). Shared
out across two one-thread workers (`_split`): ~98-113 ms, 49-52 % in runs beside another agent's work and
~57 % in quieter ones, faster in every round of every run (benchmarks/RESULTS.md); its GEMMs alone take
~90 ms, so what is left is the weight stream. Grouped calls (segments, padded bmm) do worse: they cannot
use prepacked weights. At 2,048 rows one expert at a time runs at ~75-85 % (1 thread: ~55-59 % at 256
rows and ~82-85 % at 2,048); split gains nothing there (2 threads: within a few %, with a 92 MB buffer
page-faulted per call; 1 thread: ~4-6 % slower), so it is used up to SPLIT_MAX_ROWS rows per expert only.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from . import gemm_native
from .linear_cpu import PROBE_ROWS, linear, pack
from .reference_ops import experts_reference, gelu_mul

# experts_packed shares the experts out across one-thread workers up to this many rows per expert that got tokens.
SPLIT_MAX_ROWS = 64
# ... and then sums this many tokens' contributions at a time, each block handed to the next free worker.
SUM_BLOCK = 64


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
    return _sum_rows(ys, _inverse(order, k))


def _inverse(order: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k]: the row of ys (rows in expert order, `order` their pair indices) holding token t's slot j."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return inverse.view(-1, k)


def _sum_rows(ys: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] (into out if given): the sum over slots j of ys[inverse[:, j]] (inverse [T, k]), added in slot
    order, one rounding per addition (0 + y is exact, as the reference's first index_add_); one buffer for
    the k - 1 gathers."""
    first = inverse[:, 0]
    out = ys.index_select(0, first) if out is None else torch.index_select(ys, 0, first, out=out)
    if inverse.shape[1] > 1:
        tmp = torch.empty_like(out)
        for j in range(1, inverse.shape[1]):
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


def segments_fit(hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """`F.grouped_mm` needs every row stride to be a multiple of 16 bytes (true of released shapes),
    and inside torch.compile bf16 inputs (its shape function rejects fp32, which eager CPU accepts)."""
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False
    size = dtype.itemsize  # no tensor allocated per call
    return (hidden * size) % 16 == 0 and (inter * size) % 16 == 0


def experts_segments(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts with no padding and no host read (torch's own grouped GEMM): pairs sorted by expert into contiguous
    segments, two `F.grouped_mm` calls with the segment ends as offsets. Every shape is static, so it
    compiles into the decoder's graph (`--compile`) without a break; the GEMM per segment is the same
    as the reference's per-expert GEMM (bit-equal on this CPU)."""
    k = idx.shape[1]
    num_experts, h, inter = gate_up_proj.shape[0], x.shape[1], down_proj.shape[2]
    if not segments_fit(h, inter, x.dtype):
        return experts_reference(x, w, idx, gate_up_proj, down_proj)
    flat, w_sorted = _pairs(idx, w)  # [N*k], [N, k]
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))  # [E] (bincount's size depends on the data)
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's segment
    # [N*k, H] rows copied whole (x[order // k] copies element by element), freed after the GEMM
    gu = F.grouped_mm(x.index_select(0, order // k), gate_up_proj.transpose(1, 2), offs=offs)  # [N*k, 2I]
    act = gelu_mul(gu[:, :inter], gu[:, inter:])  # [N*k, I]: gelu_tanh(gate) * up
    y = F.grouped_mm(act, down_proj.transpose(1, 2), offs=offs)  # [N*k, H]
    # fp32 product rounded to x.dtype in place: a mixed-dtype in-place mul computes in fp32 and rounds once
    return _sum_slots(y.mul_(_sorted_weights(w_sorted, order)), order, k)


def experts_native(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   inter: int) -> torch.Tensor | None:
    """`experts_segments` with the C fp32 GEMM over weights packed as its panels (kernels/gemm_native.py; gate_up
    [E, ..] packs gate_up_proj, down packs down_proj). Each GEMM pair is one
    call over every expert's segment, the rows gathered inside it. None where the C GEMM does not apply. Bits: the
    C GEMM's (k order); the activation, weighting and sums are the reference's."""
    n, k = idx.shape
    flat, w_sorted = _pairs(idx, w)  # [N*k], [N, k]
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    ends = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum_(0)  # [E] end of each expert's segment
    gu = gemm_native.grouped(x, order // k, gate_up, ends, 2 * inter)  # [N*k, 2I]
    if gu is None:
        return None
    ws, act = _sorted_weights(w_sorted, order), gelu_mul(gu[:, :inter], gu[:, inter:])  # [N*k, 1] fp32, [N*k, I]
    y = gemm_native.grouped(act, None, down, ends, x.shape[1])
    return None if y is None else _sum_slots(y.mul_(ws), order, k)


def experts_packed(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Sequence[torch.Tensor],
                   down: Sequence[torch.Tensor], inter: int, split: bool | None = None) -> torch.Tensor:
    """The reference's loop with each expert's two weights prepacked for oneDNN (`linear_cpu.pack`; gate_up[e]
    packs gate_up_proj[e] [2I, H], down[e] packs down_proj[e] [H, I]): one GEMM pair per expert that got
    tokens. Each GEMM is `F.linear` on the same rows (pack checked the bits): the reference's bits.
    split None (default): experts shared out across one-thread workers (`_split`) where they get few rows
    each (at most SPLIT_MAX_ROWS on average) and there are several threads; else one expert at a time on
    all threads (`_in_turn`). True / False force either (benchmarks and tests). Counts are read on the host
    (free on CPU)."""
    n, k = idx.shape
    if n == 0:
        return torch.zeros_like(x)
    counts = torch.bincount(idx.reshape(-1), minlength=len(gate_up)).tolist()
    workers = torch.get_num_threads()
    if split is None:
        split = (workers > 1 and n * k <= SPLIT_MAX_ROWS * sum(c > 0 for c in counts)
                 and _workers_agree(tuple(gate_up[0].shape), tuple(down[0].shape), workers))
    if split:
        return _split(x, w, idx, gate_up, down, inter, counts, workers)
    return _in_turn(x, w, idx, gate_up, down, inter, counts)


def _in_turn(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Sequence[torch.Tensor],
             down: Sequence[torch.Tensor], inter: int, counts: list[int]) -> torch.Tensor:
    """One expert after another on all threads, its rows gathered whole, weighted and added into the output
    while they are still in cache. Experts in ascending order, so `index_add_` sums each token's
    contributions as the reference does.
    Why not one [N*k, H] buffer in expert order summed at the end (as `_split`) where experts get many rows:
    at 2,048 rows that buffer is ~90 MB, freshly mapped and page-faulted on every call; here nothing bigger
    than one expert's rows is allocated."""
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


def _split(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Sequence[torch.Tensor],
           down: Sequence[torch.Tensor], inter: int, counts: list[int], workers: int) -> torch.Tensor:
    """The experts shared out across `workers` one-thread workers, each taking the next expert (most rows
    first) as it finishes one and weighting its rows into their own rows of one [N*k, H] buffer in expert order;
    then, once all are done, the same workers sum the tokens' k contributions in ascending expert order
    (`_sum_rows`, the reference's additions), a block of tokens at a time.
    Why: a GEMM on ~16 rows is poorly threaded (oneDNN splits one small product across the threads, and
    they wait on the same weight stream and on each other at every op); one expert per thread keeps each
    thread computing while the other's weights arrive, and the elementwise work and Python between the
    GEMMs run on both threads. Also far less hurt when another process takes a core: nothing waits at a
    barrier for a thread that is not running."""
    n, k = idx.shape
    flat, w_sorted = _pairs(idx, w)  # [N*k] slots in ascending expert order, [N, k]
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    tok = order // k  # [N*k] each pair's token, grouped by expert
    ws = _sorted_weights(w_sorted, order)  # [N*k, 1] fp32
    ys = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)  # [N*k, H] weighted, expert order
    sizes = [c for c in counts if c]
    # (expert, its tokens, fp32 weights and output rows: views), the biggest first so that the workers finish
    # together (each expert writes only its own rows: the order changes no bits)
    jobs = sorted(zip([e for e, c in enumerate(counts) if c], tok.split(sizes), ws.split(sizes), ys.split(sizes)),
                  key=lambda j: -len(j[1]))
    experts = iter(jobs)  # shared: each next() hands one expert to one worker (atomic under the GIL)

    def expert_rows() -> None:
        for e, rows, we, ye in experts:
            gu = linear(x.index_select(0, rows), gate_up[e])  # [c, 2I]
            act = gelu_mul(gu[:, :inter], gu[:, inter:])  # [c, I]
            # the fp32 product written into a bf16 buffer rounds once, as the reference's .to(x.dtype)
            torch.mul(linear(act, down[e]), we, out=ye)

    inverse = _inverse(order, k)  # [N, k]
    out = torch.empty_like(x)  # [N, H]
    blocks = iter(range(0, n, SUM_BLOCK))

    def token_sums() -> None:
        for t in blocks:
            _sum_rows(ys, inverse[t:t + SUM_BLOCK], out[t:t + SUM_BLOCK])

    _on_workers(expert_rows, workers)  # every expert done before any token is summed
    _on_workers(token_sums, workers)
    return out


def _on_workers(fn, workers: int) -> None:
    """fn run once on each of `workers` pool threads, under the caller's inference and grad modes (they are
    thread-local; an inference tensor may be written only in inference mode); returns when all are done.
    No task waits on another, so callers in several threads at once only queue. One worker: the caller's
    thread runs fn."""
    if workers == 1:
        fn()
        return
    modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def task() -> None:
        with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
            fn()

    pool = _pool(workers)
    for f in [pool.submit(task) for _ in range(workers)]:
        f.result()


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, workers) -> pool
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """`workers` threads at one torch thread each, made once per process (a forked child makes its own).
    torch.set_num_threads(1) in a worker also sets the count that threads started later begin with, so the
    caller's count is set again once every worker has started."""
    key = (os.getpid(), workers)
    pool = _POOLS.get(key)
    if pool is not None:
        return pool
    with _POOL_LOCK:  # two callers' first calls at once make one pool
        pool = _POOLS.get(key)
        if pool is not None:
            return pool
        started = threading.Barrier(workers + 1)
        pool = ThreadPoolExecutor(workers, initializer=_one_thread, thread_name_prefix="experts")
        waits = [pool.submit(started.wait) for _ in range(workers)]  # every worker started and set
        started.wait()
        for f in waits:
            f.result()
        torch.set_num_threads(torch.get_num_threads())
        _POOLS[key] = pool
    return pool


def _one_thread() -> None:
    # torch's first call in a thread gives it the process's count: take it first, or a count set later in
    # another thread could reach this one (seen where the caller had one thread when the pool was made)
    torch.get_num_threads()
    torch.set_num_threads(1)


@functools.cache
def _workers_agree(gate_up: tuple[int, int], down: tuple[int, int], threads: int) -> bool:
    """Does the packed GEMM in a one-thread worker give `F.linear`'s bits at the caller's thread count, for
    both weight shapes? (`pack` checked them at the caller's count only; random values, its probe heights.)"""
    for n, k in (gate_up, down):
        g = torch.Generator().manual_seed(n * 7919 + k)
        w = torch.empty(n, k, dtype=torch.bfloat16).uniform_(-(3 / k) ** 0.5, (3 / k) ** 0.5, generator=g)
        p = pack(w)
        if p is None:
            return False
        xs = [torch.empty(m, k, dtype=torch.bfloat16).uniform_(-2, 2, generator=g) for m in PROBE_ROWS]
        got = _pool(threads).submit(lambda: [linear(x, p) for x in xs]).result()
        if not all(torch.equal(F.linear(x, w), y) for x, y in zip(xs, got)):
            return False
    return True
