"""kernels/nvfp4_triton.py (NVFP4 codes and e4m3 scales decoded per tile in registers, fp32 accumulation, one
rounding) against kernels/nvfp4.py's CPU reference: F.linear on the weights `decode` gives, compressed-tensors' values."""

import pytest
import torch

from dgcli.kernels import nvfp4 as k
from dgcli.model.nvfp4 import quantize_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("xshape, n, divide", [((3, 5, 64), 40, True), ((37, 96), 33, False), ((4, 160), 64, True)])
def test_triton_w4a16_linear_is_the_decoded_reference(dtype, xshape, n, divide, triton_device):
    """bf16 in the interpreter: bit-equal (the weights rounded to bf16 as `decode` rounds them, products of bf16
    values exact in fp32, the interpreter's dot sums K in order as torch's CPU GEMM does here); fp32, and bf16
    on a GPU (tensor cores sum in their own order): an fp32 result a few ulps off, a bf16 one a rounding step."""
    pytest.importorskip("triton")
    from dgcli.kernels.nvfp4_triton import linear_w4a16

    g = torch.Generator().manual_seed(n)
    x = torch.randn(xshape, generator=g).to(dtype)
    packed, scale, glob = quantize_rows(torch.randn(n, xshape[-1], generator=g) / 4)
    glob = glob * torch.linspace(0.5, 2, n)  # a different global per row (fused gate/up halves have two)
    want = torch.nn.functional.linear(x, k.decode(packed, scale, glob, divide, dtype))  # the CPU reference
    got = linear_w4a16(*(t.to(triton_device) for t in (x, packed, scale, glob)), divide, config=(16, 16, 16, 4, 1)).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16 and triton_device == "cpu":
        assert torch.equal(got, want)
    elif dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2**-7)
    else:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
