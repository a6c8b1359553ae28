"""kernels/fused.py's rms_norm (Triton: compiled on a GPU, interpreted on CPU without one) against
kernels/reference_ops.py, which is itself checked against the model's RMSNorm."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from dgcli.kernels.reference_ops import rms_norm_reference
from dgcli.model.gemma import RMSNorm

pytestmark = pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed (Linux x86-64 only)")

# (dtype, atol, rtol): fp32 differs from the reference only by rsqrt vs pow(-0.5) and the reduction
# order (a few ulps); bf16 outputs are the same fp32 values rounded once, so at most 1 bf16 ulp apart.
TOLS = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 2**-7)]
# Rows × width: a power of two, an odd width (masked lanes), one row, a 3-D input; the released config's hidden
# size and its sliding and full heads' q/k norms (H 2816 in a 4,096 block: the one masked block of the real model).
SHAPES = [(4, 64), (3, 37), (1, 5), (2, 3, 24), (3, 2816), (2, 4, 256), (2, 2, 512)]


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    return x.to(device), w.to(device), r.to(device)


def test_reference_equals_the_model_norm():
    x, w, _ = _inputs((3, 16), torch.bfloat16)
    norm = RMSNorm(16, 1e-6).to(torch.bfloat16)
    norm.weight.data.copy_(w.cpu())
    assert torch.equal(rms_norm_reference(x.cpu(), w.cpu(), 1e-6), norm(x.cpu()))
    assert torch.equal(rms_norm_reference(x.cpu(), None, 1e-6), RMSNorm(16, 1e-6, with_scale=False)(x.cpu()))


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gain", [True, False])
def test_rms_norm_matches_reference(dtype, atol, rtol, shape, gain, triton_device):
    from dgcli.kernels.fused import rms_norm

    x, w, _ = _inputs(shape, dtype, triton_device)
    weight = w if gain else None
    got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and got.device == x.device
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-6), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("shape", [(3, 37), (2, 3, 24), (3, 2816)])
@pytest.mark.parametrize("pre", [True, False])
def test_rms_norm_with_its_adds_matches_reference(dtype, atol, rtol, shape, pre, triton_device):
    """residual + Norm(x + pre_add) in one launch: the reference's three ops, each add rounded to the dtype (a
    one-ulp difference of the norm can move the sum by one ulp of the sum: within the bf16 tolerance)."""
    from dgcli.kernels.fused import rms_norm

    x, w, r = _inputs(shape, dtype, triton_device)
    p = _inputs(shape, dtype, triton_device, seed=1)[2] if pre else None
    want = r + rms_norm_reference(x + p if pre else x, w, 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, r, p), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_its_adds_and_scale_matches_reference(dtype, atol, rtol, scale_dtype, triton_device):
    """(residual + Norm(x + pre_add)) · layer scalar in one launch: the in-place product rounds once more."""
    from dgcli.kernels.fused import rms_norm

    x, w, r = _inputs((3, 2816), dtype, triton_device)
    p = _inputs((3, 2816), dtype, triton_device, seed=1)[2]
    s = torch.tensor([0.37], dtype=scale_dtype, device=triton_device)
    want = (r + rms_norm_reference(x + p, w, 1e-6)).mul_(s)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, r, p, s), want, atol=atol, rtol=rtol)
