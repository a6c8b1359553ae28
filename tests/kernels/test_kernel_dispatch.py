"""kernels/dispatch.py picks the CPU fast paths on CPU, the references under DGEMMA_KERNELS=reference, and
rejects unknown modes; its results equal what the chosen implementation returns."""

from __future__ import annotations

import pytest
import torch

from dgcli.kernels import dispatch, reference, reference_ops
from dgcli.kernels.vocab_pass_cpu import vocab_pass_tiled


def unif(hidden, seed):
    """One uniform per position [B, C] (what the sampler's counter stream hands a vocabulary pass)."""
    return torch.rand(hidden.shape[:2], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_cpu_defaults(monkeypatch):
    monkeypatch.delenv("DGEMMA_KERNELS", raising=False)
    assert dispatch.implementation("vocab_pass", "cpu") == "cpu"
    assert dispatch.implementation("experts", "cpu") == "cpu"
    assert dispatch.implementation("rms_norm", "cpu") == "cpu"


def test_reference_forced(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    for op in ("vocab_pass", "experts", "rms_norm"):
        assert dispatch.implementation(op, "cpu") == "reference"
        assert dispatch.implementation(op, "cuda") == "reference"


def test_torch_mode_keeps_the_fast_paths_but_names_no_c_kernel(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    assert dispatch.implementation("experts", "cpu") == "cpu"
    prov = dispatch.provenance("cpu", "float32")
    assert prov == {"vocab_pass": "tiled, torch-ops", "experts": "torch.grouped_mm", "rms_norm": "torch.rms_norm",
                    "gelu_mul": "torch-ops", "linear": "torch.linear"}
    assert dispatch.provenance("cpu", "bfloat16", packed=True)["experts"] == "onednn-packed"
    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    assert set(dispatch.provenance("cpu", "float32").values()) == {"reference", "torch.linear"}


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "fastest")
    with pytest.raises(ValueError, match="DGEMMA_KERNELS"):
        dispatch.implementation("experts", "cpu")


@pytest.mark.parametrize("forced", [False, True])
def test_calls_route_to_the_chosen_implementation(monkeypatch, forced):
    if forced:
        monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    else:
        monkeypatch.delenv("DGEMMA_KERNELS", raising=False)
    g = torch.Generator().manual_seed(0)
    hidden, embed = torch.randn(1, 5, 8, generator=g), torch.randn(29, 8, generator=g)
    kw = dict(softcap=30.0, temperature=0.7, embed_scale=2.0, want_soft=True)
    got = dispatch.vocab_pass(hidden, embed, uniform=unif(hidden, 3), **kw)
    fn = reference.vocab_pass if forced else vocab_pass_tiled
    want = fn(hidden, embed, uniform=unif(hidden, 3), **kw)
    assert torch.equal(got.sample, want.sample) and torch.equal(got.soft, want.soft)

    x = torch.randn(6, 8, generator=g)
    w, idx = torch.rand(6, 2, generator=g), torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    gu, dn = torch.randn(4, 10, 8, generator=g), torch.randn(4, 8, 5, generator=g)
    want = reference_ops.experts_reference(x, w, idx, gu, dn)
    got = dispatch.experts(x, w, idx, gu, dn)
    assert torch.equal(got, want) if forced else torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(dispatch.rms_norm(x, None, 1e-6), reference_ops.rms_norm_reference(x, None, 1e-6))


def test_kernels_package_is_this_repository():
    import pathlib

    import dgcli.kernels

    assert pathlib.Path(dgcli.kernels.__file__).resolve().parent == pathlib.Path(dispatch.__file__).resolve().parent
    assert (pathlib.Path(dispatch.__file__).parent / "reference.py").exists()


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_rms_norm_is_the_reference_bit_for_bit(dtype, kernels, monkeypatch):
    """The 'cpu' implementation (torch's CPU rms_norm) against the reference's formula: widths of the real and tiny configs, odd ones, 1 to 300 rows, 3-D
    and strided inputs, large and tiny magnitudes, with and without a weight, several eps."""
    monkeypatch.setenv("DGEMMA_KERNELS", kernels)
    g = torch.Generator().manual_seed(0)
    for width in (80, 160, 256, 512, 2816, 7, 33):
        for rows in (1, 16, 300):
            for scale, eps in ((1.0, 1e-6), (300.0, 1e-6), (1e-3, 1e-5)):
                x = (torch.randn(rows, width, generator=g) * scale).to(dtype)
                w = torch.randn(width, generator=g).to(dtype)
                for weight in (w, None):
                    got = dispatch.rms_norm(x, weight, eps)
                    assert torch.equal(got, reference_ops.rms_norm_reference(x, weight, eps)), (width, rows, scale)
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    for t in (x, x.transpose(0, 1), x[:, ::2]):
        assert torch.equal(dispatch.rms_norm(t, None, 1e-6), reference_ops.rms_norm_reference(t, None, 1e-6))
