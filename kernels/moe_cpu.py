"""Routed experts for CPU: token-expert pairs grouped by expert.

Owns: `experts_segments` (torch's grouped GEMM over contiguous per-expert segments: no padding, no host read, so it
compiles into the decoder's graph), and for a session that packed its weights at load (dgcli/model/packed.py)
`experts_packed` (bf16 weights prepacked for oneDNN, one GEMM pair per expert) and `experts_native` (fp32, the C
GEMM of kernels/gemm_native.py). All equal `reference_ops.experts_reference`: same GEMM inputs, activation, the
fp32 routing-weight product rounded to x.dtype, a token's k contributions added in ascending expert order with one
rounding each; only the GEMM kernel may differ.
Must not: route, run on CUDA (kernels/moe.py does), import torch._dynamo (~1 s) in a process that never compiles,
or change the torch thread count of any thread but its own workers.

Why the packed path shares experts out across one-thread workers (`_split`) where each gets few rows: a GEMM on
~16 rows is poorly threaded by oneDNN (threads wait on one weight stream and on each other); one expert per thread
keeps each computing while the other's weights arrive. At the released shapes on a 2-core EPYC: ~98-113 ms a
layer against ~115-130 ms one expert at a time; at 2,048 rows split gains nothing (benchmarks/RESULTS.md).
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
from .linear_cpu import linear, pack, probes
from .reference_ops import experts_reference, gelu_mul

# experts_packed shares the experts out across one-thread workers up to this many rows per expert that got tokens.
SPLIT_MAX_ROWS = 64
# ... and then sums this many tokens' contributions at a time, each block handed to the next free worker.
SUM_BLOCK = 64


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


def _sum_rows(ys: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] (into out if given): the sum over slots j of ys[inverse[:, j]] (inverse [T, k]), in slot order, one
    rounding per addition (0 + y is exact, as the reference's first index_add_)."""
    first = inverse[:, 0]
    out = ys.index_select(0, first) if out is None else torch.index_select(ys, 0, first, out=out)
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
                   down: Sequence[torch.Tensor], inter: int, split: bool | None = None) -> torch.Tensor:
    """The reference's loop with each expert's weights prepacked for oneDNN (`linear_cpu.pack` checked F.linear's
    bits): one GEMM pair per expert that got tokens. split None: shared out across one-thread workers (`_split`) where
    experts get at most SPLIT_MAX_ROWS rows on average and there are several threads, else one expert at a time
    (`_in_turn`); True / False force either."""
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
    """One expert after another on all threads, its rows weighted and added into the output (ascending experts: the
    reference's sums) while in cache. Why not `_split`'s [N*k, H] buffer where experts get many rows: at 2,048 rows
    it is ~90 MB, freshly mapped and page-faulted on every call."""
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
    """The experts shared out across `workers` one-thread workers (each takes the next expert, most rows first, and
    weights its rows into their own rows of one [N*k, H] buffer in expert order); once all are done, the same
    workers sum the tokens' k contributions (`_sum_rows`), a block of tokens at a time. Nothing waits at a barrier
    for a thread that is not running, so another process taking a core hurts less."""
    n, k = idx.shape
    _, order, ws = _sorted_pairs(idx, w)
    tok = order // k  # [N*k] each pair's token, grouped by expert
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
    """fn run once on each of `workers` pool threads under the caller's (thread-local) inference and grad modes;
    returns when all are done. No task waits on another, so callers in several threads at once only queue."""
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
    """Does the packed GEMM in a one-thread worker give `F.linear`'s bits for both weight shapes (`pack` checked them
    at the caller's thread count only)?"""
    for n, k in (gate_up, down):
        w, xs = probes(n, k)
        p = pack(w)
        if p is None:
            return False
        got = _pool(threads).submit(lambda: [linear(x, p) for x in xs]).result()
        if not all(torch.equal(F.linear(x, w), y) for x, y in zip(xs, got)):
            return False
    return True
