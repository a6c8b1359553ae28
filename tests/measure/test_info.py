"""The card's arithmetic (dgcli.measure.cost): parameter counts against the model's own tensors and the spec's
§5.9 numbers for the real 26B-A4B config; FLOPs and bytes against a count done by hand on a tiny config
and against torch's FlopCounterMode on a real decoder step; `dgemma info` on dummy and random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dgcli.measure import cost as info
from dgcli.measure import peaks
from dgcli.checkpoint.random_weights import make_config, random_model, write_random_checkpoint
from dgcli.checkpoint.config import parse_config, real_config_path
from dgcli.checkpoint.load import load_config
from dgcli.model.gemma import DiffusionGemma

S, F = "sliding_attention", "full_attention"

# A config small enough to count by hand: V=10, H=4, dense I=6, expert width 2, 3 experts top-2,
# 2 query heads; sliding layer: 1 kv head of dim 2, window 3; full layer: 1 kv head of dim 4; canvas 4.
HAND = dict(vocab_size=10, hidden_size=4, intermediate_size=6, moe_intermediate_size=2, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=2,
            global_head_dim=4, num_experts=3, top_k_experts=2, sliding_window=3, layer_types=[S, F],
            max_position_embeddings=64)
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=8,
             global_head_dim=16, num_experts=4, top_k_experts=2, sliding_window=6, layer_types=[S, S, F],
             max_position_embeddings=4096)




def numel_of_model(cfg) -> int:
    with torch.device("meta"):
        m = DiffusionGemma(cfg)
    return sum(t.numel() for t in m.state_dict().values())


@pytest.mark.parametrize("text", [HAND, SMALL])
def test_param_total_equals_the_models_tensors(text):
    cfg = parse_config(make_config(text, canvas_length=4))
    assert info.param_counts(cfg)["total"] == numel_of_model(cfg)


def test_real_config_counts_match_the_spec():
    cfg = load_config(real_config_path())
    n = info.param_counts(cfg)
    assert n["total"] == numel_of_model(cfg)
    assert 25.2e9 <= n["total"] < 25.3e9  # "25.2 B text parameters" (25,250,986,812)
    assert 3.75e9 <= n["active_per_token"] < 3.9e9  # "A4B": ~3.8 B active
    # Spec §5.9's arithmetic, part by part.
    h, s_layers = cfg.hidden_size, 25
    assert n["embedding"] == 262144 * 2816  # 0.738 B
    sliding = (n["total"] - n["embedding"] - n["self_conditioning"] - h - 5 * _layer(cfg, 5)) / s_layers
    assert sliding == pytest.approx(814e6, rel=1e-3) and _layer(cfg, 0) == sliding
    assert _layer(cfg, 5) == pytest.approx(828e6, rel=1e-3)
    assert n["self_conditioning"] == pytest.approx(17.8e6, rel=3e-3)
    # The released index says 25,823,778,864 with the vision tower: text + ~0.57 B vision.
    assert 0.55e9 < 25_823_778_864 - n["total"] < 0.6e9
    assert info.kv_bytes(cfg, 1, 2)["was_per_token"] == 225_280  # spec §5.9: KV per cached token, bf16


def _layer(cfg, i) -> int:
    """Parameters of layer i, from the model's tensors (independent of dgcli.measure.cost)."""
    with torch.device("meta"):
        m = DiffusionGemma(cfg)
    return sum(t.numel() for t in m.layers[i].state_dict().values())


def test_step_flops_and_bytes_counted_by_hand():
    cfg = parse_config(make_config(HAND, canvas_length=4))
    P, C = 5, 4
    # Layer 0, sliding (d=2, 1 kv head, v_proj): q 4*2*2 + k 4*1*2 + v 4*1*2 + o 2*2*4 = 48 weights.
    # It sees min(P, window-1) = 2 prefix keys + 4 canvas keys.
    l0 = 2 * C * 48 + 4 * 2 * 2 * C * (2 + C)
    # Layer 1, full (d=4, 1 kv head, K = V): q 4*2*4 + k 4*1*4 + o 2*4*4 = 80 weights; all 5 prefix keys.
    l1 = 2 * C * 80 + 4 * 2 * 4 * C * (5 + C)
    # Feed-forward per layer: dense 3*4*6, router 4*3, two experts of 3*4*2 each.
    ffn = 2 * C * (72 + 12 + 2 * 24)
    head = soft = 2 * C * 10 * 4
    sc = 2 * C * 3 * 4 * 6
    assert info.step_cost(cfg, P).flops == l0 + l1 + 2 * ffn + head + soft + sc == 5888
    assert info.step_cost(cfg, P, self_cond=False).flops == 5888 - sc
    assert info.step_cost(cfg, P, soft=False).flops == 5888 - soft

    # Bytes (bf16 = 2 B): each weight once per use (the embedding twice: head and soft embedding),
    # the canvas' 4 embedding rows, the KV rows read (sliding 2 positions x (K+V) 1x2, full 5 x 1x4).
    experts = 3 * (1 - (1 - 2 / 3) ** C)  # expected distinct experts of 3, top-2, 4 tokens
    ffn_w = 72 + (3 * 4 + 4 + 3) + 7 * 4 + experts * 24  # dense, router (+scale, per-expert), 7 gains, experts
    weights = (48 + 2 * 2) + (80 + 2 * 4) + 2 * ffn_w + (40 + 4) + 40 + (72 + 4)
    kv = 2 * (2 * 1 * 2) * 2 + 5 * (2 * 1 * 4) * 2
    assert info.step_cost(cfg, P, weight_bytes=2).bytes == pytest.approx(weights * 2 + C * 4 * 2 + kv)

    # Commit of C tokens at positions 5..8: causal keys per query, sliding capped at the window 3.
    causal_sliding = sum(min(q + 1, 3) for q in range(5, 9))
    causal_full = sum(q + 1 for q in range(5, 9))
    want = (2 * C * 48 + 4 * 2 * 2 * causal_sliding + ffn  # layer 0 with its feed-forward
            + 2 * C * 80 + 4 * 2 * 4 * causal_full)  # last layer: its feed-forward is skipped
    assert info.encode_cost(cfg, 5, C).flops == want


def test_step_flops_equal_torchs_flop_counter_on_a_real_decoder_step(monkeypatch):
    """FlopCounterMode counts the matmuls the model actually runs (attention through the math SDPA path),
    with the reference ops (the spec; the fast CPU paths may pad or tile their GEMMs): a step is the engine's
    pass over one canvas (`forward_pass`) and the sampler's half (`rules.sample_step`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from dgcli.sampling.params import DiffusionEbParams
    from dgcli.sampling.rules import sample_step
    from passes import Seqs, decode, encode

    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    model = random_model(make_config(SMALL, canvas_length=8))
    cfg, P = model.config, 11  # the prompt is longer than the sliding window (6)
    kv = Seqs(model, 1, P + 8)
    encode(model, torch.randint(0, 96, (1, P)), kv)
    canvas = torch.randint(0, 96, (1, 8))
    hist, gen = torch.full((1, 1, 8), -1), torch.Generator().manual_seed(0)
    uniform, noise = torch.rand(1, 8, generator=gen), torch.randint(0, 96, (1, 8), generator=gen)  # the step's draws
    for sc, soft in [(False, True), (True, True), (True, False)]:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            hidden = decode(model, canvas, kv, torch.zeros(1, 8, 32) if sc else None)
            sample_step(model, hidden, torch.tensor(0.7), hist, DiffusionEbParams(), uniform, noise, want_soft=soft)
        assert fc.get_total_flops() == info.step_cost(cfg, P, self_cond=sc, soft=soft).flops
    # Encoder (a commit: 8 causal rows at P..P+7): the projections and feed-forward are all matmuls the counter
    # sees (masked attention on CPU goes through a fused kernel it does not count), so compare all but attention.
    with FlopCounterMode(display=False) as fc:
        encode(model, torch.randint(0, 96, (1, 8)), kv)
    attn = sum(4 * cfg.num_attention_heads * g.head_dim
               * sum(min(q + 1, g.window or 10**9) for q in range(P, P + 8)) for g in cfg.layers)
    assert fc.get_total_flops() == info.encode_cost(cfg, P, 8).flops - attn


def test_distinct_experts_and_kv_trimming():
    cfg = load_config(real_config_path())
    assert info.distinct_experts(cfg, 1) == pytest.approx(8)
    assert info.distinct_experts(cfg, 256) == pytest.approx(128, abs=1e-4)  # a canvas touches every expert
    full = 4096 * info.kv_bytes(cfg, 4096)["was_per_token"]
    trimmed = info.kv_bytes(cfg, 4096)["total"]
    # as the engine's paged cache holds a request: full layers 4,096 + a canvas, sliding rings the last 1023
    # positions, in blocks of 16 (1024)
    assert trimmed == 5 * 4352 * 2 * 2 * 512 * 2 + 25 * 1024 * 2 * 8 * 256 * 2 < full


def test_floor_picks_the_binding_peak():
    p = info.Peaks("x", flops_per_s=100.0, bytes_per_s=10.0, source="test")
    assert info.floor_seconds(info.Cost(1000, 50), p) == (10.0, "compute")
    assert info.floor_seconds(info.Cost(100, 50), p) == (5.0, "memory")


def test_measured_cpu_peaks_are_positive():
    peaks._measured.clear()
    p = info.measure_cpu_peaks(seconds=0.3)
    assert p.flops_per_s > 1e8 and p.bytes_per_s > 1e8 and "measured" in p.source and p.compute == "bfloat16"


def test_cpu_peaks_are_measured_in_the_runs_matmul_dtype():
    """One peak per matmul dtype (cached apart; int8 is what GGML weights on the int8 path run). Which dtype is
    faster is not asserted: a timing, and on an AMX core int8 and bf16 measured within 1 % of each other."""
    peaks._measured.clear()
    got = {c: info.measure_cpu_peaks(seconds=0.3, repeats=3, compute=c) for c in ("bfloat16", "float32", "int8")}
    for c, p in got.items():
        assert p.compute == c and f"best of {c} 1024x1024 matmuls" in p.source and p.flops_per_s > 1e8
        assert info.measure_cpu_peaks(compute=c) is p
    with pytest.raises(ValueError, match="no CPU peak for float8"):
        info.measure_cpu_peaks(compute="float8")


def test_gpu_peaks_by_matmul_dtype():
    h100 = "NVIDIA H100 80GB HBM3"
    assert info.gpu_peaks(h100) is info.DEVICE_TABLE["H100"]
    assert info.gpu_peaks(h100, "float32").flops_per_s == 67e12 and "fp32 (no TF32)" in info.gpu_peaks(h100, "float32").source
    assert info.gpu_peaks(h100, "int8").flops_per_s == info.gpu_peaks("NVIDIA H200", "float8").flops_per_s == 1979e12
    assert info.gpu_peaks(h100, "int8").bytes_per_s == 3.35e12 and info.gpu_peaks("a T4", "float32") is None


def test_the_roofline_matmul_dtype_of_a_session(monkeypatch):
    from types import SimpleNamespace

    from dgcli.measure import bench as b

    cpu = torch.device("cpu")
    monkeypatch.setattr(b, "ggml_activations", lambda s: None)
    assert b.compute_dtype(SimpleNamespace(model=None, device=cpu, dtype_name="float32")) == "float32"
    assert b.compute_dtype(SimpleNamespace(model=None, device=cpu, dtype_name="bfloat16")) == "bfloat16"
    monkeypatch.setattr(b, "ggml_activations", lambda s: "int8")  # GGML weights on the int8 path
    assert b.compute_dtype(SimpleNamespace(model=None, device=cpu, dtype_name="bfloat16")) == "int8"
    # the card's H100 / H200 rows at the run's matmul dtype
    local = info.Peaks("here", 1e11, 1e10, "test", compute="float32")
    assert [p.flops_per_s for p in b.peaks_for_card(local)] == [1e11, 67e12, 67e12]
    assert [p.flops_per_s for p in b.peaks_for_card(None)] == [989e12, 989e12]
    # no local peak (--no-measure-peaks on a CPU): the table rows at the session's own matmul dtype
    fp32 = SimpleNamespace(model=None, device=cpu, dtype_name="float32")
    monkeypatch.setattr(b, "ggml_activations", lambda s: None)
    assert [p.flops_per_s for p in b.card_peaks(fp32, None)] == [67e12, 67e12]
    assert [p.compute for p in b.card_peaks(fp32, local)] == ["float32"] * 3


# ---- the command ---------------------------------------------------------------------------------------


def _info(*args):
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["info", *args])
    assert r.exit_code == 0, (r.output, r.exception)
    return r.output


def test_info_dummy_26b_json():
    card = json.loads(_info("--dummy", "26B-A4B", "--no-measure-peaks", "--format", "json"))
    assert 25.2e9 <= card["parameters"]["total"] < 25.3e9
    names = [d["name"] for d in card["devices"]]
    assert any("H100" in n for n in names) and any("H200" in n for n in names)
    h100 = next(d for d in card["devices"] if "H100" in d["name"])
    # A 256-token canvas touches every expert: ~50 GB per step, memory-bound on an H100 (~15 ms).
    assert h100["floor_step_bound"] == "memory" and 10 < h100["floor_step_ms"] < 20
    assert card["bytes_by_dtype"]["bfloat16"] == (card["parameters"]["total"] - 60) * 2


def test_info_dummy_layers_and_markdown():
    out = _info("--dummy", "26B-A4B", "--layers", "6", "--no-measure-peaks")
    assert "6 layers: 1 full-attention at [5]" in out and "theoretical floor" in out and "per commit" in out


def test_info_random_checkpoint_reads_headers_only(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "c", SMALL, canvas_length=8, tokenizer=False)
    cfg = load_config(ckpt)
    inv = info.safetensors_inventory(ckpt)
    assert inv["text_parameters"] == info.param_counts(cfg)["total"]
    assert inv["text_bytes_by_dtype"] == {"float32": info.param_counts(cfg)["total"] * 4}
    card = json.loads(_info(str(ckpt), "--no-measure-peaks", "--format", "json", "--context", "100"))
    assert card["dtype"] == "float32" and card["memory"]["kv_context"] == 100
    kv = info.kv_bytes(cfg, 100, 4)
    assert card["memory"]["kv_cache"] == kv["total"]
    assert card["memory"]["kv_cache_every_position"] == 100 * kv["was_per_token"]


def test_info_bad_input_is_one_line(tmp_path):
    from dgcli.cli import app
    from dgcli.errors import UserError

    for args in (["--dummy", str(tmp_path / "nope.json")], ["--dummy", "26B-A4B", "--layers", "99"],
                 ["--format", "xml"]):
        r = CliRunner().invoke(app, ["info", *args])
        assert isinstance(r.exception, UserError) and "\n" not in str(r.exception), args
