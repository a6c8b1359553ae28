"""The static-shape denoising step (dgcli/sampling/static_step.py), what CUDA graphs capture and what
torch.compile compiles whole: through the engine it gives every request the dynamic step's events on the
bundled model (ragged rows, continuous batching, mixed settings, a cancel, the async-stop engine); traced as
one graph (dynamo, fullgraph=True: no host read anywhere in the step) it gives exactly the eager static
step's events on a random bf16 checkpoint; compiled (inductor) it gives the same tokens and step counts on the
bundled held-out set."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from test_async_stop import bundled, mixed_jobs, per_request, same  # noqa: F401  (bundled: a fixture)

from dgcli.sampling import static_step
from dgcli.sampling.async_stop import AsyncStopEngine
from dgcli.sampling.engine import Engine
from dgcli.sampling.events import Done
from dgcli.sampling.loop import generate_batch_events
from dgcli.sampling.params import DiffusionEbParams
from dgcli.sampling.static_step import StaticStep, key_span


def test_key_span_buckets():
    assert [key_span(n, 10_000) for n in (0, 1, 256, 257, 600, 4096, 4097)] == [256, 256, 256, 512, 1024, 4096, 8192]
    assert key_span(300, 400) == 400 and key_span(5, 40) == 40  # capped by the cache
    with pytest.raises(ValueError, match="do not fit"):
        key_span(41, 40)


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_static_step_gives_every_request_the_dynamic_events(bundled, slots):  # noqa: F811
    """18 held-out prompts through `slots` slots (ragged lengths, requests joining and leaving): the same
    tokens, masks, steps and stop reasons as the dynamic step; mean entropies within 1e-4 (fp32)."""
    session, prompts = bundled
    jobs = [(prompts[i], session.params, 4) for i in range(0, 90, 5)]
    dynamic, _ = per_request(Engine, session, jobs, slots)
    static, _ = per_request(functools.partial(Engine, step_mode="static"), session, jobs, slots)
    same(static, dynamic)


def test_mixed_settings_a_cancel_and_the_async_engine(bundled):  # noqa: F811
    """Per-row settings (steps, entropy bound, stability depth, fixed work), a request withdrawn mid-block, and
    the engine that reads stop flags one pass later (the CUDA engine) running the static step."""
    session, prompts = bundled
    jobs = mixed_jobs(session, prompts)
    for cancel in (None, (2, 3)):
        dynamic, _ = per_request(Engine, session, jobs, 3, cancel)
        static, _ = per_request(functools.partial(Engine, step_mode="static"), session, jobs, 3, cancel)
        fast, _ = per_request(functools.partial(AsyncStopEngine, step_mode="static"), session, jobs, 3, cancel)
        same(static, dynamic)
        same(fast, dynamic)


def test_cuda_graphs_need_cuda(bundled):  # noqa: F811
    session, _ = bundled
    cache = session.model.new_cache(1, 64)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticStep(session.model, cache, "graphs")
    with pytest.raises(ValueError, match="use one of static, compile, graphs"):
        StaticStep(session.model, cache, "eager")


def _events(model, prompts, mode):
    """Per-row settings: fixed work, a request that stops at once (no stability rule, always confident), and
    the defaults (random weights never settle: they run to the cap)."""
    p = DiffusionEbParams(max_denoising_steps=6)
    params = [dataclasses.replace(p, confidence_threshold=0.0), dataclasses.replace(p, stability_threshold=0,
              confidence_threshold=10.0), p]
    return {e.row: (e.token_ids, e.steps_per_block) for e in generate_batch_events(
        model, prompts, params=params, num_blocks=3, max_batch=2, step_mode=mode) if isinstance(e, Done)}


@pytest.mark.slow
def test_the_whole_step_is_one_graph_and_replays_the_eager_step(monkeypatch):
    """bf16 random checkpoint (routed experts on F.grouped_mm, the CPU vocabulary tiles): dynamo traces the
    whole step with fullgraph=True (a host read or a data-dependent branch anywhere would fail it) for every
    batch size and variant the engine meets, and the traced step's events equal the eager static step's.
    Backend "eager" runs the captured graph op for op: this checks the capture, not inductor's code."""
    from hf_oracle import text_config

    import torch._dynamo as dynamo

    from dgcli.model.random_weights import make_config, random_model

    tc, c = text_config("gqa4_moe8")
    model = random_model(make_config(dict(tc, moe_intermediate_size=16), canvas_length=c), seed=1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (5, 17, 9)]
    compile_ = torch.compile
    monkeypatch.setattr(static_step.torch, "compile", lambda fn: compile_(fn, fullgraph=True, backend="eager"))
    dynamo.reset()
    traced = _events(model, prompts, "compile")
    assert traced == _events(model, prompts, "static")
    assert [traced[r][1] for r in range(3)] == [[6, 6, 6], [1, 1, 1], [6, 6, 6]]


@pytest.mark.slow
def test_compiled_whole_step_gives_the_eager_tokens_on_the_held_out_set(bundled):  # noqa: F811
    """inductor's code for the whole step, on 24 held-out prompts at batch 8: the tokens and step counts of
    the eager static step (and so of the dynamic one)."""
    session, prompts = bundled
    rows = prompts[::4]
    run = functools.partial(generate_batch_events, session.model, rows, params=session.params, num_blocks=4,
                            stop_ids=session.stop_ids, pad_id=session.pad_id, max_batch=8)
    got = {mode: {e.row: (e.token_ids, e.steps_per_block) for e in run(step_mode=mode) if isinstance(e, Done)}
           for mode in ("static", "compile", "dynamic")}
    assert got["compile"] == got["static"] == got["dynamic"]


class _FakeGraph:
    """A CUDA graph's contract on CPU: capture records the step without its results (the output buffers hold
    junk until a replay); a replay reruns the step on the input buffers as they are now and writes the same
    output buffers."""

    capturing = None

    def __init__(self):
        self.body, self.outputs, self.replays = None, None, 0

    def replay(self):
        self.replays += 1
        for out, new in zip(self.outputs, self.body()):
            if out is not None:
                out.copy_(new)


def test_graph_replays_give_the_dynamic_events(bundled, monkeypatch):  # noqa: F811
    """The graph orchestration (a graph per batch size, span and variant; inputs copied in, outputs copied out
    before the next replay overwrites them), with CUDA's graph API stood in for on CPU by `_FakeGraph`: every
    request's events equal the dynamic step's, graphs are captured once per shape and reused by later engines."""
    import contextlib

    from dgcli.sampling import engine as engine_module

    step = static_step._step

    def recording_step(*args):
        out = step(*args)
        g = _FakeGraph.capturing
        if g is not None:
            g.body, g.outputs = (lambda: step(*args)), out
        return out

    @contextlib.contextmanager
    def graph(g, pool=None):
        _FakeGraph.capturing = g
        yield
        _FakeGraph.capturing = None
        for t in g.outputs:
            if t is not None:
                t.fill_(-7 if not t.is_floating_point() else float("nan"))  # nothing computed until a replay

    class Stream:
        def wait_stream(self, other):
            pass

    class CpuGraphs(StaticStep):
        def __init__(self, model, cache, mode):
            super().__init__(model, cache, "static")
            self.mode = "graphs"

    cuda = static_step.torch.cuda
    for name, fake in dict(Stream=Stream, current_stream=Stream, stream=lambda s: contextlib.nullcontext(),
                           CUDAGraph=_FakeGraph, graph=graph).items():
        monkeypatch.setattr(cuda, name, fake)
    monkeypatch.setattr(static_step, "_step", recording_step)
    monkeypatch.setattr(engine_module, "StaticStep", CpuGraphs)
    session, prompts = bundled
    jobs = [(prompts[i], session.params, 4) for i in range(0, 90, 9)]
    dynamic, _ = per_request(Engine, session, jobs, 3)
    passes = 0
    for _ in range(2):  # the second engine finds the first one's graphs
        graphs, stats = per_request(functools.partial(Engine, step_mode="graphs"), session, jobs, 3)
        same(graphs, dynamic)
        passes += stats["decoder_passes"]
    held = session.model.__dict__["_static_step"]
    assert held.key[2] == "graphs"
    assert 3 <= len(held.graphs) <= 12  # batch sizes 1-3 x variants, captured once for both engines
    assert sum(g.graph.replays for g in held.graphs.values()) == passes  # every pass a replay
