"""GGML block formats (dgcli/model/ggml.py): dequantize equals the `gguf` package's, quantize as llama.cpp's
reference rounds (bit-exact where gguf-py has the quantizer) within stated round-trip bounds, and a random model
with its linears and experts in Q4_K / Q8_0 / Q6_K gives the logits of the same dequantized weights in bf16."""

import numpy as np
import pytest
import torch

from dgcli.checkpoint import ggml_quants
from dgcli.checkpoint.meta import dequantize_model
from dgcli.model import ggml
from dgcli.checkpoint.random_weights import ggml_dummy_bytes, make_config, random_ggml_model, random_model

gguf = pytest.importorskip("gguf")  # the test extra installs it: the oracle
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402

TYPES = [ggml.Q8_0, ggml.Q4_K, ggml.Q6_K, ggml.Q4_0, ggml.Q5_0]
# Relative RMS round-trip error on N(0, 1) rows, per type (measured here: Q8_0 0.0054, Q4_K 0.072, Q6_K 0.018,
# Q4_0 0.087, Q5_0 0.043); the bounds leave ~1.3-1.5x for other seeds
RT_BOUND = {ggml.Q8_0: 0.008, ggml.Q4_K: 0.09, ggml.Q6_K: 0.025, ggml.Q4_0: 0.12, ggml.Q5_0: 0.06}


def _np(qtype):
    return gguf.GGMLQuantizationType(qtype)


def _random_bytes(rows, qtype, k, seed=0):
    return torch.randint(0, 256, (rows, ggml.row_bytes(qtype, k)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_block_tables_are_ggmls():
    """The model's block table (model/ggml.py) is written out, so the model needs no file code (the GGUF reader
    takes gguf-py's): it says what gguf-py's GGML_QUANT_SIZES and type names say."""
    for t in ggml.NAMES:
        assert ggml.BLOCKS[t] == gguf.GGML_QUANT_SIZES[_np(t)]
        assert ggml.NAMES[t] == _np(t).name


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf(qtype):
    """Every byte random: negative scales and d, NaN / inf from fp16 patterns included (they agree too)."""
    raw = _random_bytes(9, qtype, 512)
    raw[0] = 0  # an all-zero block row
    ref = gguf_dequantize(raw.numpy(), _np(qtype))
    got = ggml.dequantize(raw, qtype, 512).numpy()
    assert got.shape == ref.shape == (9, 512)
    np.testing.assert_array_equal(got, ref)  # NaNs compare equal in place
    assert not got[0].any()
    stacked = ggml.dequantize(raw.view(3, 3, -1), qtype, 512)  # leading dims kept
    assert torch.equal(stacked.reshape(9, 512).nan_to_num(), torch.from_numpy(ref).nan_to_num())


@pytest.mark.parametrize("qtype", [ggml.F32, ggml.F16, ggml.BF16])
def test_float_types_round_trip(qtype):
    w = torch.randn(3, 8)
    got = ggml.dequantize(ggml_quants.quantize(w, qtype), qtype, 8)
    dtype = {ggml.F32: torch.float32, ggml.F16: torch.float16, ggml.BF16: torch.bfloat16}[qtype]
    assert torch.equal(got, w.to(dtype).float())


@pytest.mark.parametrize("qtype", [ggml.Q8_0, ggml.Q4_0, ggml.Q5_0])
def test_quantize_is_bit_exact_with_gguf(qtype):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    w[0] = 0
    w[1, :32] = -0.5  # a constant block: the largest-magnitude value negative
    np.testing.assert_array_equal(ggml_quants.quantize(w, qtype).numpy(), gguf_quantize(w.numpy(), _np(qtype)))


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_round_trip(qtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 3, 512, generator=g)
    raw = ggml_quants.quantize(w, qtype)
    assert raw.shape == (4, 3, ggml.row_bytes(qtype, 512)) and raw.dtype == torch.uint8
    back = ggml.dequantize(raw, qtype, 512)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel <= RT_BOUND[qtype], rel
    # no value off by more than about one step of its block (the absmax over the block's levels)
    assert ((back - w).abs().max() / w.abs().max()).item() <= 0.2
    # scaled inputs: the same relative error (no absolute thresholds inside)
    rel_small = ((ggml.dequantize(ggml_quants.quantize(w * 1e-3, qtype), qtype, 512) - w * 1e-3).norm() / (w * 1e-3).norm())
    assert rel_small.item() <= RT_BOUND[qtype]


@pytest.mark.parametrize("qtype", [ggml.Q4_K, ggml.Q6_K])
def test_k_quants_edge_blocks(qtype):
    w = torch.zeros(4, 256)
    w[1] = 0.25  # constant positive: Q4_K stores it through the min, Q6_K through one scale
    w[2] = -torch.linspace(0, 1, 256)  # all negative
    w[3, 7] = 3.0  # one spike in a zero block
    back = ggml.dequantize(ggml_quants.quantize(w, qtype), qtype, 256)
    assert torch.isfinite(back).all() and not back[0].any()
    assert (back[1:] - w[1:]).abs().max().item() <= 0.05 * w[1:].abs().amax().item() + 1e-6
    assert back[3, 7].item() == pytest.approx(3.0, rel=0.02)


def test_quantize_rejects_ragged_rows():
    with pytest.raises(ValueError, match="multiple of 256"):
        ggml_quants.quantize(torch.randn(2, 96), ggml.Q4_K)
    assert ggml_quants.type_for(ggml.Q4_K, 96) == ggml.Q5_0 and ggml_quants.type_for(ggml.Q6_K, 96) == ggml.Q8_0
    assert ggml_quants.type_for(ggml.Q4_K, 40) is None


@pytest.mark.parametrize("qtype", TYPES)
def test_random_blocks_are_valid(qtype):
    raw = ggml_quants.random_blocks((5, 7), qtype, 512, torch.Generator().manual_seed(3))
    w = ggml.dequantize(raw, qtype, 512)
    assert raw.shape == (5, 7, ggml.row_bytes(qtype, 512)) and torch.isfinite(w).all()
    assert 0.7 < w.std().item() * 512 ** 0.5 < 1.4  # the dummy init's spread, 1/sqrt(fan_in)
    assert abs(w.mean().item()) < 0.15 * w.std().item()  # centred (Q4_K: through its mins)



# ---- Q4_K / Q6_K searches: the same bytes as their first (plain, slow) version --------------------------------

def _ref_qkx2(x, wts, nmax, rmin=-1.0, rdelta=0.1, nstep=20):
    """make_qkx2_quants as first written (all 1 + nstep + 1 candidates at once, no chunks): the pinned bytes."""
    mn = x.amin(dim=1).clamp(max=0)
    rng = x.amax(dim=1) - mn
    flat = rng == 0
    rng_safe = torch.where(flat, torch.ones_like(rng), rng)
    sum_w, sum_x = wts.sum(dim=1), (wts * x).sum(dim=1)
    xs = x - mn[:, None]
    isc0 = nmax / rng_safe
    l0 = torch.round(isc0[:, None] * xs).clamp(0, nmax)
    scale0 = 1 / isc0
    err0 = (wts * (scale0[:, None] * l0 + mn[:, None] - x) ** 2).sum(dim=1)
    steps = rmin + rdelta * torch.arange(nstep + 1, dtype=torch.float32)
    lc = torch.round(((steps[None, :] + nmax) / rng_safe[:, None])[:, :, None] * xs[:, None, :]).clamp(0, nmax)
    w3 = wts[:, None, :]
    sum_l, sum_l2, sum_xl = (w3 * lc).sum(-1), (w3 * lc * lc).sum(-1), (w3 * lc * x[:, None, :]).sum(-1)
    det = sum_w[:, None] * sum_l2 - sum_l * sum_l
    det_safe = torch.where(det > 0, det, torch.ones_like(det))
    sc = (sum_w[:, None] * sum_xl - sum_x[:, None] * sum_l) / det_safe
    m = (sum_l2 * sum_x[:, None] - sum_l * sum_xl) / det_safe
    pos = m > 0
    sc = torch.where(pos, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), sc)
    m = torch.where(pos, torch.zeros_like(m), m)
    err = (w3 * (sc[:, :, None] * lc + m[:, :, None] - x[:, None, :]) ** 2).sum(-1)
    err = torch.where(det > 0, err, torch.full_like(err, float("inf")))
    pick = torch.cat((err0[:, None], err), dim=1).argmin(dim=1)[:, None]
    L = torch.cat((l0[:, None], lc), dim=1).gather(1, pick[:, :, None].expand(-1, 1, x.shape[1]))[:, 0]
    scale = torch.cat((scale0[:, None], sc), dim=1).gather(1, pick)[:, 0]
    the_min = -torch.cat((mn[:, None], m), dim=1).gather(1, pick)[:, 0]
    return (torch.where(flat, torch.zeros_like(scale), scale), torch.where(flat, -mn, the_min),
            torch.where(flat[:, None], torch.zeros_like(L), L).to(torch.uint8))


def _ref_qx(x, nmax):
    """make_qx_quants (rmse_type 1) as first written: the pinned bytes."""
    mx = x.gather(1, x.abs().argmax(dim=1, keepdim=True))[:, 0]
    tiny = mx.abs() < 1e-15
    mx_safe = torch.where(tiny, torch.ones_like(mx), mx)
    steps = torch.tensor([0] + list(range(-9, 0)) + list(range(1, 10)), dtype=torch.float32)
    isc = -(nmax + 0.1 * steps[None, :]) / mx_safe[:, None]
    isc[:, 0] = -nmax / mx_safe
    lc = torch.round(isc[:, :, None] * x[:, None, :]).clamp(-nmax, nmax - 1)
    w = (x * x)[:, None, :]
    sumlx, suml2 = (w * x[:, None, :] * lc).sum(-1), (w * lc * lc).sum(-1)
    l2_safe = torch.where(suml2 > 0, suml2, torch.ones_like(suml2))
    best = torch.where(suml2 > 0, sumlx * sumlx / l2_safe, torch.zeros_like(sumlx)).argmax(dim=1, keepdim=True)
    scale = torch.where(suml2 > 0, sumlx / l2_safe, torch.zeros_like(sumlx)).gather(1, best)[:, 0]
    L = lc.gather(1, best[:, :, None].expand(-1, 1, x.shape[1]))[:, 0] + nmax
    return (torch.where(tiny, torch.zeros_like(scale), scale),
            torch.where(tiny[:, None], torch.zeros_like(L), L).to(torch.uint8))


def _search_inputs(nb):
    """Random rows and adversarial ones: ties (integers, two values, a level grid), zero and constant
    sub-blocks, one-sided, heavy-tailed, underflowing (1e-20: the refits degenerate), subnormal and huge."""
    g = torch.Generator().manual_seed(nb)
    r = lambda: torch.randn(nb, 256, generator=g)  # noqa: E731
    sparse = torch.zeros(nb, 256)
    sparse[:, ::37] = r()[:, :7]
    mixed = r() * 0.02
    mixed[::3, :32], mixed[1::3, 64:96], mixed[2::3, 100] = 0, 0.5, 40
    return {"randn": r() * 0.02, "bf16": (r() * 0.05).bfloat16().float(), "heavy": r() ** 3,
            "ints": torch.randint(-8, 8, (nb, 256), generator=g).float(),
            "grid": torch.randint(0, 16, (nb, 256), generator=g).float() * 0.01 - 0.07,
            "twoval": torch.where(r() > 0, 0.3, -0.1), "pos": r().abs() + 1, "neg": -r().abs(),
            "sparse": sparse, "mixed": mixed, "rows_1e-6_to_1e6": r() * torch.logspace(-6, 6, nb)[:, None],
            "1e-20": r() * 1e-20, "1e20": r() * 1e20, "subnormal": r() * 1e-40}


def test_k_quant_search_bytes_equal_the_first_version(monkeypatch):
    """The chunked, in-place searches give byte-identical Q4_K / Q6_K blocks to the unchunked originals
    (any change in a float op's order could flip a near-tied candidate; these inputs are full of ties)."""
    from dgcli.checkpoint import ggml_quants as gq

    fast = {ggml.Q4_K: gq._make_qkx2, ggml.Q6_K: gq._make_qx}
    for name, w in _search_inputs(70).items():  # 70 blocks: 560 / 1120 sub-blocks, past one default chunk
        for qtype in (ggml.Q4_K, ggml.Q6_K):
            with monkeypatch.context() as m:
                m.setattr(gq, "_make_qkx2", _ref_qkx2)
                m.setattr(gq, "_make_qx", _ref_qx)
                want = ggml_quants.quantize(w, qtype)
            assert gq._make_qkx2 is fast[ggml.Q4_K] and gq._make_qx is fast[ggml.Q6_K]
            got = ggml_quants.quantize(w, qtype)
            assert torch.equal(got, want), (name, ggml.NAMES[qtype], (got != want).any(-1).sum().item())

# ---- a random model with GGML linears and experts ------------------------------------------------------------

# Rows of 256 (hidden, head_dim x heads, intermediate, expert intermediate) so Q4_K and Q6_K apply everywhere.
# Every token routes to all 4 experts: with top-2 a bf16-sized change in a router's input flips near-tied expert
# choices, and a random 2-layer model turns that into logit changes of ~1 whatever the weights' format (the
# kernels' tests cover partial routing).
TEXT = dict(vocab_size=96, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=128,
            global_head_dim=128, num_experts=4, top_k_experts=4, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
# Logits (softcapped at 30, |logit| up to ~8 here) of the GGML model vs the plain model holding the same
# dequantized weights, both bf16, without / with self-conditioning: measured max |diff| 0.23 / 0.41 (Q4_K),
# 0.27 / 0.44 (Q8_0), 0 (Q6_K: bf16 tiles through the same F.linear); relative RMS 0.025 / 0.053 (Q4_K),
# 0.027 / 0.055 (Q8_0). The same weights in bf16 vs fp32 differ by as much (0.019-0.080): this random model
# amplifies bf16 rounding, so the bound is that noise's size, and the second check compares against fp32.
LOGIT_MAX, LOGIT_RMS = 0.75, 0.08
# The int8 path (kernels/ggml_q8.py: x rounded to int8 per group of 32, the default for bf16 x where the CPU has
# VNNI) adds its own noise, which this model amplifies too: measured max |diff| 0.39-1.35, RMS 0.044-0.175 against
# the dequantized bf16 model, 1.3-3.1x bf16's distance to fp32 (Q4_K, Q8_0, Q4_0, Q5_0, Q6_K, with and without
# self-conditioning); the quantized weights themselves moved the logits by 0.43-0.72 RMS (Q6_K 0.20-0.29).
Q8_LOGIT_MAX, Q8_LOGIT_RMS, Q8_FP32_RATIO = 2.0, 0.25, 4.0


def _rms(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def plain():
    return random_model(make_config(TEXT, canvas_length=8), seed=7, dtype=torch.bfloat16)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (2, 11), generator=g), torch.randint(0, 96, (2, 8), generator=g), \
        torch.randn(2, 8, 96, generator=g).bfloat16() * 4


@pytest.fixture(params=["bf16", "int8"])
def x_path(request, monkeypatch):
    """The int4 forms' activations: "bf16" (DGEMMA_KERNELS=torch) or "int8" (kernels/ggml_q8.py; skipped where the
    CPU has no VNNI: it would not run there)."""
    from dgcli.kernels import ggml_q8

    monkeypatch.setenv("DGEMMA_KERNELS", "torch" if request.param == "bf16" else "auto")
    if request.param == "int8" and not ggml_q8.available():
        pytest.skip("no AVX-512 VNNI + VBMI here: the int8 path does not run")
    return request.param


@pytest.mark.parametrize("qtype", [ggml.Q4_K, ggml.Q8_0, ggml.Q6_K])
def test_model_logits_equal_the_dequantized_bf16_model(plain, qtype, x_path):
    import copy

    int8 = x_path == "int8"
    bound_max, bound_rms, ratio = (Q8_LOGIT_MAX, Q8_LOGIT_RMS, Q8_FP32_RATIO) if int8 else (LOGIT_MAX, LOGIT_RMS, 1.5)
    model = ggml_quants.quantize_model_(copy.deepcopy(plain), qtype)
    linears = ggml_quants.targets(plain)
    assert all(isinstance(model.get_submodule(n), ggml.QuantLinear) for n in linears)
    assert all(isinstance(layer.experts, ggml.QuantExperts) for layer in model.layers)
    assert {model.get_submodule(n).qtype for n in linears} == {qtype}
    deq = dequantize_model(model)
    exact = dequantize_model(model, torch.float32)
    prompt, canvas, sc = _inputs()
    for soft in (None, sc):
        a, b = model.forward_canvas(prompt, canvas, soft), deq.forward_canvas(prompt, canvas, soft)
        assert (a - b).abs().max().item() <= bound_max and _rms(a, b) <= bound_rms
        # no further from these weights' fp32 logits than bf16 inference of the same weights is (x ratio)
        e = exact.forward_canvas(prompt, canvas, soft)
        assert _rms(a, e) <= ratio * _rms(b, e) + 1e-3
        if qtype != ggml.Q8_0:  # the quantization itself moved the logits by more than that (this can fail)
            moved = _rms(plain.forward_canvas(prompt, canvas, soft), b)
            assert moved > (2 * _rms(a, b) if int8 else bound_rms)


def test_fp32_model_runs_the_exact_dequantized_weights(plain):
    import copy

    model = ggml_quants.quantize_model_(copy.deepcopy(plain).float(), ggml.Q4_K)
    deq = dequantize_model(model)
    prompt, canvas, _ = _inputs(1)
    torch.testing.assert_close(model.forward_canvas(prompt, canvas), deq.forward_canvas(prompt, canvas),
                               rtol=1e-4, atol=1e-4)


def test_activation_path_names_what_the_linears_multiply_by(plain, x_path, monkeypatch):
    import copy

    assert ggml.activation_path(plain) is None  # no GGML weight
    assert ggml.activation_path(object()) is None  # a Ray driver's stand-in for the model
    model = ggml_quants.quantize_model_(copy.deepcopy(plain), ggml.Q4_K)
    assert ggml.activation_path(model) == ("int8" if x_path == "int8" else "bfloat16")
    assert ggml.activation_path(model.float()) == "float32"  # fp32 sessions never take the int8 path


@pytest.mark.parametrize("weights", ["q4_k", "q8_0"])
def test_dummy_ggml_model(weights, x_path):
    cfg = make_config(dict(TEXT, moe_intermediate_size=96), canvas_length=8)  # 96: no Q4_K rows -> Q5_0
    model = random_ggml_model(cfg, weights, seed=1)
    held = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert held == ggml_dummy_bytes(cfg, weights, torch.bfloat16)
    types = model.layers[0].experts.types
    assert types == ((ggml.Q4_K, ggml.Q5_0) if weights == "q4_k" else (ggml.Q8_0, ggml.Q8_0))
    logits = model.forward_canvas(*_inputs()[:2])
    assert torch.isfinite(logits).all() and logits.std() > 0
    deq = dequantize_model(model)
    assert _rms(logits, deq.forward_canvas(*_inputs()[:2])) <= (Q8_LOGIT_RMS if x_path == "int8" else LOGIT_RMS)


def test_bench_dummy_q4_k_row_and_bad_flag(tmp_path, capsys, monkeypatch):
    import json

    from cli_run import run

    from dgcli.measure import bench as b
    from dgcli.measure.peaks import Peaks

    # the roofline's peak is the matmul the GGML weights run: int8 where the int8 kernel does
    monkeypatch.setattr(b, "device_peaks", lambda dev, measure_cpu=True, compute="bfloat16": Peaks(
        "fake", 1e12, 1e11, "test", compute=compute))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(make_config(TEXT, canvas_length=8)))
    fast = ["--runs", "1", "--warmup", "0", "--num-prompts", "1", "--random-input-len", "4", "--diffusion-steps", "1",
            "--format", "jsonl"]
    code, out, err = run(["bench", "--dummy", str(cfg), "--weights", "q4_k", *fast], capsys)
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert row["weights"] == "Q4_K"
    assert row["provenance"]["kernels"]["ggml_activations"] == ggml.activation_path(random_ggml_model(
        make_config(TEXT, canvas_length=8), "q4_k", seed=0)) in ("int8", "bfloat16")
    assert row["peak_compute"] == row["provenance"]["kernels"]["ggml_activations"]
    code, out, err = run(["bench", "--model", str(tmp_path), "--weights", "q4_k", *fast], capsys)
    assert code == 2 and "--weights q4_k builds --dummy weights" in err and err.count("\n") == 1, err
