"""NVFP4's int8 product on the CPU (kernels/nvfp4.py `product`, kernels/csrc/nvfp4.c): its stated numerics (x rounded
to int8 per row and group of 16, then the exact product with the decoded weights, rounded once to bf16), its bound
against the exact x, threads, where linear takes it, and the reference it leaves in place."""

import pytest
import torch

from dgcli.kernels import native
from dgcli.kernels import nvfp4 as k
from dgcli.kernels.reference_ops import experts_reference
from dgcli.model.nvfp4 import quantize_rows

pytestmark = pytest.mark.skipif(not k.available(), reason="no AVX-512 VNNI + VBMI (or no compiler) here")


def _matrix(n, kk, seed=0, divide=True):
    packed, scale, glob = quantize_rows(torch.randn(n, kk, generator=torch.Generator().manual_seed(seed)) * kk ** -0.5)
    if not divide:  # a multiplier (ModelOpt, GGUF): the same weights
        glob = 1 / glob
    # the exact weights e2m1 x factor (not bf16-rounded); codes 8..15 are the negatives
    e2m1 = torch.tensor(k.E2M1 + tuple(-v for v in k.E2M1), dtype=torch.float64)[k.unpack(packed).view(n, -1, 16).long()]
    return (packed, scale, glob), (e2m1 * k.factors(scale, glob, divide).double().unsqueeze(-1)).view(n, kk)


def _x_int8(x):
    """x bf16 [M, k] -> (xq as float64, dx [M, k/16] float64): the kernel's rounding, in torch."""
    g = x.float().view(x.shape[0], -1, 16)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(g * inv).clamp(-127, 127).reshape_as(x).double(), (amax / 127).squeeze(-1).double()


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("n", [128, 80])  # 80: the last 64-row block is part padding
@pytest.mark.parametrize("kk", [512, 208])  # 208: 13 groups, not a whole number of 8 or 16 (the kernel's chunks)
def test_product_is_the_exact_product_of_int8_rounded_x(n, divide, kk):
    held, w = _matrix(n, kk, divide=divide)
    for m in (1, 3, 4, 5, 9, 37):  # whole and partial chunks of rows
        x = (torch.randn(m, kk, generator=torch.Generator().manual_seed(m)) * 2).bfloat16()
        x[0, :16] = 0  # an all-zero group: dx 0
        y = k.product(x, *held, divide).double()
        assert y.shape == (m, n)
        xq, dx = _x_int8(x)
        xhat = (xq.view(m, -1, 16) * dx.unsqueeze(-1)).view(m, kk)
        ref, mag = xhat @ w.T, xhat.abs() @ w.abs().T
        assert ((y - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * mag).all(), m  # one bf16 rounding, fp32 sums
        exact = x.double() @ w.T  # against the exact x: x's rounding (<= dx/2 a value) on top
        slack = (dx.repeat_interleave(16, dim=1) / 2) @ w.abs().T
        assert ((y - exact).abs() <= 2 ** -8 * exact.abs() + slack * 1.001 + 1e-5 * mag).all(), m


def test_threads_do_not_change_bits():
    held, _ = _matrix(384, 256, seed=3)
    x = torch.randn(19, 256).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k.product(x, *held, True)
        torch.set_num_threads(2)
        two = k.product(x, *held, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_linear_and_experts_take_it_unless_switched_off(monkeypatch):
    held, _ = _matrix(96, 64)
    x = torch.randn(2, 5, 64).bfloat16()
    assert torch.equal(k.linear(x, *held, True), k.product(x.view(10, 64), *held, True).view(2, 5, 96))
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")  # the reference: the decoded bf16 weights, torch's GEMM
    assert torch.equal(k.linear(x, *held, True), torch.nn.functional.linear(x, k.decode(*held, True)))
    monkeypatch.delenv("DGEMMA_KERNELS")
    xf = x.float()  # fp32 x: the reference too
    assert torch.equal(k.linear(xf, *held, True), torch.nn.functional.linear(xf, k.decode(*held, True, torch.float32)))


def test_experts_through_it_match_the_reference():
    h, inter, e, n_tok = 256, 96, 8, 40
    g = torch.Generator().manual_seed(5)
    gu = quantize_rows(torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5)
    dn = quantize_rows(torch.randn(e, h, inter, generator=g) * inter ** -0.5)
    x = torch.randn(n_tok, h, generator=g).bfloat16()
    w = torch.rand(n_tok, 2, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(n_tok)])  # ~10 rows an expert
    y = k.experts(x, w, idx, gu, dn, True)
    ref = experts_reference(x.double(), w.double(), idx, k.decode(*gu, True).double(), k.decode(*dn, True).double())
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 2.5e-2, rel  # int8 x twice, bf16 between (the GGML forms' int8 path: the same bound)


def test_non_finite_x_reaches_the_outputs():
    held, _ = _matrix(64, 256)
    x = torch.randn(4, 256).bfloat16()
    x[1, 7], x[2, 100] = float("nan"), float("inf")
    y = k.product(x, *held, True)
    assert torch.isfinite(y[[0, 3]]).all()
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).any()  # as the bf16 product's: NaN, inf or NaN


def test_zero_rows_and_no_vnni_build(tmp_path):
    held, _ = _matrix(64, 64)
    assert k.product(torch.empty(0, 64, dtype=torch.bfloat16), *held, True).shape == (0, 64)
    import ctypes
    import subprocess

    so = tmp_path / "k.so"
    subprocess.run(native.compile_command(native.compiler(), "nvfp4", str(so), ("-mno-avx512vnni",)), check=True)
    assert ctypes.CDLL(str(so)).nvfp4_ok() == 0  # such a CPU: `available()` is False, the reference runs
