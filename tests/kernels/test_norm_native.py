"""The C norm and gated GELU (kernels/norm_native.py) against the torch ops they replace: the same bits (the norm's
sum of squares in ATen's order, the GELU through torch's own Sleef tanh on the elements ATen vectorises), for odd
widths, 1 to 300 rows, strided rows, both dtypes, every weight dtype, one and two threads; the residual and
pre-add fusions against their torch composition; the switches that keep the torch ops; a model pass unchanged."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import dispatch, native, norm_native, reference_ops

pytestmark = pytest.mark.skipif(norm_native._native() is None, reason="no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_torchs_bits(dtype):
    g = torch.Generator().manual_seed(0)
    for width in (160, 2816, 33, 7, 16):
        for rows in (1, 37, 300):
            x = (torch.randn(rows, width, generator=g) * (300.0 if rows == 37 else 1.0)).to(dtype)
            w = torch.randn(width, generator=g)
            for weight in (None, w, w.to(dtype)):
                got = norm_native.rms_norm(x, weight, 1e-6)
                assert got is not None and _same(got, reference_ops.rms_norm_reference(x, weight, 1e-6)), \
                    (width, rows, weight is None or weight.dtype)
                if weight is None or weight.dtype == dtype:  # what the CPU path ran before: torch's own op
                    assert _same(got, F.rms_norm(x, (width,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_the_shapes_it_leaves_to_torch(dtype):
    g = torch.Generator().manual_seed(1)
    big = torch.randn(40, 200, generator=g).to(dtype)
    w = torch.randn(160, generator=g).to(dtype)
    for x in (big[:37, :160], big[3:, 40:], big.view(8, 5, 200)[:, :, :160], torch.randn(2, 5, 160).to(dtype)):
        got = norm_native.rms_norm(x, w, 1e-5)
        assert got is not None and _same(got, reference_ops.rms_norm_reference(x, w, 1e-5))
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    for t in (x.transpose(0, 1), x[:, ::2], x[..., ::2]):  # rows that fold into no single stride: torch's op
        assert norm_native.rms_norm(t, None, 1e-6) is None
        assert _same(dispatch.rms_norm(t, None, 1e-6), reference_ops.rms_norm_reference(t, None, 1e-6))
    assert norm_native.rms_norm(x.half(), None, 1e-6) is None
    wg = torch.ones(64, requires_grad=True)
    assert norm_native.rms_norm(x.float(), wg, 1e-6) is None  # autograd: torch's op keeps the graph
    with torch.no_grad():
        assert norm_native.rms_norm(x.float(), wg, 1e-6) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_and_pre_add_fusions_are_the_composition(dtype):
    g = torch.Generator().manual_seed(2)
    for rows, width in ((1, 160), (37, 160), (300, 33)):
        x, p = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(2))
        r = torch.randn(rows, width + 3, generator=g).to(dtype)[:, 3:]  # a strided residual
        w = torch.randn(width, generator=g).to(dtype)
        norm = lambda t: reference_ops.rms_norm_reference(t, w, 1e-6)  # noqa: E731
        for residual, pre in ((r, None), (None, p), (r, p)):
            want = norm(x if pre is None else x + pre)
            want = want if residual is None else residual + want
            got = norm_native.rms_norm(x, w, 1e-6, residual=residual, pre_add=pre)
            assert got is not None and _same(got, want), (rows, width, residual is None, pre is None)
            assert _same(dispatch.rms_norm_add(x, w, 1e-6, residual=residual, pre_add=pre), want)
    assert norm_native.rms_norm(x, w, 1e-6, residual=r[:1]) is None  # a broadcast residual: torch's add


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul_is_torchs_bits(dtype, threads, monkeypatch):
    monkeypatch.setattr(norm_native, "GELU_MIN_ELEMENTS", 0)
    monkeypatch.setattr(norm_native, "GELU_DTYPES", tuple(DTYPES))
    monkeypatch.setattr(norm_native, "FAST_TANH_DTYPES", ())  # Sleef's tanh, torch's own
    g = torch.Generator().manual_seed(3)
    for t in (1, 2):
        torch.set_num_threads(t)
        for rows, width in ((1, 160), (37, 33), (300, 160), (3, 40000)):
            gate, up = ((torch.randn(rows, width, generator=g) * 3).to(dtype) for _ in range(2))
            got = norm_native.gelu_mul(gate, up)
            assert got is not None and _same(got, F.gelu(gate, approximate="tanh") * up), (t, rows, width)
            gu = (torch.randn(rows, 2 * width, generator=g) * 3).to(dtype)  # gate, up halves: strided rows
            got = norm_native.gelu_mul(gu[:, :width], gu[:, width:])
            assert _same(got, F.gelu(gu[:, :width], approximate="tanh") * gu[:, width:]), (t, rows, width)
        gu = (torch.randn(4, 70, 2 * 160, generator=g) * 3).to(dtype)  # [E, cap, 2I]
        assert _same(dispatch.gelu_mul_fused(gu, 160), F.gelu(gu[..., :160], approximate="tanh") * gu[..., 160:])


def test_the_fast_fp32_gelu_is_within_a_few_ulp_of_torchs(threads, monkeypatch):
    """fp32 GELUs take glibc's vector tanh (FAST_TANH_DTYPES): other bits, a few ulp of tanh from torch's."""
    if native.vector_tanh("libmvec") is None:
        pytest.skip("no libmvec tanhf here: fp32 GELUs keep torch's bits")
    g = torch.Generator().manual_seed(9)
    for t in (1, 2):
        torch.set_num_threads(t)
        for rows, width in ((16, 320), (37, 33), (300, 160), (3, 40000)):
            gu = torch.randn(rows, 2 * width, generator=g) * 3
            gate, up = gu[:, :width], gu[:, width:]
            got, want = norm_native.gelu_mul(gate, up), F.gelu(gate, approximate="tanh") * up
            bound = 4 * 2.0**-23 * (0.5 * gate * up).abs() + 2 * 2.0**-23 * want.abs() + 1e-37
            assert got is not None and ((got - want).abs() <= bound).all(), (t, rows, width)
    assert not _same(got, want)  # it did take the other tanh (a 120,000-element GELU differs somewhere)
    gu = torch.randn(37, 2 * 40, generator=g) * 3  # rows of 40: 32 through the vector tanh, 8 through tanhf
    whole = norm_native.gelu_mul(gu[:, :40], gu[:, 40:])
    for r in (0, 5, 36):  # a row alone, at every size: its bits whatever its batch
        assert _same(norm_native.gelu_mul(gu[r:r + 1, :40], gu[r:r + 1, 40:]), whole[r:r + 1])
    g2, u2 = gu[:, :40].contiguous(), gu[:, 40:].contiguous()  # contiguous: still one row a piece
    assert _same(norm_native.gelu_mul(g2, u2), whole) and _same(norm_native.gelu_mul(g2[3:9], u2[3:9]), whole[3:9])


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_and_two_threads_give_the_same_bits(dtype, threads, monkeypatch):
    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(300, 160, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(160, generator=g)
    outs = []
    for t, par in ((1, norm_native.PARALLEL_ELEMENTS), (2, 0), (2, norm_native.PARALLEL_ELEMENTS)):
        torch.set_num_threads(t)
        monkeypatch.setattr(norm_native, "PARALLEL_ELEMENTS", par)
        outs.append(norm_native.rms_norm(x, w, 1e-6, residual=r, pre_add=r))
    assert all(_same(o, outs[0]) for o in outs[1:])


def test_the_switch_keeps_the_torch_ops_and_the_bits(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(37, 160, generator=g), torch.randn(37, 160, generator=g)
    w = torch.randn(160, generator=g)
    gate = torch.randn(200, 160, generator=g)
    monkeypatch.setattr(norm_native, "FAST_TANH_DTYPES", ())  # torch's bits with the kernel on and off
    for mode in ("auto", "torch", "reference"):
        monkeypatch.setenv("DGEMMA_KERNELS", mode)
        assert norm_native.available() is (mode == "auto")
        assert _same(dispatch.rms_norm(x, w, 1e-6), F.rms_norm(x, (160,), w, 1e-6))
        assert _same(dispatch.rms_norm_add(x, w, 1e-6, residual=r), r + F.rms_norm(x, (160,), w, 1e-6))
        assert _same(dispatch.gelu_mul(gate, gate), F.gelu(gate, approximate="tanh") * gate)


def test_a_model_pass_is_the_same_with_and_without_the_kernels(monkeypatch):
    from dgcli.checkpoint.random_weights import make_config, random_model

    monkeypatch.setattr(norm_native, "GELU_MIN_ELEMENTS", 0)  # this pass's GELUs are small
    monkeypatch.setattr(norm_native, "GELU_DTYPES", tuple(DTYPES))
    monkeypatch.setattr(norm_native, "FAST_TANH_DTYPES", ())  # torch's bits (the fast fp32 tanh: parity tests)
    text = dict(vocab_size=96, hidden_size=160, intermediate_size=160, moe_intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1,
                head_dim=64, global_head_dim=64, num_experts=4, top_k_experts=2, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    g = torch.Generator().manual_seed(6)
    for dtype in DTYPES:
        m = random_model(make_config(text, canvas_length=8), seed=1, dtype=dtype)
        prompt, canvas = torch.randint(0, 96, (2, 9), generator=g), torch.randint(0, 96, (2, 8), generator=g)
        sc = torch.randn(2, 8, 96, generator=g)
        with torch.no_grad():
            got = m.forward_canvas(prompt, canvas, sc)
            monkeypatch.setenv("DGEMMA_KERNELS", "torch")
            want = m.forward_canvas(prompt, canvas, sc)
            monkeypatch.delenv("DGEMMA_KERNELS")
        assert _same(got, want), dtype


def test_loading_the_library_leaves_denormals_alone():
    """-ffast-math's startup code would set flush-to-zero for the whole process; the library is built without."""
    code = ("import torch; from dgcli.kernels import norm_native; assert norm_native._native() is not None; "
            "assert 5e-324 * 1.0 > 0 and (torch.tensor([1e-40]) * 1.0).item() > 0, 'denormals flushed'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
