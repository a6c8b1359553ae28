"""The C fp32 GEMM (kernels/gemm_native.py) against float64 products and torch's GEMM: within fp32 rounding for
odd shapes, strided rows, 1 to 40 rows; batch-, block- and thread-invariant bits; the grouped call equal to its
segments one by one; the routed experts against the reference; the fp32 modules a session swaps in (and their
fallback with the kernel switched off, which gives torch's bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dgcli.kernels import gemm_native, moe_cpu, reference_ops
from dgcli.model.packed import NativeExperts, NativeLinear, pack_for_cpu

pytestmark = pytest.mark.skipif(not gemm_native.available(), reason="no AVX-512 C compiler target here")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a K-term sum, elementwise: K * eps * sum |x||w| (a loose but honest bound)."""
    return x.shape[-1] * 2.0**-23 * (x.abs().double() @ w.abs().double().T) + 1e-30


@pytest.mark.parametrize("k", [1, 7, 160])
@pytest.mark.parametrize("n", [8, 16, 80, 330])
def test_linear_is_the_product(n, k):
    g = torch.Generator().manual_seed(n * 100 + k)
    w = torch.randn(n, k, generator=g)
    p = gemm_native.pack(w)
    assert p.shape == (-(-n // 16), k, 16) and torch.equal(gemm_native.unpack(p, n), w)
    for m in (1, 5, 12, 13, 16, 40):
        x = torch.randn(m, k, generator=g)
        y = gemm_native.linear(x, p, n)
        exact = x.double() @ w.double().T
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - exact).abs() <= _bound(x, w)).all()
        assert torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_bits_do_not_depend_on_the_batch_the_block_or_threads():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(330, 160, generator=g), torch.randn(40, 160, generator=g)
    p = gemm_native.pack(w)
    whole = gemm_native.linear(x, p, 330)
    for r in (0, 11, 12, 39):  # first, last and next-block rows, alone
        assert torch.equal(gemm_native.linear(x[r:r + 1], p, 330), whole[r:r + 1])
    assert torch.equal(gemm_native.linear(x[7:30], p, 330), whole[7:30])
    big = torch.randn(300, 160, generator=g)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm_native.linear(big, p, 330)
        torch.set_num_threads(2)
        assert torch.equal(gemm_native.linear(big, p, 330), one)  # 300x330x160 is split over threads
    finally:
        torch.set_num_threads(n)


def test_strided_and_leading_dims():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 40, generator=g)
    p = gemm_native.pack(w)
    base = torch.randn(3, 5, 64, generator=g)
    x = base[..., 10:50]  # rows 64 apart
    assert torch.equal(gemm_native.linear(x, p, 48), gemm_native.linear(x.contiguous(), p, 48))
    assert gemm_native.linear(x, p, 48).shape == (3, 5, 48)
    assert gemm_native.linear(x.to(torch.bfloat16), p, 48) is None  # another dtype: torch's GEMM


def test_grouped_is_its_segments():
    g = torch.Generator().manual_seed(3)
    e, n, k = 5, 40, 24
    w = torch.randn(e, n, k, generator=g)
    p = gemm_native.pack(w)
    x = torch.randn(9, k, generator=g)
    rows = torch.tensor([4, 0, 8, 8, 1, 2, 3, 5, 6, 7, 1, 0], dtype=torch.int64)
    ends = torch.tensor([3, 3, 7, 12, 12], dtype=torch.int64)  # experts 1 and 4 get nothing
    y = gemm_native.grouped(x, rows, p, ends, n)
    lo = 0
    for j, hi in enumerate(ends.tolist()):
        xs = x[rows[lo:hi]]
        assert torch.equal(y[lo:hi], gemm_native.linear(xs, p[j], n))
        assert torch.allclose(y[lo:hi], xs @ w[j].T, rtol=1e-5, atol=1e-5)
        lo = hi
    # without row indices: the rows in order
    assert torch.equal(gemm_native.grouped(x[rows], None, p, ends, n), y)


def test_experts_against_the_reference():
    g = torch.Generator().manual_seed(4)
    e, h, i, k, t = 8, 32, 48, 2, 21
    gu, dn = torch.randn(e, 2 * i, h, generator=g) / 6, torch.randn(e, h, i, generator=g) / 7
    x = torch.randn(t, h, generator=g)
    w, idx = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    with torch.inference_mode():
        got = moe_cpu.experts_native(x, w, idx, gemm_native.pack(gu), gemm_native.pack(dn), i)
        ref = reference_ops.experts_reference(x, w, idx, gu, dn)
        mod = NativeExperts(gemm_native.pack(gu), gemm_native.pack(dn), h, i)
        assert torch.equal(mod(x, w, idx), got)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5) and not torch.equal(got, torch.zeros_like(got))
    # each token alone: the same bits (batch-invariant)
    alone = moe_cpu.experts_native(x[5:6], w[5:6], idx[5:6], gemm_native.pack(gu), gemm_native.pack(dn), i)
    assert torch.equal(alone, got[5:6])


def test_modules_swapped_in_for_fp32_and_switched_off(monkeypatch):
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 8, bias=True))
    with torch.no_grad():
        for m in model:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
    x = torch.randn(6, 24, generator=g)
    w0 = model[0].weight.detach().clone()
    before = model(x).detach()
    assert pack_for_cpu(model) == 1  # the biased linear stays as stored
    assert type(model[0]) is NativeLinear and type(model[1]) is nn.Linear
    with torch.inference_mode():
        assert torch.allclose(model(x), before, rtol=1e-5, atol=1e-5)
        monkeypatch.setenv("DGEMMA_KERNELS", "torch")
        assert torch.equal(model[0](x), F.linear(x, w0))  # switched off: torch's GEMM on the stored weight
    monkeypatch.delenv("DGEMMA_KERNELS")


def test_a_cpu_without_avx512_builds_a_library_that_says_so(tmp_path):
    """Elsewhere (AVX2 laptops, other architectures) the source still builds, to a library whose gemm_ok() is 0:
    kept in the cache, so no process retries the compiler; torch's GEMM runs."""
    import ctypes
    import subprocess

    from dgcli.kernels import native

    so = tmp_path / "k.so"
    subprocess.run(native.compile_command(native.compiler(), "gemm_native", str(so), ("-mno-avx512f",)), check=True)
    assert ctypes.CDLL(str(so)).gemm_ok() == 0
    assert gemm_native._native().gemm_ok() == 1  # this machine's own build


def test_what_it_leaves_to_torch():
    """Arguments that do not fit the packed weight (or another dtype of index) get None, never a wild read."""
    w = torch.randn(2, 40, 24)
    p, x = gemm_native.pack(w), torch.randn(5, 24)
    ends = torch.tensor([2, 5])
    assert gemm_native.linear(torch.randn(5, 23), p[0], 40) is None  # K differs
    assert gemm_native.linear(x, p[0], 49) is None  # more columns than the panels hold
    assert gemm_native.grouped(x, None, p, ends.int(), 40) is None  # int32 ends
    assert gemm_native.grouped(x, None, p, torch.tensor([5]), 40) is None  # one end for two matrices
    assert gemm_native.grouped(x, torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), p, ends, 40) is None
    assert gemm_native.grouped(x, None, p, ends, 40) is not None
