"""kernels/linear_cpu.py: a bf16 weight prepacked for oneDNN gives `F.linear`'s bits (odd and released-like
shapes, 1 and 2 threads), packing declines what it cannot keep exact, and the routed experts on packed
weights (kernels/moe_cpu.py::experts_packed) are the reference's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kernel_moe import make

from dgcli.kernels import linear_cpu
from dgcli.kernels.moe_cpu import experts_packed
from dgcli.kernels.reference_ops import experts_reference

pytestmark = pytest.mark.skipif(not linear_cpu.packing_available(),
                                reason="this torch build has no oneDNN bf16 packed linear")


@pytest.mark.parametrize("n,k", [(12, 24), (40, 32), (8, 48), (1024, 1024), (1408, 2816), (2816, 704)])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_linear_is_f_linear_bit_for_bit(n, k, threads):
    """Odd and released-like shapes, 1 to 300 rows, a 3-D input, no rows. (A strided input is made contiguous
    first, which F.linear does not do: for large K its transposed-input kernel sums in another order. The
    model only feeds contiguous rows: tests/model/test_packed.py checks that.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
        p = linear_cpu.pack(w)
        if p is None:  # declined: only where oneDNN's packed product really differs here (seen on a 16-core host)
            raw = linear_cpu._reorder(w)
            xs = [torch.randn(m, k, generator=g).bfloat16() for m in linear_cpu.PROBE_ROWS]
            assert any(not torch.equal(linear_cpu.linear(x, raw), F.linear(x, w)) for x in xs)
            return
        assert p.is_mkldnn
        for m in (1, 2, 5, 17, 64, 85, 256, 300):
            x = torch.randn(m, k, generator=g).bfloat16()
            assert torch.equal(linear_cpu.linear(x, p), F.linear(x, w)), m
        x3 = torch.randn(2, 7, k, generator=g).bfloat16()
        assert torch.equal(linear_cpu.linear(x3, p), F.linear(x3, w))
        xt = torch.randn(k, 9, generator=g).bfloat16().t()
        assert torch.equal(linear_cpu.linear(xt, p), F.linear(xt.contiguous(), w))
        assert linear_cpu.linear(x3[:, :0], p).shape == (2, 0, n)
    finally:
        torch.set_num_threads(before)


def test_pack_declines_what_it_cannot_keep_exact(monkeypatch):
    w = torch.randn(16, 32)
    assert linear_cpu.pack(w) is None  # fp32: MKL's GEMM, other bits
    assert linear_cpu.pack(w.half()) is None
    assert linear_cpu.pack(w.bfloat16()) is not None
    monkeypatch.setattr(linear_cpu, "_agrees", lambda n, k, threads: False)  # a machine where bits differ
    assert linear_cpu.pack(w.bfloat16()) is None


@pytest.mark.parametrize("n,h,inter,e,k,skew", [(64, 32, 16, 4, 2, False), (96, 48, 24, 8, 3, True),
                                                (256, 64, 32, 12, 4, False), (5, 32, 16, 8, 2, False)])
def test_packed_experts_are_the_reference_bit_for_bit(n, h, inter, e, k, skew):
    """Routed experts with every expert's matrices packed: exactly the reference's bf16 result (same GEMM
    rows, same combine order), also with skewed routing (experts left without tokens) and a few rows."""
    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=n, skew=skew)
    gu = [linear_cpu.pack(gate_up[i]) for i in range(e)]
    dn = [linear_cpu.pack(down[i]) for i in range(e)]
    want = experts_reference(x, w, idx, gate_up, down)
    assert torch.equal(experts_packed(x, w, idx, gu, dn, inter), want)
    assert experts_packed(x[:0], w[:0], idx[:0], gu, dn, inter).shape == (0, h)
