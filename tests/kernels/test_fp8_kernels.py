"""FP8 ops: the per-token activation quantizer and the dynamic-activation matmuls against a float64 computation
of the same math; the FP8 Triton expert kernels (compiled on a GPU, else interpreted on CPU) against the torch
references."""

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import dispatch
from dgcli.kernels.fp8 import (FP8, FP8_MAX, MIN_SCALE, dequantize, experts_fp8_reference, experts_fp8_segments,
                               linear_dynamic, linear_weight_only, quantize_per_token)
from dgcli.kernels.reference_ops import experts_reference

E4M3_STEP = 2.0 ** -3  # relative spacing of e4m3 values (3 mantissa bits)


def quantize_rows(w):
    s = w.abs().amax(-1, keepdim=True) / FP8_MAX
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def activations(shape, seed, dtype=torch.bfloat16, outlier=3000.0):
    g = torch.Generator().manual_seed(seed)
    rows = shape[:-1].numel() if isinstance(shape, torch.Size) else torch.Size(shape[:-1]).numel()
    x = torch.randn(rows, shape[-1], generator=g) * torch.rand(rows, 1, generator=g).mul(8)  # rows of unequal range
    x[1] = 0  # an all-zero token
    x[2, 3] = outlier  # its row's scale is set by it
    return x.reshape(shape).to(dtype)


def test_per_token_quantizer_is_the_float64_math():
    """scale = max(absmax / 448, 1/(448·512)) and q = e4m3(x / scale): the fp32 scale is the correctly rounded
    float64 one (absmax and 448 are exact), and the quotients round to the same e4m3 values."""
    x = activations((64, 96), 0)
    q, s = quantize_per_token(x)
    x64 = x.double()
    s64 = (x64.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    assert s.dtype == torch.float32 and torch.equal(s, s64.float())
    assert s[1].item() == pytest.approx(MIN_SCALE) and (q[1].float() == 0).all()
    want = (x64 / s.double()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().amax(-1)[[0, 2, 5]].eq(FP8_MAX).all()  # each nonzero row reaches +-448
    # round-trip error: at most half an e4m3 step of each value (relative), below the subnormals
    back = q.float() * s
    big = x.float().abs() > 2 ** -6 * s
    assert ((back - x.float()).abs()[big] <= 0.5 * E4M3_STEP * x.float().abs()[big] * 1.0001).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dynamic_linear_is_the_float64_math(dtype):
    """y = ((x_q · q^T) · s_x) · s_w in fp32, rounded to dtype, against the same quantized operands multiplied
    in float64. Tolerance: the fp32 accumulation (K products, each exact) is within K·2^-24 of the sum of
    |products| (times the scales), plus one rounding to dtype (2^-8 relative for bf16, 2^-24 for fp32)."""
    x = activations((2, 7, 96), 1, dtype)
    g = torch.Generator().manual_seed(2)
    q, s = quantize_rows((torch.randn(40, 96, generator=g) / 10).to(dtype))
    y = linear_dynamic(x, q, s, tile_bytes=2048)  # several row tiles
    assert y.dtype == dtype and y.shape == (2, 7, 40)
    xq, xs = quantize_per_token(x.reshape(-1, 96))
    prod = xq.double() @ q.double().t()
    y64 = prod * xs.double() * s.double().t()
    bound = 96 * 2 ** -24 * (xq.double().abs() @ q.double().abs().t()) * xs.double() * s.double().abs().t()
    rel = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -24
    for got in (y, linear_dynamic(x, q, s)):  # row tiles, or the whole matrix (fp32: another summation order)
        assert ((got.reshape(-1, 40).double() - y64).abs() <= bound + rel * y64.abs() * 1.0001).all()


def every_e4m3_tie():
    """Each finite e4m3 value, each midpoint between neighbours (a tie) and the fp32 values either side of it."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    vals = codes.view(FP8).float().unique()  # sorted; +-0 once
    mids = (vals[1:] + vals[:-1]) / 2
    return torch.cat([vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantizer_kernel_is_the_per_token_quantizer_bit_for_bit(dtype, triton_device):
    """kernels/fp8_linear.py::quantize_rows (one launch: absmax, the scale by IEEE division, e4m3 rounding on
    the bits) against `quantize_per_token`: rows of unequal range, an all-zero row, an outlier, a row wider
    than one block (5,000), and a row holding every e4m3 tie at scale 1 (448 its absmax)."""
    pytest.importorskip("triton")
    from dgcli.kernels.fp8_linear import quantize_rows as quantize_kernel

    ties = every_e4m3_tie()
    cases = [activations((2, 3, 96), 8, dtype), activations((4, 5000), 9, dtype), ties[None].to(dtype)]
    for x in cases:
        q, s = quantize_kernel(x.to(triton_device))
        want_q, want_s = quantize_per_token(x)
        assert q.dtype == FP8 and q.shape == x.shape and s.shape == (*x.shape[:-1], 1)
        assert torch.equal(s.cpu(), want_s) and torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert ties.abs().max() == FP8_MAX and ties.numel() > 900  # scale 1: every tie reaches the rounding


def test_dynamic_linear_on_the_quantizer_kernel_and_scaled_mm(triton_device):
    """The CUDA dynamic path (dispatch: the quantizer op, then torch._scaled_mm) against the torch reference:
    the same quantized operands, so within the fp32 accumulation's bound (K·2^-24 of sum |products|) and
    one bf16 rounding of each output."""
    pytest.importorskip("triton")
    x = activations((3, 5, 96), 10)
    g = torch.Generator().manual_seed(11)
    q, s = quantize_rows((torch.randn(48, 96, generator=g) / 10).bfloat16())
    got = linear_dynamic(x.to(triton_device), q.to(triton_device), s.to(triton_device), scaled_mm=True,
                         quantize=torch.ops.dgemma.fp8_quantize).cpu()
    want = linear_dynamic(x, q, s)
    xq, xs = quantize_per_token(x.reshape(-1, 96))
    big = ((xq.double().abs() @ q.double().abs().t()) * xs.double() * s.double().abs().t()).reshape(want.shape)
    bound = 2 * 96 * 2**-24 * big + 2**-8 * (got.double().abs() + want.double().abs())
    assert got.dtype == torch.bfloat16 and ((got.double() - want.double()).abs() <= bound).all()


def test_dynamic_against_weight_only_moves_by_the_activation_rounding(triton_device):
    """What the CUDA dynamic path (quantizer op, torch._scaled_mm) changes against the CUDA weight-only one
    (kernels/fp8_linear.py::linear_w8a16), both on exact weights q·s: each activation rounded to e4m3 at its
    token's scale, within 2^-4 of itself (or 2^-10 of the scale for values below 2^-6 of it). Bound: that
    error times |q·s| summed, the fp32 accumulations (K·2^-24 each) and each output's bf16 rounding; the bits
    do change."""
    pytest.importorskip("triton")
    from dgcli.kernels.fp8_linear import linear_w8a16

    x = activations((6, 128), 12)
    g = torch.Generator().manual_seed(13)
    q, s = quantize_rows((torch.randn(40, 128, generator=g) / 10).bfloat16())
    on = [t.to(triton_device) for t in (x, q, s)]
    dyn = linear_dynamic(*on, scaled_mm=True, quantize=torch.ops.dgemma.fp8_quantize).cpu().double()
    wo = linear_w8a16(*on).cpu().double()
    _, xs = quantize_per_token(x)
    w64 = (q.double() * s.double()).abs().t()  # [K, N]
    bound = ((2**-4 + 2 * 128 * 2**-24) * x.double().abs() + 2**-10 * xs.double()) @ w64 + 2**-8 * (
        dyn.abs() + wo.abs())
    assert ((dyn - wo).abs() <= bound).all()
    assert not torch.equal(dyn, wo)


def test_weight_only_linear_is_f_linear_on_the_dequantized_weight():
    x = activations((3, 5, 64), 3)
    q, s = quantize_rows(torch.randn(48, 64, generator=torch.Generator().manual_seed(4)).bfloat16())
    want = F.linear(x, dequantize(q, s, torch.bfloat16))
    assert torch.equal(linear_weight_only(x, q, s, tile_bytes=None), want)
    assert torch.equal(linear_weight_only(x, q, s, tile_bytes=1024), want)  # 8-row tiles


# (input [..., K], N): rows, columns and K not multiples of the 16-wide blocks, a 3-D input, rows with an
# outlier and all zeros (`activations`).
# x shape, output width: odd and tiny shapes; the released config's K (H 2816 into q: 44 K tiles; 16 heads x 256
# into o: 64), output widths cut to keep the interpreter quick (the N tiles are independent).
W8A16_SHAPES = [((3, 5, 72), 40), ((3, 48), 33), ((37, 64), 64), ((4, 2816), 96), ((4, 4096), 80)]


def within_the_weight_rounding(got, want, x, q, s, bf16_weights):
    """|got - want| <= u_w·S + 2K·2^-24·S + rel·(|got| + |want|), S = sum_k |x_k·q_k·s| in float64: u_w the
    reference's rounding of each weight q·s (2^-8 to bf16, 2^-24 to fp32) that the kernel does not make, the
    fp32 accumulation (K terms) on both sides, and each side's one rounding to its dtype (rel)."""
    k = x.shape[-1]
    w64 = q.double() * s.double()  # [N, K] exact
    big = (x.reshape(-1, k).double().abs() @ w64.abs().t()).reshape(*x.shape[:-1], -1)
    rel = 2**-8 if got.dtype == torch.bfloat16 else 2**-24
    u_w = 2**-8 if bf16_weights else 2**-24
    bound = (u_w + 2 * k * 2**-24) * big + rel * (got.double().abs() + want.double().abs())
    assert ((got.double() - want.double()).abs() <= bound).all(), ((got.double() - want.double()).abs() - bound).max()


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("xshape, n", W8A16_SHAPES)
def test_triton_w8a16_linear_is_the_weight_only_reference_within_its_bound(dtype, scale_dtype, xshape, n,
                                                                           triton_device):
    """kernels/fp8_linear.py (e4m3 bytes as exact bf16 values / 256, fp32 accumulation, scale x 256 on the
    accumulator, one rounding) against F.linear on the whole dequantized weight, whose weights are q·s rounded
    (to bf16 for bf16 activations or scales): within `within_the_weight_rounding`'s bound, on every tile; and
    the bits do change where the reference's weight rounding is not exact."""
    pytest.importorskip("triton")
    from dgcli.kernels.fp8_linear import linear_w8a16

    g = torch.Generator().manual_seed(n)
    x = activations(xshape, 5, dtype, outlier=30.0)
    q, s = quantize_rows((torch.randn(n, xshape[-1], generator=g) / 4).to(scale_dtype))
    want = linear_weight_only(x, q, s, tile_bytes=None)
    bf16_weights = torch.bfloat16 in (dtype, scale_dtype)
    for config in ((16, 16, 16, 4, 1), None):  # a small tile (several of every block), and the CUDA default
        got = linear_w8a16(x.to(triton_device), q.to(triton_device), s.to(triton_device), config=config).cpu()
        assert got.dtype == dtype and got.shape == want.shape
        within_the_weight_rounding(got, want, x, q, s, bf16_weights)
    if bf16_weights and xshape[-1] >= 64:
        assert not torch.equal(got, want)


def test_the_w8a16_decode_covers_every_e4m3_value(triton_device):
    """All 254 finite e4m3 bytes (NaN 0x7F / 0xFF excluded) through the kernel as a weight column each:
    x = 1 picks the decoded values out exactly (scale 1, fp32)."""
    pytest.importorskip("triton")
    from dgcli.kernels.fp8_linear import linear_w8a16

    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.view(FP8)[:, None].repeat(1, 16)  # [254, 16]: each row one value
    x = torch.zeros(1, 16)
    x[0, 3] = 1.0
    got = linear_w8a16(x.to(triton_device), q.to(triton_device), torch.ones(254, 1).to(triton_device),
                       config=(16, 16, 16, 4, 1)).cpu()
    assert torch.equal(got[0], q[:, 0].float())


def experts_case(dtype, scale_dtype, n=20, h=32, inter=16, e=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = activations((n, h), seed, dtype, outlier=30.0)
    guq, gus = quantize_rows((torch.randn(e, 2 * inter, h, generator=g) / 5).to(scale_dtype))
    dnq, dns = quantize_rows((torch.randn(e, h, inter, generator=g) / 4).to(scale_dtype))
    w, idx = torch.softmax(torch.randn(n, e, generator=g), -1).topk(k, -1)
    return x, w, idx, guq, gus, dnq, dns


CASES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
         (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype, scale_dtype", CASES)
def test_weight_only_experts_are_the_dequantized_experts(dtype, scale_dtype):
    x, w, idx, guq, gus, dnq, dns = experts_case(dtype, scale_dtype)
    want = experts_reference(x, w, idx, dequantize(guq, gus, dtype), dequantize(dnq, dns, dtype))
    assert torch.equal(experts_fp8_reference(x, w, idx, guq, gus, dnq, dns), want)
    for chunk in (None, 1):  # every expert at once, or one expert per chunk
        assert torch.equal(experts_fp8_segments(x, w, idx, guq, gus, dnq, dns, chunk_bytes=chunk), want)


def test_dynamic_experts_are_the_float64_math():
    """fp32 activations: each expert's two FP8 GEMMs against float64 products of the same quantized operands
    (tokens quantized once, the intermediate per row). fp32 rounding differs from float64 by 2^-24 relative;
    it could flip an intermediate's e4m3 rounding only within 2^-24 of a tie (none with this seed), so the
    outputs agree to fp32 accumulation noise."""
    x, w, idx, guq, gus, dnq, dns = experts_case(torch.float32, torch.float32, seed=5)
    got = experts_fp8_reference(x, w, idx, guq, gus, dnq, dns, dynamic=True)
    xq, xs = quantize_per_token(x)
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in sorted(range(idx.shape[1]), key=lambda j: idx[t, j].item()):
            e = idx[t, j].item()
            gu = (xq[t].double() @ guq[e].double().t()) * xs[t].double() * gus[e].double().t().squeeze(0)
            gate, up = gu.chunk(2)
            act = F.gelu(gate, approximate="tanh") * up
            aq, a_s = quantize_per_token(act.float())  # the same quantizer (tested above against float64)
            y = (aq.double() @ dnq[e].double().t()) * a_s.double() * dns[e].double().t().squeeze(0)
            want[t] += y * w[t, j].double()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


# The kernel's GELU computes tanh(y) as 1 - 2/(exp(2y) + 1): exp overflows to inf for gate values past ~9
# (tanh = 1 exactly, as intended), which the interpreter's numpy reports.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dtype, scale_dtype", CASES)
def test_triton_fp8_experts_match_the_references(dtype, scale_dtype, dynamic, triton_device):
    """The Triton kernels against the torch references. Dynamic (e4m3 x e4m3 dots on tokens quantized by the
    one-launch quantizer, bit for bit the reference's): bf16 bit-equal in the interpreter (same roundings, fp32
    accumulation of exact products); on a GPU the dots sum in their own order (a GEMM output 1 bf16 ulp off).
    Weight-only (e4m3 decoded exactly, the channel scale on the accumulator): the reference rounds each weight
    q·s to bf16 when the activations or scales are bf16, so the GEMM outputs move by up to 2^-8 of their
    sum |x·w|; through the GELU product and the down GEMM that is within 2^-5 of the largest output (measured
    2^-6.4). fp32 throughout: the accumulation order and the fp32 rounding of q·s (measured <= 8e-7 of outputs ~2)."""
    pytest.importorskip("triton")
    if triton_device == "cuda" and torch.cuda.get_device_capability() < ((8, 9) if dynamic else (8, 0)):
        pytest.skip("below SM 8.9 (dynamic) or 8.0 (weight-only) dispatch runs the torch reference")
    from dgcli.kernels.moe import experts_triton

    x, w, idx, guq, gus, dnq, dns = experts_case(dtype, scale_dtype, n=24, seed=7)
    want = experts_fp8_reference(x, w, idx, guq, gus, dnq, dns, dynamic=dynamic)
    on = [t.to(triton_device) for t in (x, w, idx, guq, dnq, gus, dns)]
    # compiled, an e4m3 x e4m3 tl.dot needs K >= 32 (the launch default is 64); the interpreter takes 16
    block_k = 32 if dynamic and triton_device == "cuda" else 16
    got = experts_triton(*on[:5], gate_up_scale=on[5], down_scale=on[6], dynamic=dynamic,
                         block_m=16, block_n=16, block_k=block_k).cpu()
    if not dynamic and torch.bfloat16 in (dtype, scale_dtype):
        assert (got.float() - want.float()).abs().max() <= 2**-5 * want.float().abs().max()
    elif dtype == torch.bfloat16 and triton_device == "cpu":
        assert torch.equal(got, want)
    elif dtype == torch.bfloat16:  # tensor-core dots sum in their own order: a GEMM output may round 1 bf16 ulp off
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2**-7)
    else:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_triton_fp8_weight_only_experts_keep_their_bits_under_every_tuned_tile(scale_dtype, triton_device):
    """bf16 activations on FP8 experts take the tuned path on CUDA (kernels/moe.py::TUNE): every configuration
    gives the fixed tile's output bit for bit, and that is the weight-only reference within the bound of
    test_triton_fp8_experts_match_the_references."""
    pytest.importorskip("triton")
    if triton_device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("weight-only FP8 experts run on Triton from SM 8.0 (dispatch runs the torch reference below)")
    from dgcli.kernels.moe import BLOCK, TUNE, experts_triton

    x, w, idx, guq, gus, dnq, dns = experts_case(torch.bfloat16, scale_dtype, n=40, h=80, inter=48, seed=3)
    on = [t.to(triton_device) for t in (x, w, idx, guq, dnq)]
    kw = dict(gate_up_scale=gus.to(triton_device), down_scale=dns.to(triton_device))
    want = experts_triton(*on, block_m=BLOCK, **kw)
    ref = experts_fp8_reference(x, w, idx, guq, gus, dnq, dns).float()
    assert (want.cpu().float() - ref).abs().max() <= 2**-5 * ref.abs().max()
    for bm, tiles in TUNE.items():
        for bn, warps, stages in tiles:
            got = experts_triton(*on, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, **kw)
            assert torch.equal(got, want), (bm, bn, warps, stages)


def test_fp8_semantics_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("DGEMMA_FP8", raising=False)
    assert dispatch.fp8_semantics() == "weight-only"
    monkeypatch.setenv("DGEMMA_FP8", "Dynamic")
    assert dispatch.fp8_semantics() == "dynamic"
    monkeypatch.setenv("DGEMMA_FP8", "fp4")
    with pytest.raises(ValueError, match="DGEMMA_FP8"):
        dispatch.fp8_semantics()
    monkeypatch.delenv("DGEMMA_FP8")
    assert dispatch.implementation("fp8_linear", "cpu") == "cpu"
    # CUDA: weight-only through the W8A16 kernel, dynamic through torch._scaled_mm (both decided in fp8_linear)
    assert dispatch.implementation("fp8_linear", "cuda") == ("triton" if dispatch._triton_ok() else "cuda")
    assert dispatch.implementation("fp8_experts", "cpu") == "cpu"
