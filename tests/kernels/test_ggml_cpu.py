"""GGML compute on CPU (kernels/ggml_cpu.py): torch's int4 kernel as the Q4_K / Q4_0 path, the tile path (and Q5_0 /
Q8_0 / Q6_K's), and routed experts, against F.linear / experts_reference on the same dequantized weights."""

import threading

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import ggml_cpu
from dgcli.kernels.reference_ops import experts_reference
from dgcli.checkpoint import ggml_quants
from dgcli.model import ggml

TYPES = [ggml.Q4_K, ggml.Q8_0, ggml.Q6_K, ggml.Q4_0, ggml.Q5_0]
# bf16 tolerance, relative to the output's largest magnitude: the reference (bf16 weights through oneDNN) and the
# kernel (bf16 scales and zeros, fp32 accumulation) each round differently; measured <= 4.1e-3 on these shapes
BF16_REL = 1e-2


@pytest.fixture(autouse=True)
def _bf16_paths(monkeypatch):
    """These tests cover the torch paths (their bits and bounds): the C int8 one (kernels/ggml_q8.py, tested in
    test_ggml_q8.py) off, as DGEMMA_KERNELS=torch has it."""
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")


def _weights(n, k, qtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = ggml_quants.quantize(torch.randn(n, k, generator=g) * k ** -0.5, qtype)
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


def test_a_matrix_of_several_tiles_is_covered_to_its_last_row():
    """The tile path (fp32 x) dequantizes ~1 MB of rows at a time: a matrix of 1,100 x 256 Q6_K values spans two
    tiles, the second ragged; every output column is the dequantized weights' product."""
    raw, w = _weights(1100, 256, ggml.Q6_K)
    x = torch.randn(7, 256)
    torch.testing.assert_close(ggml.QuantLinear(raw, ggml.Q6_K, 256, 1100, dtype=torch.float32)(x), F.linear(x, w),
                               rtol=1e-5, atol=1e-5)


def _experts(gt, dt, e=6, h=256, inter=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    gu = ggml_quants.quantize(torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5, gt)
    dn = ggml_quants.quantize(torch.randn(e, h, inter, generator=g) * inter ** -0.5, dt)
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


@pytest.mark.parametrize("tokens", [9, 150])  # few rows an expert, and more than the GEMM path's threshold
def test_only_routed_experts_are_read(tokens):
    """Poison every expert no token routes to: the output stays finite and unchanged, at any row count."""
    gu, dn, _, _ = _experts(ggml.Q4_K, ggml.Q4_K)
    m = ggml.QuantExperts(gu, ggml.Q4_K, dn, ggml.Q4_K, 256, 256)
    x = torch.randn(tokens, 256).bfloat16()
    w, idx = _routing(tokens, 2, 3)  # experts 0..2 only
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


# ---- many rows: the GEMM path (bf16 tiles of W.T + oneDNN) --------------------------------------------------------

INT4_TYPES = [ggml.Q4_K, ggml.Q4_0]


@pytest.mark.parametrize("qtype", INT4_TYPES)
@pytest.mark.parametrize("n", [192, 80])  # 80: the last row block is padding past row 80
def test_gemm_tiles_are_the_kernels_weights_rounded_once(qtype, n):
    """Each bf16 weight of a tile is the kernel's exact weight ((q − 8)·scale + zero in fp32) rounded once."""
    k = 512
    p = ggml_cpu.prepare(_weights(n, k, qtype)[0], qtype, k)
    exact = ggml_cpu.dequantize_prepared(p)  # fp32 [n, k]
    tiles = [ggml_cpu._int4_tile_t(p, b, b + 1, torch.bfloat16).clone() for b in range(p.packed.shape[0] // 64)]
    got = torch.cat(tiles, dim=1)  # W.T [k, Np]
    assert torch.equal(got[:, :n].t(), exact.bfloat16())
    assert not got[:, n:].any()  # padding rows: weight 0


@pytest.mark.parametrize("qtype", TYPES)
def test_linear_is_right_at_every_row_count(qtype):
    """One row to a few hundred (the paths change with the row count): bf16 output within the bound, every time."""
    k, n = 256, 80
    raw, w = _weights(n, k, qtype)
    m = ggml.QuantLinear(raw, qtype, k, n)
    g = torch.Generator().manual_seed(6)
    for rows in (1, 7, 31, 32, 63, 64, 65, 200):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = m(x)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        assert _rel(y, F.linear(x.float(), w)) <= BF16_REL, rows


def test_a_matrix_of_several_gemm_tiles_is_covered_to_its_last_row():
    """Many rows of x go through bf16 tiles of ~4 M weight values: 8,200 x 512 values are three tiles, the last
    ragged and padded; every output column, the last ones included, is the weights' product."""
    n, k = 8200, 512
    m = ggml.QuantLinear(ggml_quants.random_blocks((n,), ggml.Q4_K, k, torch.Generator().manual_seed(7)),
                         ggml.Q4_K, k, n)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    y, want = m(x), F.linear(x, m.dequantized().bfloat16())
    assert y.shape == (70, n)
    assert _rel(y, want) <= BF16_REL and _rel(y[:, -100:], want[:, -100:]) <= BF16_REL


@pytest.mark.parametrize("qtype", INT4_TYPES)
def test_gemm_path_error_against_the_files_weights(qtype):
    """Output error against the file's exact weights (ggml.dequantize, fp32 matmul): the GEMM path adds one bf16
    rounding per weight to the kernel's scale/zero rounding; bounded by both errors together (relative RMS)."""
    k, n = 1024, 128
    raw, w = _weights(n, k, qtype, seed=8)
    p = ggml_cpu.prepare(raw, qtype, k)
    g = torch.Generator().manual_seed(9)
    for mean in (0.0, 1.0):
        x = (torch.randn(64, k, generator=g) + mean).bfloat16()
        exact = F.linear(x.float(), w)

        def rms(y):
            return ((y.float() - exact).norm() / exact.norm()).item()

        kernel, gemm = rms(ggml_cpu._kernel_int4(x, p)), rms(ggml_cpu._gemm_int4(x, p))
        bf16_weights = rms(F.linear(x, w.bfloat16()))  # a bf16 checkpoint of the exact weights
        assert gemm <= 1.1 * (kernel ** 2 + bf16_weights ** 2) ** 0.5, (kernel, gemm, bf16_weights)
        assert gemm <= 6e-3


@pytest.mark.parametrize("types", [(ggml.Q4_K, ggml.Q4_0), (ggml.Q8_0, ggml.Q5_0)])
def test_experts_with_many_and_few_rows_match_reference(types):
    """Experts 0 and 1 get 200 rows each (the GEMM path's row counts), the others 20 and 10: each within the bound."""
    gt, dt = types
    gu, dn, wgu, wdn = _experts(gt, dt)
    idx = torch.tensor([[0, 1]] * 200 + [[2, 3]] * 20 + [[4, 5]] * 10)
    w = torch.rand(len(idx), 2, generator=torch.Generator().manual_seed(4))
    x = torch.randn(len(idx), 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    m = ggml.QuantExperts(gu, gt, dn, dt, 256, 256)
    gq, dq = m.dequantized()
    y = m(x, w, idx)
    assert y.dtype == torch.bfloat16
    assert _rel(y, experts_reference(x, w, idx, gq.bfloat16(), dq.bfloat16())) <= BF16_REL
    assert _rel(y, experts_reference(x, w, idx, wgu.bfloat16(), wdn.bfloat16())) <= 2 * BF16_REL


def test_held_form_follows_the_buffers():
    """`_held` keeps a module's prepared matrix between calls, and builds it again over buffers .to() or a load put."""
    m = ggml.QuantLinear(_weights(64, 256, ggml.Q4_K)[0], ggml.Q4_K, 256, 64)
    p = ggml._held(m, "weight")
    assert ggml._held(m, "weight") is p and not m.float()._prepared and ggml._held(m, "weight").sz is m.weight_sz
    m.load_state_dict({"weight_packed": p.packed.clone(), "weight_sz": p.sz}, assign=True)
    assert ggml._held(m, "weight").packed is m.weight_packed and ggml._held(m, "weight").sz.dtype == torch.bfloat16


def test_a_first_call_in_inference_mode_does_not_break_later_calls_outside_it():
    """Scratch buffers are made by whichever call of a thread comes first: one inside a model's inference-mode pass
    must not leave an inference tensor that a later call outside inference mode cannot write (a fresh thread, so
    that this test's first call is the thread's first)."""
    w = torch.randn(128, 256)
    lin = ggml.QuantLinear(ggml_quants.quantize(w, ggml.Q4_K), ggml.Q4_K, 256, 128)
    x = torch.randn(70, 256).bfloat16()  # many rows: the path with scratch tiles
    out = {}

    def run():
        with torch.inference_mode():
            out["first"] = lin(x)
        out["second"] = lin(x)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert torch.equal(out["second"], out["first"])


@pytest.mark.parametrize("n", [1, 5, 40])
def test_experts_give_the_per_expert_loops_bits(n):
    """experts() gathers, gates and scatters all routed rows at once; each token's output is still the loop's: one
    GEMM pair per expert, the weighted result rounded to x's dtype and added in ascending expert order."""
    h, inter, e, k = 256, 96, 8, 3
    g = torch.Generator().manual_seed(n)
    gu = ggml_cpu.prepare(ggml_quants.random_blocks((e, 2 * inter), ggml.Q4_K, h, g), ggml.Q4_K, h)
    dn = ggml_cpu.prepare(ggml_quants.random_blocks((e, h), ggml.Q4_0, inter, g), ggml.Q4_0, inter)
    x = torch.randn(n, h, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    want = torch.zeros_like(x)
    for ex in range(e):
        tok, slot = (idx == ex).nonzero(as_tuple=True)
        if len(tok):
            y = ggml_cpu.linear(x[tok], gu.expert(ex))
            act = F.gelu(y[:, :inter], approximate="tanh") * y[:, inter:]
            want.index_add_(0, tok, (ggml_cpu.linear(act, dn.expert(ex)).float() * w[tok, slot, None]).to(x.dtype))
    assert torch.equal(ggml_cpu.experts(x, w, idx, gu, dn, inter), want)
