"""kernels/moe_cpu.py's combines: `experts_segments` sums rows kept in expert order after weighting them in place;
`experts_packed` either weights and adds each expert's rows as it goes (in turn) or shares the experts out across
one-thread workers that weight them into a buffer and then sum blocks of tokens (split). All equal `experts_reference` bit for bit at top-8 of many
experts (the released routing), with skewed routing and a single token, at 1 and 2 threads, also in inference
mode; the rounding the in-place weighting relies on (a mixed-dtype product written into a bf16 tensor rounds
the fp32 product once, as the reference's `.to(x.dtype)`); which way the default picks; that the workers run
one thread each without changing anyone else's count; and callers in two threads at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_kernel_moe import make

from dgcli.kernels import linear_cpu, moe_cpu
from dgcli.kernels.reference_ops import experts_reference


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighting_into_a_buffer_rounds_the_fp32_product_once(dtype):
    g = torch.Generator().manual_seed(3)
    y = torch.randn(64, 40, generator=g).to(dtype)
    w = torch.rand(64, 1, generator=g) * 3  # fp32 routing weights, not powers of two
    want = (y.float() * w).to(dtype)
    buf = torch.empty(80, 40, dtype=dtype)
    torch.mul(y, w, out=buf[8:72])  # a slice of a bigger buffer, as experts_packed writes its segments
    assert torch.equal(buf[8:72], want)
    assert torch.equal(y.clone().mul_(w), want)  # experts_segments' in-place form


# (N, H, I, E, k, skew): the released routing (top-8 of many experts, ~1-4 rows each), skewed routing (most
# experts idle, a few with every token), a single token.
CASES = [(32, 64, 32, 32, 8, False), (48, 32, 16, 16, 8, True), (1, 32, 16, 16, 8, False), (20, 48, 24, 6, 3, False)]


needs_packing = pytest.mark.skipif(not linear_cpu.packing_available(),
                                   reason="this torch build has no oneDNN bf16 packed linear")


def packed_case(n, h, inter, e, k, skew=False):
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=n + e, skew=skew)
    gu = [linear_cpu.pack(gate_up[i]) for i in range(e)]
    dn = [linear_cpu.pack(down[i]) for i in range(e)]
    assert all(p is not None for p in gu + dn)
    return (x, w, idx, gu, dn, inter), experts_reference(x, w, idx, gate_up, down)


@needs_packing
@pytest.mark.parametrize("split", [None, True, False], ids=["default", "split", "in_turn"])
@pytest.mark.parametrize("n,h,inter,e,k,skew", CASES + [(150, 32, 16, 16, 8, False)])  # + several token blocks
def test_packed_experts_equal_the_reference_at_top8(n, h, inter, e, k, skew, split, threads):
    args, want = packed_case(n, h, inter, e, k, skew)
    got = moe_cpu.experts_packed(*args, split=split)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with torch.inference_mode():  # the model's mode: the workers write inference tensors
        assert torch.equal(moe_cpu.experts_packed(*args, split=split), want)
    assert moe_cpu.experts_packed(args[0][:0], args[1][:0], args[2][:0], *args[3:], split=split).shape == (0, h)


@needs_packing
@pytest.mark.parametrize("n,threads_", [(32, 2), (32, 1), (200, 2), (200, 1)])
def test_packed_experts_default_gives_the_reference_bits_on_any_thread_count(n, threads_):
    """The default way to run them (shared out across workers for few rows an expert on several threads, one expert
    at a time otherwise) gives the reference's bits whatever the thread count: 32 tokens top-8 of 32 experts (8
    rows each), 200 tokens top-8 of 16 (100 each)."""
    args, ref = packed_case(n, 32, 16, 32 if n == 32 else 16, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads_)
    try:
        assert torch.equal(moe_cpu.experts_packed(*args), ref)
    finally:
        torch.set_num_threads(before)


@needs_packing
def test_workers_run_one_thread_each_and_leave_the_callers_count(threads):
    """Each worker runs its GEMMs on one thread; making the pool changes no other thread's count (a worker's
    torch.set_num_threads(1) also sets the count new threads start with: the caller's is set back)."""
    pool = moe_cpu._pool(3)  # a size no other test uses: made here
    assert sorted(pool.map(lambda _: torch.get_num_threads(), range(6))) == [1] * 6
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == threads and seen == [threads]


@needs_packing
def test_split_experts_from_several_callers_at_once():
    """Two threads calling at once share the workers (tasks queue, none waits on another): both get the
    reference's bits, neither hangs."""
    cases = [packed_case(40, 32, 16, 16, 8, skew) for skew in (False, True)]
    with ThreadPoolExecutor(2) as callers:
        got = list(callers.map(lambda c: moe_cpu.experts_packed(*c[0], split=True), cases * 3))
    assert all(torch.equal(g, c[1]) for g, c in zip(got, cases * 3))


@pytest.mark.parametrize("n,h,inter,e,k,skew", CASES)
def test_segments_equal_the_reference_at_top8(n, h, inter, e, k, skew, threads):
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=n + e, skew=skew)
    assert torch.equal(moe_cpu.experts_segments(x, w, idx, gate_up, down), experts_reference(x, w, idx, gate_up, down))
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.float32, seed=n + e, skew=skew)
    # fp32: the grouped GEMM may sum in another order than the per-expert one (a few fp32 ulps)
    torch.testing.assert_close(moe_cpu.experts_segments(x, w, idx, gate_up, down),
                               experts_reference(x, w, idx, gate_up, down), atol=1e-5, rtol=1e-5)
