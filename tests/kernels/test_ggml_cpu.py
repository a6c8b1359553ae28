"""GGML compute on CPU (kernels/ggml_cpu.py): torch's int4 kernel as the Q4_K / Q4_0 / Q5_0 / Q8_0 path, the tile
path, and routed experts, against F.linear / experts_reference on the same dequantized weights."""

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import ggml_cpu
from dgcli.kernels.reference_ops import experts_reference
from dgcli.model import ggml

TYPES = [ggml.Q4_K, ggml.Q8_0, ggml.Q6_K, ggml.Q4_0, ggml.Q5_0]
# bf16 tolerance, relative to the output's largest magnitude: the reference (bf16 weights through oneDNN) and the
# kernel (bf16 scales and zeros, fp32 accumulation) each round differently; measured <= 4.1e-3 on these shapes
BF16_REL = 1e-2


def _weights(n, k, qtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = ggml.quantize(torch.randn(n, k, generator=g) * k ** -0.5, qtype)
    return raw, ggml.dequantize(raw, qtype, k)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_pack_is_torchs_int4_layout():
    q = torch.randint(0, 16, (128, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ggml_cpu._pack_int4(q), torch._convert_weight_to_int4pack_for_cpu(q.int(), 1))


def test_int4_kernel_semantics():
    """What the Q4_K mapping relies on: (q − 8)·scale + zero per group of 32 along K, fp32 accumulation."""
    g = torch.Generator().manual_seed(1)
    n, k = 64, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    sz = torch.randn(k // 32, n, 2, generator=g)
    x = torch.randn(3, k, generator=g)
    w = (q.float() - 8) * sz[..., 0].t().repeat_interleave(32, 1) + sz[..., 1].t().repeat_interleave(32, 1)
    got = torch._weight_int4pack_mm_for_cpu(x, ggml_cpu._pack_int4(q), 32, sz)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [128, 80])  # 80: rows padded to the kernel's 64-row blocks
def test_linear_matches_dequantized_weights(qtype, n):
    k = 512
    raw, w = _weights(n, k, qtype)
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(2))
    # fp32: the tile path, scales exact: F.linear on the same values (only the GEMM's summation order differs)
    fp32 = ggml.QuantLinear(raw, qtype, k, n, dtype=torch.float32)
    assert torch.equal(fp32.dequantized(), w)
    torch.testing.assert_close(fp32(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # bf16: the int4 kernel (Q6_K: bf16 tiles), against F.linear with the same weights in bf16
    bf16 = ggml.QuantLinear(raw, qtype, k, n)
    xb = x.bfloat16()
    y = bf16(xb)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, n)
    assert _rel(y, F.linear(xb.float(), w)) <= BF16_REL
    assert _rel(y, F.linear(xb, w.bfloat16())) <= BF16_REL
    # the kernel's weights are the file's with scales and zeros rounded to bf16: within 2^-8 of the row scale
    err = (bf16.dequantized() - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert err.max().item() <= 2 ** -7


def test_tile_path_covers_every_row(monkeypatch):
    monkeypatch.setattr(ggml_cpu, "TILE_VALUES", 64 * 256)  # several tiles here
    raw, w = _weights(200, 256, ggml.Q6_K)
    x = torch.randn(7, 256)
    torch.testing.assert_close(ggml.QuantLinear(raw, ggml.Q6_K, 256, 200, dtype=torch.float32)(x), F.linear(x, w),
                               rtol=1e-5, atol=1e-5)


def _experts(gt, dt, e=6, h=256, inter=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    gu = ggml.quantize(torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5, gt)
    dn = ggml.quantize(torch.randn(e, h, inter, generator=g) * inter ** -0.5, dt)
    return gu, dn, ggml.dequantize(gu, gt, h), ggml.dequantize(dn, dt, inter)


def _routing(n, k, e, seed=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return torch.rand(n, k, generator=g), idx


@pytest.mark.parametrize("types", [(ggml.Q4_K, ggml.Q6_K), (ggml.Q8_0, ggml.Q4_K), (ggml.Q4_K, ggml.Q5_0)])
def test_experts_match_reference(types):
    gt, dt = types
    gu, dn, wgu, wdn = _experts(gt, dt)
    w, idx = _routing(37, 2, 6)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(5))
    fp32 = ggml.QuantExperts(gu, gt, dn, dt, 256, 256, dtype=torch.float32)
    torch.testing.assert_close(fp32(x, w, idx), experts_reference(x, w, idx, wgu, wdn), rtol=1e-5, atol=1e-5)
    bf16 = ggml.QuantExperts(gu, gt, dn, dt, 256, 256)
    xb = x.bfloat16()
    y = bf16(xb, w, idx)
    assert y.dtype == torch.bfloat16
    assert _rel(y, experts_reference(xb, w, idx, wgu.bfloat16(), wdn.bfloat16())) <= 2 * BF16_REL


def test_only_routed_experts_are_read():
    """Poison every expert no token routes to: the output stays finite and unchanged."""
    gu, dn, _, _ = _experts(ggml.Q4_K, ggml.Q4_K)
    m = ggml.QuantExperts(gu, ggml.Q4_K, dn, ggml.Q4_K, 256, 256)
    x = torch.randn(9, 256).bfloat16()
    w, idx = _routing(9, 2, 3)  # experts 0..2 only
    before = m(x, w, idx)
    m.gate_up_sz[3:] = float("nan")
    m.down_sz[3:] = float("nan")
    assert torch.equal(m(x, w, idx), before)
    assert m(x[:0], w[:0], idx[:0]).shape == (0, 256)


def test_prepared_bytes_is_what_prepare_holds():
    for qtype in TYPES:
        raw, _ = _weights(80, 512, qtype)
        p = ggml_cpu.prepare(raw, qtype, 512)
        assert p.nbytes() == ggml_cpu.prepared_bytes(qtype, 80, 512)
