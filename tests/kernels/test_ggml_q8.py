"""The int8 path (kernels/ggml_q8.py) for int4 forms and for GGUF blocks used as stored (Q5_0, Q8_0, Q6_K): its
stated numerics (x rounded to int8 per row and group of 32, then the exact product, rounded once to bf16), its bound
against the exact x, threads, and where linear takes it."""

import pytest
import torch

from dgcli.kernels import ggml_cpu, ggml_q8, native
from dgcli.kernels.reference_ops import experts_reference
from dgcli.checkpoint import ggml_quants
from dgcli.model import ggml

pytestmark = pytest.mark.skipif(not ggml_q8.available(), reason="no AVX-512 VNNI + VBMI (or no compiler) here")
TYPES = [ggml.Q4_K, ggml.Q4_0, ggml.Q8_0, ggml.Q5_0]


def _form(qtype, n, k, seed=0):
    raw = ggml_quants.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5, qtype)
    p = ggml_cpu.prepare(raw, qtype, k)
    return p, ggml_cpu.dequantize_prepared(p).double()  # the form's exact weights [n, k]


def _x_int8(x):
    """x bf16 [M, k] -> (xq [M, k] as float64, dx [M, k/32] float64): the kernel's rounding, in torch."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))  # fp32, as the C
    xq = torch.round(g * inv).clamp(-127, 127)  # nearest even
    return xq.reshape_as(x).double(), (amax / 127).squeeze(-1).double()


def _run(x, p):
    if p.kind == "raw":  # GGUF bytes, decoded per call
        return ggml_q8.blocks_product(x, p.packed, p.qtype, p.k, p.n)[:, :p.n].double()
    return ggml_q8.product(x, p.packed, p.sz, p.k)[:, :p.n].double()


@pytest.mark.parametrize("qtype", TYPES + [ggml.Q6_K])
@pytest.mark.parametrize("n", [128, 80, 70])  # 80: the last 64-row block is padding; 70: a part of 16 rows
def test_product_is_the_exact_product_of_int8_rounded_x(qtype, n):
    k = 512 if qtype in (ggml.Q4_K, ggml.Q6_K) else 352  # 352: blocks of 32, an odd count of them
    p, w = _form(qtype, n, k)
    for m in (1, 3, 4, 5, 9, 37):  # whole and partial chunks of MR rows
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2).bfloat16()
        x[0, :32] = 0  # an all-zero group: dx 0
        y = _run(x, p)
        xq, dx = _x_int8(x)
        xhat = (xq.view(m, -1, 32) * dx.unsqueeze(-1)).view(m, k)
        ref, mag = xhat @ w.T, xhat.abs() @ w.abs().T
        # one bf16 rounding of the result, fp32 sums (products of <= 2^14 terms of K)
        assert ((y - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * mag).all(), (qtype, m)
        # against the exact x: x's rounding (|x - xhat| <= dx/2 per value) on top
        exact = x.double() @ w.T
        slack = (dx.repeat_interleave(32, dim=1) / 2) @ w.abs().T
        assert ((y - exact).abs() <= 2 ** -8 * exact.abs() + slack * 1.001 + 1e-5 * mag).all(), (qtype, m)


@pytest.mark.parametrize("qtype", [ggml.Q4_K, ggml.Q8_0, ggml.Q6_K])
def test_threads_do_not_change_bits(qtype):
    p, _ = _form(qtype, 384, 256, seed=3)
    x = torch.randn(19, 256).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, p)
        torch.set_num_threads(2)
        two = _run(x, p)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("qtype", [ggml.Q4_K, ggml.Q4_0])
def test_linear_takes_it_from_its_rows_unless_switched_off(qtype, monkeypatch):
    p, _ = _form(qtype, 128, 256)
    first = ggml_cpu.Q8_ROWS
    called = []
    real = ggml_q8.product
    monkeypatch.setattr(ggml_q8, "product", lambda *a: called.append(a[0].shape[0]) or real(*a))
    for m in (first - 1, first, 70):
        x = torch.randn(m, 256).bfloat16()
        y = ggml_cpu.linear(x, p)
        assert y.shape == (m, 128)
        if m >= first:
            assert torch.equal(y, real(x, p.packed, p.sz, 256))
    assert called == [first, 70]  # below: torch's int4 kernel as before
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    ggml_cpu.linear(torch.randn(70, 256).bfloat16(), p)
    assert called == [first, 70]
    assert ggml_cpu.linear(torch.randn(70, 256), p).dtype == torch.float32  # fp32 x: the exact tile path
    assert called == [first, 70]


@pytest.mark.parametrize("qtype", [ggml.Q5_0, ggml.Q8_0, ggml.Q6_K])
def test_linear_runs_stored_blocks_through_it_at_every_row_count(qtype, monkeypatch):
    p, _ = _form(qtype, 80, 256)
    assert p.kind == "raw" and p.nbytes() == 80 * ggml.row_bytes(qtype, 256)  # the file's bytes, no other form
    for m in (1, 5):
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(ggml_cpu.linear(x, p), ggml_q8.blocks_product(x, p.packed, qtype, 256, 80)[:, :80])
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")  # the torch path: the dequantizer's weights in row tiles
    x = torch.randn(5, 256).bfloat16()
    got = ggml_cpu.linear(x, p)
    w = ggml_cpu.dequantize_prepared(p).bfloat16()  # the form's weights rounded once to bf16
    exact = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and (got.double() - exact).abs().max() <= 2.0**-7 * exact.abs().max()


@pytest.mark.parametrize("down_type", [ggml.Q4_0, ggml.Q5_0])
def test_experts_through_it_match_the_reference(down_type):
    h, inter, e, n_tok = 256, 96, 8, 40  # 96: rows not a multiple of 256 (Q4_0 / Q5_0), the down projection
    g = torch.Generator().manual_seed(5)
    gate_up = ggml_quants.quantize(torch.randn(e * 2 * inter, h, generator=g) * h ** -0.5, ggml.Q4_K)
    down = ggml_quants.quantize(torch.randn(e * h, inter, generator=g) * inter ** -0.5, down_type)
    pg = ggml_cpu.prepare(gate_up.view(e, 2 * inter, -1), ggml.Q4_K, h)
    pd = ggml_cpu.prepare(down.view(e, h, -1), down_type, inter)
    x = torch.randn(n_tok, h, generator=g).bfloat16()
    w = torch.rand(n_tok, 2, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(n_tok)])  # ~10 rows an expert
    y = ggml_cpu.experts(x, w, idx, pg, pd, inter)
    ref = experts_reference(x.double(), w.double(), idx, ggml_cpu.dequantize_prepared(pg).double(),
                            ggml_cpu.dequantize_prepared(pd).double())
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 2.5e-2, rel  # measured 1.3e-2 (the bf16 paths: 4.8e-3): int8 x twice, bf16 between


def test_zero_rows_and_no_vnni_build(tmp_path, monkeypatch):
    p, _ = _form(ggml.Q4_0, 64, 64)
    assert ggml_q8.product(torch.empty(0, 64, dtype=torch.bfloat16), p.packed, p.sz, 64).shape == (0, 64)
    assert ggml_q8.product(torch.randn(4, 64), p.packed, p.sz, 64) is None  # fp32 x: not this path
    import ctypes
    import subprocess

    so = tmp_path / "k.so"
    subprocess.run(native.compile_command(native.compiler(), "ggml_q8", str(so), ("-mno-avx512vnni",)), check=True)
    assert ctypes.CDLL(str(so)).q8_ok() == 0  # such a CPU: `available()` is False, linear's torch paths run


@pytest.mark.parametrize("qtype", [ggml.Q4_K, ggml.Q8_0, ggml.Q6_K])
def test_non_finite_x_reaches_the_outputs(qtype):
    p, _ = _form(qtype, 64, 256)
    x = torch.randn(4, 256).bfloat16()
    x[1, 7], x[2, 100] = float("nan"), float("inf")
    y = _run(x, p)
    assert torch.isfinite(y[[0, 3]]).all()
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).any()  # as the bf16 product's: NaN, inf or NaN


def test_forms_of_another_shape_are_refused():
    p, _ = _form(ggml.Q4_K, 128, 256)
    x = torch.randn(4, 256).bfloat16()
    assert ggml_q8.product(x, p.packed, p.sz, 512) is None  # K not the form's
    assert ggml_q8.product(x, p.packed, p.sz[:4], 256) is None  # scales cut short
    assert ggml_q8.product(x, p.packed[:100], p.sz, 256) is None  # rows not whole 64-row blocks
    q6, _ = _form(ggml.Q6_K, 64, 256)
    assert ggml_q8.blocks_product(x, q6.packed, ggml.Q6_K, 256, 80) is None  # more rows asked than the bytes hold
    assert ggml_q8.blocks_product(x, q6.packed, ggml.Q5_0, 256, 64) is None  # bytes not the type's
    assert ggml_q8.blocks_product(x, q6.packed, ggml.Q4_K, 256, 64) is None  # not a type it runs as stored
