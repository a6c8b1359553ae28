"""The batch-memory model (dgcli.measure.cost: memory.py) against the code it models: the KV cache against the engine's
paged cache, the loop state against the engine's own tensors at a step, a pass's and a step's temporaries and a
whole batched run against the CPU allocator's peak, the Triton vocabulary pass against its allocator, and the
batch table `dgemma info` prints."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from dgcli.measure import cost as info
from dgcli.measure.cost import memory
from dgcli.measure.cost import vocab as memory_vocab
from dgcli.model.attention import Segment
from dgcli.checkpoint.config import parse_config, real_config_path
from dgcli.checkpoint.load import load_config
from dgcli.model.gemma import DiffusionGemma
from dgcli.checkpoint.random_weights import make_config, random_model

S, F = "sliding_attention", "full_attention"
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=8,
             global_head_dim=16, num_experts=4, top_k_experts=2, sliding_window=6, layer_types=[S, S, F],
             max_position_embeddings=4096)

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
@pytest.mark.parametrize("context", [300, 37, 4])  # sliding rings shorter than the full layers' blocks, and not
def test_kv_per_slot_is_what_the_engines_cache_allocates(dtype, context):
    from dgcli.engine import LLMEngine as Engine

    model = random_model(make_config(SMALL, canvas_length=8), dtype=dtype)
    cfg, ab = model.config, dtype.itemsize
    cache = Engine(model, slots=3, max_len=context).cache
    held = _storage_bytes(cache.k + cache.v)
    kv = memory.kv_bytes(cfg, context, ab)
    card = info.card(cfg, name="x", source="y", dtype=str(dtype)[6:], context=context, budgets=[])
    assert held / 3 == kv["total"] == card["memory"]["kv_cache"]
    # SMALL: sliding layers 2 kv heads x 8 (window 6), the full layer 1 x 16; C = 8; blocks of 16 positions.
    # Full layers: the context and a canvas. Rings: W-1 = 5 (a pass reads its own keys from the pass): one block.
    full, ring = {300: (320, 16), 37: (48, 16), 4: (16, 16)}[context]
    assert (cache.full_blocks * 16, cache.ring_blocks * 16) == (kv["full_positions"], ring) == (full, ring)
    assert kv["full_per_token"] == 2 * 16 * ab and kv["rings"] == 2 * 2 * 2 * 8 * ab * ring
    assert kv["was"] == full * kv["was_per_token"] and kv["was_per_token"] == (2 * 2 * 8 * 2 + 2 * 16) * ab
    sec = memory.batch_memory(cfg, context=context, prompt_len=5, dtype=str(dtype)[6:], budgets=[])
    assert sec["per_slot"]["kv_cache"] == held / 3 and sec["per_slot"]["kv"] == kv


def test_real_config_kv_per_slot_with_rings():
    """The released config, bf16: 5 full layers (2 kv heads x 512) hold the context and a canvas, 20 KiB a
    position; 25 sliding layers (8 x 256, window 1024) a ring of 1023 positions -> 1,024 in blocks of 16:
    200 MiB a slot; every position on every layer would be 225,280 B each (spec §5.9). With prefix caching the
    sliding layers hold each slot's window and 3 blocks, and one pass's causal rows beside them."""
    cfg = load_config(real_config_path())
    for context, after, before in ((8192, 382_730_240, 1_903_165_440), (131072, 2_899_312_640, 29_585_571_840)):
        kv = memory.kv_bytes(cfg, context, 2)
        assert (kv["full_per_token"], kv["rings"], kv["was_per_token"]) == (20_480, 1024 * 25 * 8192, 225_280)
        assert (kv["full_positions"], kv["total"], kv["was"]) == (context + 256, after, before)
        assert kv["windows"] == (1024 + 3 * 16) * 25 * 8192  # prefix caching: the window and 3 blocks
        # 8 slots, prefix caching: + one pass's causal rows on sliding layers (max(2048, 9 x 256) = 2304)
        assert memory.cache_bytes(cfg, 8, context, 2, True) == 8 * (20_480 * (context + 256) + kv["windows"]) + \
            2304 * 25 * 8192


@pytest.mark.parametrize("lag", [0, 1])
def test_loop_state_per_row_is_what_the_engine_holds_at_a_step(lag, monkeypatch):
    """The engine's own tensors at the sampler step (the call of `sample_step` in `_sample`: the vocabulary pass,
    where a step peaks) of a pass of 3 requests minus one of 2 are `loop_state_bytes` per request: the
    requests' state, the pass's stacked inputs, the sampler's draws and rules (settings differ: RowRules) and,
    with lag 1, the unsettled previous pass. A step past a block's first, so the soft embedding is held."""
    from dgcli import engine as eng_mod
    from dgcli.engine import runner
    from dgcli.sampling.params import DiffusionEbParams

    model = random_model(make_config(SMALL, canvas_length=8), dtype=torch.bfloat16)
    cfg, held, real = model.config, {}, runner.sample_step
    a, b_ = (DiffusionEbParams(max_denoising_steps=4, stability_threshold=2, entropy_bound=e) for e in (0.1, 0.2))

    def spy(model, hidden, *args, **kw):
        sample, launch = sys._getframe(1), sys._getframe(2)  # ModelRunner._sample, ModelRunner._launch
        eng, p = sample.f_locals["self"], sample.f_locals["p"]
        rows = p.plan.canvases
        if len(rows) not in held and all(r.soft is not None for r in rows) and not p.plan.commits:
            local = {**launch.f_locals, **sample.f_locals}
            tensors = [v for k, v in local.items() if isinstance(v, torch.Tensor) and k != "hidden"]
            tensors += [p.canvas_in, *(t for r in rows for t in (r.canvas, r.history, r.soft))]
            rules = local["rules"]
            tensors += [rules.entropy_bound, rules.confidence_threshold, rules.stability]
            q = eng.pending
            if q is not None:
                tensors += [q.canvas_in, q.accepted, q.next_canvas, q.stop, q.out.sample, q.out.argmax, q.out.entropy,
                            q.out.soft]
            assert (q is not None) == bool(lag)
            held[len(rows)] = _storage_bytes(tensors)
        return real(model, hidden, *args, **kw)

    monkeypatch.setattr(runner, "sample_step", spy)
    for b in (2, 3):
        eng = eng_mod.LLMEngine(model, slots=b, max_len=5 + 8, lag=lag)
        for i in range(b):
            eng.submit(eng_mod.Request(id=i, prompt=torch.tensor([3, 4, 5, 6, 7]), params=[a, b_, a][i], num_blocks=2,
                                       seed=i))
        for _ in eng.events():
            if b in held:
                break
    state = memory.loop_state_bytes(cfg, ab=2, stability=2, lag=lag)
    assert state["soft"] == 2 * 8 * 32 * 2
    assert held[3] - held[2] == state["total"]


@pytest.mark.parametrize("text", [VOCAB_HEAVY, DECODE_HEAVY])
def test_pass_step_and_prefill_temporaries_are_the_cpu_allocators_peak(text, monkeypatch):
    """b = 1 and 3 requests on the CPU paths, against the allocator's peak: a step's pass (each canvas beside its
    commit; `pass_bytes`), the step (that pass, then the sampler's vocabulary pass; the commits' ids are
    made before it here: `step_bytes` counts them in `decode`), and the engine's first prefill pass as its
    scheduler plans it (prompts of 100 ids and their first canvases; `prefill_bytes`, its ids included).
    The vocabulary tiles and the norms in torch: the formula counts their buffers."""
    from dgcli.engine import LLMEngine as Engine, Request
    from dgcli.sampling.params import DiffusionEbParams
    from dgcli.sampling.rules import sample_step

    model = random_model(make_config(text, canvas_length=32), dtype=torch.bfloat16)
    cfg, v, p, c = model.config, text["vocab_size"], 100, 32
    got = {}
    for b in (1, 3):
        eng = Engine(model, slots=b, max_len=p + c)
        for i in range(b):
            eng.submit(Request(id=i, prompt=torch.randint(0, v, (p,)), params=DiffusionEbParams(), num_blocks=2,
                               seed=i))
        plan = eng.sched.plan()
        assert [(s.length, s.canvas) for s in plan.segments] == [(p, False)] * b + [(c, True)] * b
        canvas = torch.randint(0, v, (b * c,))
        pre = _peak_allocated(lambda: model.forward_pass(torch.cat([*plan.causal_ids, canvas]), plan.segments,
                                                         eng.cache))
        # the next block: commits at p..p+c-1 beside canvases at p+c
        segs = [Segment(s, p, c, False) for s in range(b)] + [Segment(s, p + c, c, True) for s in range(b)]
        ids, soft = torch.randint(0, v, (2 * b * c,)), torch.zeros(b, c, cfg.hidden_size, dtype=torch.bfloat16)
        draws = (torch.full((b,), 0.7), torch.full((1, b, c), -1), DiffusionEbParams(),
                 torch.rand(b, c, dtype=torch.float64), torch.randint(0, v, (b, c)))
        one = _peak_allocated(lambda: model.forward_pass(ids, segs, eng.cache, soft))
        step = _peak_allocated(lambda: sample_step(model, model.forward_pass(ids, segs, eng.cache, soft), *draws,
                                                   want_soft=True))
        want_one = memory.pass_bytes(cfg, [(c, p + c, b)], b, 2, cpu=True)
        parts = memory.step_bytes(cfg, b, p + c, 2, cpu=True)
        assert parts["decode"] == want_one + 16 * b * c
        want_step, want_pre = max(want_one, parts["vocab_pass"]), memory.prefill_bytes(cfg, b, p, 2, cpu=True)
        # Not counted: the CPU flash-attention kernel's per-thread scratch (here ~41 KiB: qk fp32 and bf16
        # [32, keys], its fp32 output block [32, d]), which is the peak's when the peak is inside SDPA.
        for measured, want in ((pre, want_pre), (one, want_one), (step, want_step)):
            assert measured == pytest.approx(want, rel=0.01, abs=64 * 2**10)
        got[b] = (step, pre, want_step, want_pre)
    per_row = [(got[3][i] - got[1][i]) / 2 for i in range(4)]
    # The slope within 0.5 %, or within half the uncounted attention scratch (one end of it may carry it).
    assert per_row[0] == pytest.approx(per_row[2], rel=0.005, abs=24 * 2**10)
    assert per_row[1] == pytest.approx(per_row[3], rel=0.005, abs=24 * 2**10)


def test_prefill_pass_follows_the_scheduler(monkeypatch):
    """prefill_bytes' pass is the scheduler's first: prompts (whole, or cut) under the 2,048-row budget,
    the canvases of the prompts it completes (and one more when prompts are split: the next pass ends tails)."""
    cfg = parse_config(make_config(SMALL, canvas_length=8))
    seen = []
    monkeypatch.setattr(memory, "pass_bytes", lambda cfg, causal, canvases, *a, **k: seen.append((causal, canvases)))
    for b, p in ((3, 100), (30, 100), (3, 600), (1, 5000)):
        with pytest.raises(TypeError):  # None + the ids' bytes: the pass is all this test wants
            memory.prefill_bytes(cfg, b, p)
    assert seen == [([(100, 100, 3)], 3), ([(100, 100, 20), (48, 100, 1)], 22), ([(600, 600, 3)], 3),
                    ([(2048, 5000, 1)], 1)]


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
        monkeypatch.setattr(memory_vocab, "SCRATCH_BYTES", chunk * v * ab)
    g = torch.Generator().manual_seed(0)
    hidden, embed = (torch.randn(*shape, generator=g).to(dtype).to(triton_device) for shape in ((1, n, h), (v, h)))
    u = torch.rand(1, n, dtype=torch.float64, generator=g).to(triton_device)
    temp = torch.full((1,), 0.8, device=triton_device)

    def run():
        return vocab_pass.vocab_pass_triton(hidden, embed, softcap=30.0, temperature=temp, embed_scale=2.0,
                                            uniform=u, want_soft=want_soft)
    want = memory_vocab._cuda_vocab(n, h, v, ab, want_soft)
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
        cpu_cast = 0 if want_soft else 8 * n * memory_vocab.GROUP
        assert 0 <= want + cpu_cast - got <= 64 * n  # the formula's allowance for a dozen [N] vectors
    cfg = parse_config(make_config({**SMALL, "vocab_size": v, "hidden_size": h}, canvas_length=n))
    assert memory_vocab.vocab_bytes(cfg, 1, ab) == max(memory_vocab._cuda_vocab(n, h, v, ab, s) for s in (True, False))


@pytest.mark.parametrize("blocks, slots", [([12, 12], 2), ([2, 5, 3, 4], 2)])
def test_a_whole_batched_run_peaks_where_the_formula_says(blocks, slots, monkeypatch):
    """generate_batch_events over one batch of equal requests, and over 4 requests through 2 slots (each
    finished request's slot is taken by the next): the run's peak is its cache, the loop state and the
    larger of prefill and step, as peak_bytes counts them (within the CPU attention kernel's scratch)."""
    from dgcli.engine import generate_batch_events
    from dgcli.sampling.params import DiffusionEbParams

    model = random_model(make_config(VOCAB_HEAVY, canvas_length=32), dtype=torch.bfloat16)
    prompts = [torch.randint(0, 4096, (32,)) for _ in blocks]
    params = DiffusionEbParams(max_denoising_steps=2, confidence_threshold=0.0)
    def run():
        for _ in generate_batch_events(model, prompts, params=params, num_blocks=blocks, max_batch=slots):
            pass

    context = max(32 + (n - 1) * 32 for n in blocks)  # the longest request: its prompt and every block but the last
    want = memory.peak_bytes(model.config, slots, context=context, prompt_len=32, cpu=True)
    assert want["peak_phase"] == "step"
    # The measured peak sits under the formula by up to the soft inputs (2 x [C, H] bf16 a request: 64 KiB for
    # both; 65 KiB and 32 KiB measured): with 2 steps a block, the step that takes a soft embedding in is the
    # block's last, whose vocabulary pass makes none, so the two never meet as the formula counts them. That gap
    # (over 1 % of this small total) is allowed explicitly: one batch's loop state.
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


def test_the_cards_memory_to_run_is_one_slot_of_the_batch_model():
    """`info`'s memory to run: weights + KV + what `peak_bytes` holds for one slot beyond them (one model of the
    passes' temporaries: the one tests/measure checks against the allocator)."""
    cfg = load_config(real_config_path())
    m = info.card(cfg, name="x", source="y", dtype="bfloat16", budgets=[])["memory"]
    for path in ("cuda", "cpu"):
        p = memory.peak_bytes(cfg, 1, context=4096, ab=2, cpu=path == "cpu")
        assert m["one_request"][path] == p["total"] - p["weights"] - p["kv_cache"] > p["phases"]["step"]
        assert m["total"][path] == m["weights"] + m["kv_cache"] + m["one_request"][path]
    assert m["one_request"]["cuda"] > m["one_request"]["cpu"]  # the CUDA graphs' copy of a step


def test_weight_formats():
    cfg = load_config(real_config_path())
    n = info.param_counts(cfg)
    bf16, fp8 = memory.weights_bytes(cfg, "bf16"), memory.weights_bytes(cfg, "fp8")
    assert bf16["bytes"] == (n["total"] - 60) * 2 + 60 * 4 == info.card(
        cfg, name="x", source="y", dtype="bfloat16", budgets=[])["memory"]["weights"]
    quantized = n["attention"] - sum(2 * g.head_dim for g in cfg.layers) + n["dense_mlp"] + n["experts"]
    rows = info.quantized_counts(cfg)[1]  # one bf16 scale per output channel
    assert fp8["fp8_parameters"] == quantized and fp8["bytes"] == bf16["bytes"] - quantized + 2 * rows
    from dgcli.checkpoint.random_weights import with_fp8
    from dgcli.checkpoint.config import parse_config, read_json

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

    assert memory_vocab.GATHER_BYTES == categorical.GATHER_BYTES
    # the engine's: its pass budget and the paged cache's block size (card.cache_positions)
    import inspect

    from dgcli.engine import kv_cache as paged
    from dgcli.engine import llm_engine as engine

    assert memory.BUDGET == engine.DEFAULT_BUDGET
    from dgcli.cli import serve

    assert memory.SERVE_SLOTS == inspect.signature(serve.serve).parameters["max_batch_size"].default
    blocks = {inspect.signature(f).parameters["block_size"].default
              for f in (paged.PagedKVCache.__init__, engine.LLMEngine.__init__, DiffusionGemma.new_cache)}
    assert blocks == {info.KV_BLOCK}
    assert (memory_vocab.CPU_TILE_BYTES, memory_vocab.CPU_TILE_ROWS, memory_vocab.GROUP, memory_vocab.CPU_SOFTMAX_BYTES) == (
        vocab_pass_cpu.TILE_BYTES, vocab_pass_cpu.TILE_ROWS, vocab_pass_cpu.GROUP, vocab_pass_cpu.SOFTMAX_BYTES)
    kernels = Path(categorical.__file__).parent
    triton_src = (kernels / "vocab_pass.py").read_text()

    def const(name):  # a module constant: a literal or a product of literals
        return eval(re.search(rf"^{name} = ([0-9* ]+?) *(#.*)?$", triton_src, re.MULTILINE)[1], {"__builtins__": {}})

    assert (const("SCRATCH_BYTES"), const("VOCAB_SPLITS"), const("SOFT_SPLITS")) == (
        memory_vocab.SCRATCH_BYTES, memory_vocab.VOCAB_SPLITS, memory_vocab.SOFT_SPLITS)
    # vocab_pass_triton's default blocks: block_n is the draw's group width, block_k rounds the soft splits
    assert re.search(rf"^TILE = dict\(BLOCK_M=\d+, BLOCK_N={memory_vocab.GROUP}, BLOCK_K={memory_vocab.SOFT_BLOCK_K}\)\n",
                     triton_src, re.M)
    # the row chunk the formula takes (`_cuda_vocab`'s r) and the split counts as _pass_rows rounds them
    for line in ("min(n, row_chunk or SCRATCH_BYTES // (v * embed.element_size()))",
                 "splits = splits or max(1, min(triton.cdiv(v, bn), VOCAB_SPLITS))",
                 "cols_per_split = triton.cdiv(triton.cdiv(v, splits), bn) * bn",
                 "per_soft = triton.cdiv(triton.cdiv(v, SOFT_SPLITS), block_k) * block_k",
                 "acc = soft_gemm(scratch, embed, bk, soft_tile)"):
        assert line in triton_src, line
    assert re.search(rf"^BLOCK = {memory.MOE_BLOCK}  #", (kernels / "moe.py").read_text(), re.M)
    moe = pytest.importorskip("dgcli.kernels.moe")  # the tuned path's BLOCK_M, mirrored for bf16
    for pairs, e in ((8, 128), (2048, 128), (8192, 128), (8193, 128), (16384, 128), (300, 4)):
        assert memory.moe_block_rows(pairs, e, 2) == moe.block_rows(pairs, e)
        assert memory.moe_block_rows(pairs, e, 4) == moe.BLOCK

def _info(*args):
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["info", *args])
    assert r.exit_code == 0, (r.output, r.exception)
    return r.output


def test_info_dummy_26b_prints_the_batch_table():
    cfg = load_config(real_config_path())
    card = json.loads(_info("--dummy", "26B-A4B", "--no-measure-peaks", "--format", "json"))
    sec = card["batch_memory"]
    kv, state, step = (4352 * 20_480 + 1024 * 25 * 8192, sec["per_slot"]["loop_state"],
                       sec["per_slot"]["step_per_row"]["cuda"])
    # 285 MiB: full layers' 20 KiB a position for the context and a canvas (4,352) and the sliding rings of 1,024
    # (935 MiB when every layer kept every position)
    assert sec["context"] == 4096 and sec["per_slot"]["kv_cache"] == kv
    assert 2.7 * 2**20 < state < 2.9 * 2**20  # mostly two soft embeddings [256, 2816] bf16 (a request's, the stack)
    assert 40 * 2**20 < step < 80 * 2**20  # the canvas and its commit through the layers, then the vocabulary pass
    fits = {(f["memory"], f["weights"]): f for f in sec["fits"]}
    # bf16 on an H100: 72 GiB usable less 47 GiB of weights, over KV + state + a step's share per slot twice (the
    # CUDA graphs' pool holds a captured step beside the eager passes') + the graphs' static ids, inputs and
    # outputs (less a slot's worth of the step's fixed chunks, which keeps the answer within one of this estimate).
    w = memory.weights_bytes(cfg, "bf16")["bytes"]
    h100, h200 = fits[("H100 80 GB", "bf16")], fits[("H200 141 GB", "bf16")]
    estimate = (0.9 * 80 * 2**30 - w) / (kv + state + 2 * step + 2 * 256 * (8 + 2 * 2816 * 2))
    assert h100["largest_batch"] in (int(estimate), int(estimate) - 1) and h100["largest_batch"] == 62
    assert h100["peak_phase"] == "step" and h200["largest_batch"] > h100["largest_batch"]
    for mem in ("H100 80 GB", "H200 141 GB"):
        assert fits[(mem, "fp8")]["largest_batch"] > fits[(mem, "bf16")]["largest_batch"]
    md = _info("--dummy", "26B-A4B", "--no-measure-peaks")
    assert "**largest batch that fits**" in md and "| H100 80 GB (cuda) | bf16 47.03 GiB | 72 GiB | **62** |" in md
    assert "per slot: KV cache 285 MiB" in md and "this machine (cpu)" in md
    assert ("KV cache: 20 KiB/token for full layers (4,352 positions: the context and a canvas) + 200 MiB per slot "
            "for the sliding rings: 285 MiB per slot at 4,096 tokens (without rings, every layer at 220 KiB/token: "
            "935 MiB)") in md


def test_info_memory_and_headroom_options():
    card = json.loads(_info("--dummy", "26B-A4B", "--no-measure-peaks", "--format", "json", "--memory", "100",
                            "--headroom", "0", "--context", "1024"))
    rows = [f for f in card["batch_memory"]["fits"] if f["memory"] == "--memory 100 GiB"]
    assert [f["weights"] for f in rows] == ["bf16", "fp8", "nvfp4"] and rows[0]["usable_bytes"] == 100 * 2**30
    assert rows[0]["path"] == "cpu" and rows[0]["largest_batch"] > 0
    from dgcli.cli import app
    from dgcli.errors import UserError

    for bad in (["--memory", "0"], ["--headroom", "100"]):
        r = CliRunner().invoke(app, ["info", "--dummy", "26B-A4B", "--no-measure-peaks", *bad])
        assert isinstance(r.exception, UserError), bad
