"""kernels/moe_cpu.py's combines: `experts_segments` sums rows kept in expert order after weighting them in place;
`experts_packed` weights and adds each expert's rows as it goes. Both equal `experts_reference` bit for bit at top-8
of many experts (the released routing), with skewed routing and a single token, at 1 and 2 threads, also in
inference mode; the rounding the in-place weighting relies on (a mixed-dtype product written into a bf16 tensor
rounds the fp32 product once, as the reference's `.to(x.dtype)`); and callers in two threads at once."""

from __future__ import annotations

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
@pytest.mark.parametrize("n,h,inter,e,k,skew", CASES + [(150, 32, 16, 16, 8, False)])
def test_packed_experts_equal_the_reference_at_top8(n, h, inter, e, k, skew, threads):
    args, want = packed_case(n, h, inter, e, k, skew)
    got = moe_cpu.experts_packed(*args)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with torch.inference_mode():  # the model's mode
        assert torch.equal(moe_cpu.experts_packed(*args), want)
    assert moe_cpu.experts_packed(args[0][:0], args[1][:0], args[2][:0], *args[3:]).shape == (0, h)


@needs_packing
@pytest.mark.parametrize("n,threads_", [(32, 2), (32, 1), (200, 2), (200, 1)])
def test_packed_experts_give_the_reference_bits_on_any_thread_count(n, threads_):
    """The reference's bits whatever the thread count: 32 tokens top-8 of 32 experts (8 rows each), 200 tokens
    top-8 of 16 (100 each)."""
    args, ref = packed_case(n, 32, 16, 32 if n == 32 else 16, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads_)
    try:
        assert torch.equal(moe_cpu.experts_packed(*args), ref)
    finally:
        torch.set_num_threads(before)


@needs_packing
def test_packed_experts_from_several_callers_at_once():
    """Two threads calling at once (the server's engine thread beside a library caller): both get the reference's
    bits, neither hangs."""
    cases = [packed_case(40, 32, 16, 16, 8, skew) for skew in (False, True)]
    with ThreadPoolExecutor(2) as callers:
        got = list(callers.map(lambda c: moe_cpu.experts_packed(*c[0]), cases * 3))
    assert all(torch.equal(g, c[1]) for g, c in zip(got, cases * 3))


@pytest.mark.parametrize("n,h,inter,e,k,skew", CASES)
def test_segments_equal_the_reference_at_top8(n, h, inter, e, k, skew, threads):
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=n + e, skew=skew)
    assert torch.equal(moe_cpu.experts_segments(x, w, idx, gate_up, down), experts_reference(x, w, idx, gate_up, down))
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.float32, seed=n + e, skew=skew)
    # fp32: the grouped GEMM may sum in another order than the per-expert one (a few fp32 ulps)
    torch.testing.assert_close(moe_cpu.experts_segments(x, w, idx, gate_up, down),
                               experts_reference(x, w, idx, gate_up, down), atol=1e-5, rtol=1e-5)
