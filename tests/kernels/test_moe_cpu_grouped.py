"""kernels/moe_cpu.py's combines: `experts_segments` sums rows kept in expert order (`_sum_slots`, the same bits
as the pair-order `_combine`) after weighting them in place, `experts_packed` weights and adds each expert's
rows as it goes. Both equal `experts_reference` bit for bit at top-8 of many experts (the released routing),
with skewed routing and a single token, at 1 and 2 threads; and the rounding the in-place weighting relies on
(a mixed-dtype product written into a bf16 tensor rounds the fp32 product once, as the reference's
`.to(x.dtype)`)."""

from __future__ import annotations

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


@pytest.mark.parametrize("k", [1, 2, 8])
def test_sum_slots_is_the_pair_order_combine(k):
    """Rows in expert order summed per token equal `_combine` on the same rows in pair order (bits)."""
    g = torch.Generator().manual_seed(k)
    n, e, h = 37, 16, 24
    idx = torch.rand(n, e, generator=g).argsort(-1)[:, :k]  # distinct experts per token
    w = torch.rand(n, k, generator=g)
    flat, w_sorted = moe_cpu._pairs(idx, w)
    order = torch.argsort(flat, stable=True)
    pairs = torch.randn(n * k, h, generator=g).bfloat16()  # contributions in pair order
    ones = torch.ones(n, k)  # weighting already applied: _combine with unit weights only sums
    want = moe_cpu._combine(pairs, ones, torch.bfloat16)
    assert torch.equal(moe_cpu._sum_slots(pairs[order], order, k), want)


# (N, H, I, E, k, skew): the released routing (top-8 of many experts, ~1-4 rows each), skewed routing (most
# experts idle, a few with every token), a single token.
CASES = [(32, 64, 32, 32, 8, False), (48, 32, 16, 16, 8, True), (1, 32, 16, 16, 8, False), (20, 48, 24, 6, 3, False)]


@pytest.mark.parametrize("n,h,inter,e,k,skew", CASES)
def test_packed_experts_equal_the_reference_at_top8(n, h, inter, e, k, skew, threads):
    if not linear_cpu.packing_available():
        pytest.skip("this torch build has no oneDNN bf16 packed linear")
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=n + e, skew=skew)
    gu = [linear_cpu.pack(gate_up[i]) for i in range(e)]
    dn = [linear_cpu.pack(down[i]) for i in range(e)]
    assert all(p is not None for p in gu + dn)
    got = moe_cpu.experts_packed(x, w, idx, gu, dn, inter)
    assert got.dtype == torch.bfloat16 and torch.equal(got, experts_reference(x, w, idx, gate_up, down))


@pytest.mark.parametrize("n,h,inter,e,k,skew", CASES)
def test_segments_equal_the_reference_at_top8(n, h, inter, e, k, skew, threads):
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=n + e, skew=skew)
    assert torch.equal(moe_cpu.experts_segments(x, w, idx, gate_up, down), experts_reference(x, w, idx, gate_up, down))
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.float32, seed=n + e, skew=skew)
    # fp32: the grouped GEMM may sum in another order than the per-expert one (a few fp32 ulps)
    torch.testing.assert_close(moe_cpu.experts_segments(x, w, idx, gate_up, down),
                               experts_reference(x, w, idx, gate_up, down), atol=1e-5, rtol=1e-5)
