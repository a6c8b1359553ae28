"""The card's arithmetic (dgcli.measure.card): parameter counts against the model's own tensors and the spec's
§5.9 numbers for the real 26B-A4B config; FLOPs and bytes against a count done by hand on a tiny config
and against torch's FlopCounterMode on a real decoder step; `dgemma info` on dummy and random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dgcli.measure import card as info
from dgcli.measure import memory
from dgcli.model.random_weights import make_config, random_model, write_random_checkpoint
from dgcli.model.config import load_config, parse_config, real_config_path
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
    assert info.kv_cache_bytes(cfg, 1, 2) == 225_280  # spec §5.9: KV per cached token, bf16


def _layer(cfg, i) -> int:
    """Parameters of layer i, from the model's tensors (independent of dgcli.measure.card)."""
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
    with the reference ops (the spec; the fast CPU paths may pad or tile their GEMMs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from dgcli.sampling.rules import denoise_step as _denoise_step
    from dgcli.sampling.params import DiffusionEbParams

    monkeypatch.setenv("DGEMMA_KERNELS", "reference")
    model = random_model(make_config(SMALL, canvas_length=8))
    cfg, P = model.config, 11  # the prompt is longer than the sliding window (6)
    cache = model.new_cache(1, P + 8)
    model.encode(torch.randint(0, 96, (1, P)), cache)
    canvas = torch.randint(0, 96, (1, 8))
    hist, gen = torch.full((1, 1, 8), -1), torch.Generator().manual_seed(0)
    uniform, noise = torch.rand(1, 8, generator=gen), torch.randint(0, 96, (1, 8), generator=gen)  # the step's draws
    for sc, soft in [(False, True), (True, True), (True, False)]:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            _denoise_step(model, canvas, cache, torch.zeros(1, 8, 32) if sc else None, torch.tensor(0.7), hist,
                          DiffusionEbParams(), uniform, noise, want_soft=soft, compile_tiles=False)
        assert fc.get_total_flops() == info.step_cost(cfg, P, self_cond=sc, soft=soft).flops
    # Encoder: the projections and feed-forward are all matmuls the counter sees (masked attention on
    # CPU goes through a fused kernel it does not count), so compare everything but attention.
    with FlopCounterMode(display=False) as fc:
        model.encode(torch.randint(0, 96, (1, 8)), cache)
    attn = sum(4 * cfg.num_attention_heads * g.head_dim
               * sum(min(q + 1, g.window or 10**9) for q in range(P, P + 8)) for g in cfg.layers)
    assert fc.get_total_flops() == info.encode_cost(cfg, P, 8).flops - attn


def test_distinct_experts_and_kv_trimming():
    cfg = load_config(real_config_path())
    assert info.distinct_experts(cfg, 1) == pytest.approx(8)
    assert info.distinct_experts(cfg, 256) == pytest.approx(128, abs=1e-4)  # a canvas touches every expert
    full = info.kv_cache_bytes(cfg, 4096)
    trimmed = info.kv_cache_bytes(cfg, 4096, trimmed=True)
    assert trimmed == 5 * 4096 * 2 * 2 * 512 * 2 + 25 * 1023 * 2 * 8 * 256 * 2 < full


def test_floor_picks_the_binding_peak():
    p = info.Peaks("x", flops_per_s=100.0, bytes_per_s=10.0, source="test")
    assert info.floor_seconds(info.Cost(1000, 50), p) == (10.0, "compute")
    assert info.floor_seconds(info.Cost(100, 50), p) == (5.0, "memory")


def test_measured_cpu_peaks_are_positive():
    info._measured.clear()
    p = info.measure_cpu_peaks(seconds=0.3)
    assert p.flops_per_s > 1e8 and p.bytes_per_s > 1e8 and "measured" in p.source


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
    assert card["memory"]["kv_cache"] == info.kv_cache_bytes(cfg, 100, 4, trimmed=True)
    assert card["memory"]["kv_cache_every_position"] == info.kv_cache_bytes(cfg, 100, 4)


def test_info_bad_input_is_one_line(tmp_path):
    from dgcli.cli import app
    from dgcli.errors import UserError

    for args in (["--dummy", str(tmp_path / "nope.json")], ["--dummy", "26B-A4B", "--layers", "99"],
                 ["--format", "xml"]):
        r = CliRunner().invoke(app, ["info", *args])
        assert isinstance(r.exception, UserError) and "\n" not in str(r.exception), args


# ---- batch memory (dgcli.measure.memory) ---------------------------------------------------------------

# Where the vocabulary pass holds most (V large against the layers) and where the decoder pass does.
VOCAB_HEAVY = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 96,
               "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_global_key_value_heads": 1, "head_dim": 64, "global_head_dim": 128, "num_experts": 8,
               "top_k_experts": 2, "sliding_window": 16, "layer_types": [S, S, F], "max_position_embeddings": 8192}
DECODE_HEAVY = {**VOCAB_HEAVY, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64,
                "moe_intermediate_size": 32, "num_key_value_heads": 4, "num_global_key_value_heads": 2}


def _peak_allocated(fn) -> int:
    """The most bytes `fn` holds allocated at once on the CPU, beyond what was there before: the allocator's
    own events (torch.profiler with profile_memory), replayed in order. One thread, so every allocation is
    this thread's."""
    from torch.profiler import ProfilerActivity, profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        torch.set_num_threads(threads)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _storage_bytes(tensors) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [37, 4])  # longer and shorter than the sliding layers' ring (window 6: 5)
def test_kv_per_slot_is_what_new_cache_allocates(dtype, context):
    model = random_model(make_config(SMALL, canvas_length=8), dtype=dtype)
    held = _storage_bytes(model.new_cache(3, context).k + model.new_cache(3, context).v)
    kv = memory.kv_bytes(model.config, context, dtype.itemsize)
    assert held / 3 == kv["total"] == info.kv_cache_bytes(model.config, context, dtype.itemsize, trimmed=True)
    # SMALL: sliding layers 2 kv heads x 8, the full layer 1 x 16: K and V of a position 2 x 16 values each.
    assert kv["full_per_token"] == 2 * 16 * dtype.itemsize
    assert kv["rings"] == 2 * 2 * 2 * 8 * dtype.itemsize * min(5, context)
    every = model.new_cache(3, context, rings=False)  # what the cache was: every position on every layer
    assert _storage_bytes(every.k + every.v) / 3 == kv["was"] == info.kv_cache_bytes(model.config, context,
                                                                                      dtype.itemsize)
    sec = memory.batch_memory(model.config, context=context, prompt_len=5, dtype=str(dtype)[6:], budgets=[])
    assert sec["per_slot"]["kv_cache"] == held / 3 and sec["per_slot"]["kv"] == kv


def test_real_config_kv_per_slot_with_rings():
    """The released config, bf16: 5 full layers (2 kv heads x 512) keep every position, 20 KiB a token; 25
    sliding layers (8 x 256, window 1024) a ring of 1023 positions, 199.8 MiB a slot; every position on
    every layer was 225,280 B a token (spec §5.9): 1.72 GiB -> 360 MiB a slot at 8K, 27.5 -> 2.7 GiB at 128K."""
    cfg = load_config(real_config_path())
    for context, after, before in ((8192, 377_282_560, 1_845_493_760), (131072, 2_893_864_960, 29_527_900_160)):
        kv = memory.kv_bytes(cfg, context, 2)
        assert (kv["full_per_token"], kv["rings"], kv["was_per_token"]) == (20_480, 209_510_400, 225_280)
        assert (kv["total"], kv["was"]) == (after, before)


def test_loop_state_per_row_is_what_a_batched_run_holds():
    """The loop's own tensors at a Step of a 3-row run minus a 2-row run (rows with their own settings, so
    the per-row rules are tensors too; a step past the first, so the soft embedding is held) are
    `loop_state_bytes` per row; at the Step the new canvas and soft embedding are held next to the old
    ones (the loop swaps them after the event). The cache is one buffer of slots for the whole run."""
    from dgcli.sampling.events import Step
    from dgcli.sampling.loop import generate_batch_events
    from dgcli.sampling.params import DiffusionEbParams

    model = random_model(make_config(SMALL, canvas_length=8), dtype=torch.bfloat16)
    cfg = model.config
    a, b_ = (DiffusionEbParams(max_denoising_steps=4, stability_threshold=2, entropy_bound=e) for e in (0.1, 0.2))
    held = {}
    for b in (2, 3):
        gen = generate_batch_events(model, [[3, 4, 5, 6, 7]] * b, params=[a, b_, a][:b], num_blocks=2)
        for ev in gen:
            if isinstance(ev, Step) and ev.step == 2:
                inner = gen
                while inner.gi_yieldfrom is not None:  # down to the engine's pass, where the event came from
                    inner = inner.gi_yieldfrom
                loc = inner.gi_frame.f_locals
                engine = loc["self"]
                out, rules, cache = loc["out"], loc["rules"], engine.cache
                held[b] = _storage_bytes([v for v in loc.values() if isinstance(v, torch.Tensor)]
                                         + [engine.canvas, engine.history, engine.soft]
                                         + [out.sample, out.argmax, out.entropy, out.soft]
                                         + [rules.entropy_bound, rules.confidence_threshold, rules.stability])
                assert _storage_bytes(cache.k + cache.v) == b * memory.kv_bytes(cfg, 5 + 8, 2)["total"]
                break
        gen.close()
    state = memory.loop_state_bytes(cfg, ab=2, stability=2)
    assert state["soft"] == 8 * 32 * 2
    assert held[3] - held[2] == state["total"] + 8 * 8 + state["soft"]


@pytest.mark.parametrize("text", [VOCAB_HEAVY, DECODE_HEAVY])
def test_step_and_prefill_temporaries_are_the_cpu_allocators_peak(text):
    """One denoising step (decoder + vocabulary pass) and one prefill, b = 1 and 3 rows, on the CPU paths:
    the formula's bytes against the allocator's peak (the fixed parts are a few KiB of attention scratch)."""
    from dgcli.sampling.params import DiffusionEbParams
    from dgcli.sampling.rules import denoise_step

    model = random_model(make_config(text, canvas_length=32), dtype=torch.bfloat16)
    cfg, v, p = model.config, text["vocab_size"], 100
    got = {}
    for b in (1, 3):
        cache = model.new_cache(b, p)
        ids = torch.randint(0, v, (b, p))
        pre = _peak_allocated(lambda ids=ids, cache=cache: model.encode(ids, cache))
        args = (model, torch.randint(0, v, (b, 32)), cache, torch.zeros(b, 32, cfg.hidden_size, dtype=torch.bfloat16),
                torch.full((b,), 0.7), torch.full((1, b, 32), -1), DiffusionEbParams(),
                torch.rand(b, 32, dtype=torch.float64), torch.randint(0, v, (b, 32)))
        step = _peak_allocated(lambda args=args: denoise_step(*args, want_soft=True, compile_tiles=False))
        want_step = memory.step_bytes(cfg, b, p, 2, cpu=True)["total"]
        want_pre = memory.decode_bytes(cfg, b, p, 2, cpu=True, prefill=p)
        # Not counted: the CPU flash-attention kernel's per-thread scratch (here 41 KiB: qk fp32 and bf16
        # [32, keys], its fp32 output block [32, d]), which is the peak's when the peak is inside SDPA.
        assert step == pytest.approx(want_step, rel=0.01, abs=64 * 2**10)
        assert pre == pytest.approx(want_pre, rel=0.01, abs=64 * 2**10)
        got[b] = (step, pre, want_step, want_pre)
    per_row = [(got[3][i] - got[1][i]) / 2 for i in range(4)]
    # The slope within 0.5 %, or within half the uncounted attention scratch: at b = 1 a bf16 step's peak can
    # sit inside SDPA (the draw phase holds a bf16 [N, H] soft embedding, smaller than the scratch-free
    # decoder peak of b = 3), so one end of the slope carries the ~41 KiB the formula leaves out.
    assert per_row[0] == pytest.approx(per_row[2], rel=0.005, abs=24 * 2**10)
    assert per_row[1] == pytest.approx(per_row[3], rel=0.005)


def _interpreter_collects(monkeypatch):
    """The Triton interpreter keeps a launch's tensor arguments alive until the garbage collector runs (its
    recursive `_to_cpu` closure over the storage map is a reference cycle); a compiled launch holds none.
    Collect after every interpreted launch so that the allocator's events are the pass's own."""
    import gc

    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def collected(self, *args, **kwargs):
        out = launch(self, *args, **kwargs)
        gc.collect()
        return out
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", collected)


# V = 4500: 71 tiles of 64, so 64 splits round to 36 of 128 columns; chunks of 6 rows: 6, 6, 4. The interpreted
# pass costs ~1 s a chunk at V = 1000 and ~2.5 s at V = 4500: the V = 4500 chunked run is slow.
@pytest.mark.parametrize("dtype, v, chunk, want_soft", [(torch.bfloat16, 1000, None, True),
                                                        (torch.float32, 1000, 6, True),
                                                        (torch.bfloat16, 4500, None, False),
                                                        pytest.param(torch.bfloat16, 4500, 6, True,
                                                                     marks=pytest.mark.slow)])
def test_cuda_vocab_pass_peak_is_the_formula(dtype, v, chunk, want_soft, triton_device, monkeypatch):
    """The Triton vocabulary pass's peak over 16 rows against `vocab_bytes`' CUDA branch: one chunk and
    several (the scratch cap lowered to `chunk` rows, in the kernel and the formula alike), fp32 and bf16,
    without the soft embedding (all rows at once). On a GPU the caching allocator's peak after a warm-up
    call (the soft kernel's autotuning allocates its own buffers on a row count's first call); here the
    interpreter's, with the CPU allocator's events."""
    pytest.importorskip("triton")
    from dgcli.kernels import vocab_pass

    n, h, ab = 16, 96, dtype.itemsize
    if chunk:
        monkeypatch.setattr(vocab_pass, "SCRATCH_BYTES", chunk * v * ab)
        monkeypatch.setattr(memory, "SCRATCH_BYTES", chunk * v * ab)
    g = torch.Generator().manual_seed(0)
    hidden, embed = (torch.randn(*shape, generator=g).to(dtype).to(triton_device) for shape in ((1, n, h), (v, h)))
    u = torch.rand(1, n, dtype=torch.float64, generator=g).to(triton_device)
    temp = torch.full((1,), 0.8, device=triton_device)

    def run():
        return vocab_pass.vocab_pass_triton(hidden, embed, softcap=30.0, temperature=temp, embed_scale=2.0,
                                            uniform=u, want_soft=want_soft)
    want = memory._cuda_vocab(n, h, v, ab, want_soft)
    if triton_device == "cuda":
        run()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run()
        torch.cuda.synchronize()
        got = torch.cuda.max_memory_allocated() - base
        del out
        # blocks are rounded up to 512 bytes: a few KiB over the [N] vectors' allowance
        assert got == pytest.approx(want, abs=64 * n + 16 * 2**10)
    else:
        _interpreter_collects(monkeypatch)
        got = _peak_allocated(run)
        # Without the soft embedding the peak is the draw's last step, arange(W) · (p > 0), where the CPU
        # casts the bool mask to an int64 copy first (8 bytes per [N, W] entry) and CUDA casts on the fly.
        cpu_cast = 0 if want_soft else 8 * n * memory.GROUP
        assert 0 <= want + cpu_cast - got <= 64 * n  # the formula's allowance for a dozen [N] vectors
    cfg = parse_config(make_config({**SMALL, "vocab_size": v, "hidden_size": h}, canvas_length=n))
    assert memory.vocab_bytes(cfg, 1, ab) == max(memory._cuda_vocab(n, h, v, ab, s) for s in (True, False))


@pytest.mark.parametrize("blocks, slots", [([12, 12], 2), ([2, 5, 3, 4], 2)])
def test_a_whole_batched_run_peaks_where_the_formula_says(blocks, slots):
    """generate_batch_events over one batch of equal requests, and over 4 requests through 2 slots (each
    finished request's slot is taken by the next): the run's peak is its cache, the loop state and the
    larger of prefill and step, as peak_bytes counts them (within the CPU attention kernel's scratch)."""
    from dgcli.sampling.loop import generate_batch_events
    from dgcli.sampling.params import DiffusionEbParams

    model = random_model(make_config(VOCAB_HEAVY, canvas_length=32), dtype=torch.bfloat16)
    prompts = [torch.randint(0, 4096, (32,)) for _ in blocks]
    params = DiffusionEbParams(max_denoising_steps=2, confidence_threshold=0.0)
    def run():
        for _ in generate_batch_events(model, prompts, params=params, num_blocks=blocks, max_batch=slots):
            pass

    context = max(memory.cache_length(32, n, 32) for n in blocks)  # the cache is sized for the longest request
    want = memory.peak_bytes(model.config, slots, context=context, prompt_len=32, cpu=True)
    assert want["peak_phase"] == "step"
    # The measured peak sits 36,064 bytes (one batch's loop state but 186 bytes) under the formula at both
    # settings, before and after the CPU vocabulary pass dropped its per-tile round(L) copy (issue 15 item 5,
    # -512 KiB on both sides): the peak step holds less of the loop state than `loop_state_bytes` counts. With
    # the smaller total that gap is just over 1 %, so it is allowed explicitly.
    assert _peak_allocated(run) == pytest.approx(want["total"] - want["weights"], rel=0.01, abs=want["loop_state"])


def test_largest_batch_is_the_boundary_and_grows_with_memory():
    cfg = load_config(real_config_path())
    kw = {"context": 4096, "prompt_len": 256}
    last = 0
    for gib in (40, 48, 52.5, 60, 80, 100, 141, 200, 1000):
        for fmt in memory.FORMATS:
            for cpu in (False, True):
                b = memory.largest_batch(cfg, gib * memory.GIB, fmt=fmt, cpu=cpu, **kw)
                usable = gib * memory.GIB * 0.9
                if b:
                    assert memory.peak_bytes(cfg, b, fmt=fmt, cpu=cpu, **kw)["total"] <= usable
                assert memory.peak_bytes(cfg, b + 1, fmt=fmt, cpu=cpu, **kw)["total"] > usable
        b = memory.largest_batch(cfg, gib * memory.GIB, **kw)
        assert b >= last
        last = b
        assert memory.largest_batch(cfg, gib * memory.GIB, fmt="fp8", **kw) >= b
        assert memory.largest_batch(cfg, gib * memory.GIB, headroom=0.0, **kw) >= b
        assert memory.largest_batch(cfg, gib * memory.GIB, context=1024, prompt_len=256) >= b
    assert memory.largest_batch(cfg, 40 * memory.GIB, **kw) == 0  # 36 GiB usable < 47 GiB of bf16 weights


def test_weight_formats():
    cfg = load_config(real_config_path())
    n = info.param_counts(cfg)
    bf16, fp8 = memory.weights_bytes(cfg, "bf16"), memory.weights_bytes(cfg, "fp8")
    assert bf16["bytes"] == (n["total"] - 60) * 2 + 60 * 4 == info.card(
        cfg, name="x", source="y", dtype="bfloat16", budgets=[])["memory"]["weights"]
    quantized = n["attention"] - sum(2 * g.head_dim for g in cfg.layers) + n["dense_mlp"] + n["experts"]
    rows = info.quantized_counts(cfg)[1]  # one bf16 scale per output channel
    assert fp8["fp8_parameters"] == quantized and fp8["bytes"] == bf16["bytes"] - quantized + 2 * rows
    from dgcli.model.random_weights import with_fp8
    from dgcli.model.config import parse_config, read_json

    assert fp8["bytes"] == info.weights_bytes_total(parse_config(with_fp8(read_json(real_config_path()))), 2)
    assert 50.4e9 < bf16["bytes"] < 50.6e9 and 25.9e9 < fp8["bytes"] < 26.1e9
    with pytest.raises(ValueError):
        memory.weights_bytes(cfg, "int4")


def test_memory_constants_follow_the_kernels():
    """The formula restates buffer sizes the kernels choose; they must move together. The Triton modules
    are read as text (they import triton, absent on CPU-only installs)."""
    import re
    from pathlib import Path

    from dgcli.kernels import categorical, vocab_pass_cpu

    assert memory.GATHER_BYTES == categorical.GATHER_BYTES
    assert (memory.CPU_TILE_BYTES, memory.CPU_TILE_ROWS, memory.GROUP, memory.CPU_SOFTMAX_BYTES) == (
        vocab_pass_cpu.TILE_BYTES, vocab_pass_cpu.TILE_ROWS, vocab_pass_cpu.GROUP, vocab_pass_cpu.SOFTMAX_BYTES)
    kernels = Path(categorical.__file__).parent
    triton_src = (kernels / "vocab_pass.py").read_text()

    def const(name):  # a module constant: a literal or a product of literals
        return eval(re.search(rf"^{name} = ([0-9* ]+?) *(#.*)?$", triton_src, re.MULTILINE)[1], {"__builtins__": {}})

    assert (const("SCRATCH_BYTES"), const("VOCAB_SPLITS"), const("SOFT_SPLITS")) == (
        memory.SCRATCH_BYTES, memory.VOCAB_SPLITS, memory.SOFT_SPLITS)
    # vocab_pass_triton's default blocks: block_n is the draw's group width, block_k rounds the soft splits
    assert re.search(rf"bm, bn, bk = block_m or \d+, block_n or {memory.GROUP}, block_k or {memory.SOFT_BLOCK_K}\n",
                     triton_src)
    # the row chunk the formula takes (`_cuda_chunk_rows`) and the split counts as _pass_rows rounds them
    for line in ("min(n, row_chunk or SCRATCH_BYTES // (v * embed.element_size()))",
                 "splits = splits or max(1, min(triton.cdiv(v, bn), VOCAB_SPLITS))",
                 "cols_per_split = triton.cdiv(triton.cdiv(v, splits), bn) * bn",
                 "per_soft = triton.cdiv(triton.cdiv(v, SOFT_SPLITS), bk) * bk"):
        assert line in triton_src, line
    assert re.search(rf"block_m: int = {memory.MOE_BLOCK},", (kernels / "moe.py").read_text())


def test_info_dummy_26b_prints_the_batch_table():
    cfg = load_config(real_config_path())
    card = json.loads(_info("--dummy", "26B-A4B", "--no-measure-peaks", "--format", "json"))
    sec = card["batch_memory"]
    kv, state, step = 4096 * 20_480 + 209_510_400, sec["per_slot"]["loop_state"], sec["per_slot"]["step_per_row"]["cuda"]
    # 279.8 MiB: full layers' 20 KiB/token and the sliding rings (880 MiB when every layer kept every position)
    assert sec["context"] == 4096 and sec["per_slot"]["kv_cache"] == kv
    assert 1.3 * 2**20 < state < 1.5 * 2**20  # mostly the soft embedding [256, 2816] bf16
    assert 20 * 2**20 < step < 60 * 2**20
    fits = {(f["memory"], f["weights"]): f for f in sec["fits"]}
    # bf16 on an H100: 72 GiB usable less 47 GiB of weights, over KV + state + a step's share per slot (less
    # a slot's worth of the step's fixed chunks, which keeps the answer within one of this estimate).
    w = memory.weights_bytes(cfg, "bf16")["bytes"]
    h100, h200 = fits[("H100 80 GB", "bf16")], fits[("H200 141 GB", "bf16")]
    estimate = (0.9 * 80 * 2**30 - w) / (kv + state + step)
    assert h100["largest_batch"] in (int(estimate), int(estimate) - 1) and h100["largest_batch"] == 81  # 27 before the rings
    assert h100["peak_phase"] == "step" and h200["largest_batch"] > h100["largest_batch"]
    for mem in ("H100 80 GB", "H200 141 GB"):
        assert fits[(mem, "fp8")]["largest_batch"] > fits[(mem, "bf16")]["largest_batch"]
    md = _info("--dummy", "26B-A4B", "--no-measure-peaks")
    assert "**largest batch that fits**" in md and "| H100 80 GB (cuda) | bf16 47.03 GiB | 72 GiB | **81** |" in md
    assert "per slot: KV cache 279.8 MiB" in md and "this machine (cpu)" in md
    assert ("KV cache: 20 KiB/token for full layers + 199.8 MiB per slot for the sliding rings (was 220 KiB/token): "
            "279.8 MiB per slot at 4,096 tokens (was 880 MiB)") in md


def test_info_memory_and_headroom_options():
    card = json.loads(_info("--dummy", "26B-A4B", "--no-measure-peaks", "--format", "json", "--memory", "100",
                            "--headroom", "0", "--context", "1024"))
    rows = [f for f in card["batch_memory"]["fits"] if f["memory"] == "--memory 100 GiB"]
    assert [f["weights"] for f in rows] == ["bf16", "fp8"] and rows[0]["usable_bytes"] == 100 * 2**30
    assert rows[0]["path"] == "cpu" and rows[0]["largest_batch"] > 0
    from dgcli.cli import app
    from dgcli.errors import UserError

    for bad in (["--memory", "0"], ["--headroom", "100"]):
        r = CliRunner().invoke(app, ["info", "--dummy", "26B-A4B", "--no-measure-peaks", *bad])
        assert isinstance(r.exception, UserError), bad
