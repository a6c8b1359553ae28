"""CUDA graphs of decode-only passes (model/graphs.py): the engine with graphs gives every request the events of
the engine without (tokens, masks, steps exact), with padded buckets, requests joining and leaving, and the
mixed passes (prompts, commits) run eagerly. On CUDA the graphs are captured and replayed; on the CPU the same
static path runs eagerly over the paged Triton kernel in the interpreter (the backend forced: it is the only
one whose block tables a graph can take as inputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine_lag import bundled, run_jobs, same  # noqa: F401  (fixture)

from dgcli.cli.options import sampler_flags
from dgcli.model import attention
from dgcli.model.attention import PassLayout, Segment
from dgcli.model.graphs import buckets
from dgcli.runtime.session import open_session
from dgcli.engine import LLMEngine as Engine, new_engine


@pytest.fixture(scope="module")
def graph_session(bundled):
    """(session, prompts) where graphs run: the bundled model (fp32) on CUDA where there is one (real captures),
    else on the CPU (the static path eagerly, over the interpreted kernel: see `paged_kernel`)."""
    if not torch.cuda.is_available():
        return bundled
    session = open_session(None, None, sampler_flags(blocks=4, seed=0, device="cuda", dtype="float32"))
    return session, bundled[1]


@pytest.fixture
def paged_kernel(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(attention, "backend", lambda device: "triton-paged")
        import dgcli.model.graphs as graphs

        monkeypatch.setattr(graphs, "backend", lambda device: "triton-paged")


def events(session, jobs, slots, graphs, prefix_caching=False):
    engine = Engine(session.model, slots=slots, max_len=200, pad_id=session.pad_id, graphs=graphs,
                    prefix_caching=prefix_caching)
    got = run_jobs(engine, session, jobs)
    assert engine.idle and engine.sched.free == list(range(slots))
    return got, engine


def test_buckets():
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_graphs_give_the_dynamic_engines_events(graph_session, paged_kernel, prefix_caching):
    session, prompts = graph_session
    p = dataclasses.replace(session.params, max_denoising_steps=6)
    fixed = dataclasses.replace(p, confidence_threshold=0.0)  # no early stop: decode-only passes between commits
    # 3 requests in 4 slots (a bucket of 4: one padding canvas), then 2 and 1 as they finish (other lengths)
    jobs = [(prompts[3], fixed, 2), (prompts[40], p, 3), (prompts[70], dataclasses.replace(fixed, max_denoising_steps=4), 1)]
    want, plain = events(session, jobs, 4, graphs=False, prefix_caching=prefix_caching)
    got, engine = events(session, jobs, 4, graphs=True, prefix_caching=prefix_caching)
    same(got, want)
    assert plain.stats["graph_passes"] == 0 and engine.stats["graph_passes"] >= 4
    assert engine.stats["graph_passes"] < engine.stats["decoder_passes"]  # commits and prompts ran eagerly
    assert sorted(engine.graphs.static) in ([1, 2], [1, 2, 4], [2, 4], [1, 4])
    assert engine.graphs.replays == (engine.stats["graph_passes"] if torch.cuda.is_available() else 0)
    assert list(engine.cache.tables) == [4]  # only the padding sequence holds blocks once every request left
    if prefix_caching:  # the same prompts twice: the second encodes only what the first did not cache
        assert engine.stats["prefix_cache_hits"] == plain.stats["prefix_cache_hits"]


def test_a_layout_loads_only_the_same_shape(bundled):
    session, _ = bundled
    cache = session.model.new_cache(3, 64)
    for seq in range(3):
        cache.reserve(seq, 48)
    c = session.model.config.canvas_length
    a = PassLayout([Segment(0, 16, c, True), Segment(1, 0, c, True)], cache, "cpu", every_seq=True)
    a.kernel_meta("full", None, 4, True)
    b = PassLayout([Segment(2, 32, c, True), Segment(0, 8, c, True)], cache, "cpu", every_seq=True)
    a.load(b)
    assert torch.equal(a.positions, b.positions)
    assert all(torch.equal(x, y) for x, y in zip(a.kernel_meta("full", None, 4, True), b.kernel_meta("full", None, 4, True)))
    assert a.kernel_meta("full", None, 4, True)[3].shape == (3, cache.full_blocks)  # every sequence, fixed width
    with pytest.raises(ValueError, match="same segment lengths"):
        a.load(PassLayout([Segment(0, 16, c, True)], cache, "cpu", every_seq=True))


def test_new_engine_builds_graphs_for_the_graphs_step_mode(graph_session, paged_kernel):
    session, _ = graph_session
    assert new_engine(session.model, step_mode="graphs", slots=2, max_len=64).graphs is not None
    assert new_engine(session.model, slots=2, max_len=64).graphs is None


def test_a_graphs_engine_is_kept_for_the_next_run_of_the_same_shape(graph_session, paged_kernel):
    """bench's runs and sweep's points reuse their session's engine of the same shape (`Session.engines`: its graph
    captures too); each run's stats are its own."""
    from dgcli.engine import KeptEngine, generate_batch_events

    kept = KeptEngine()  # what a session holds
    session, prompts = graph_session
    p = dataclasses.replace(session.params, max_denoising_steps=3, confidence_threshold=0.0)
    runs = []
    for _ in range(2):
        stats: dict = {}
        done = [ev for ev in generate_batch_events(session.model, [prompts[5], prompts[5]], params=p, num_blocks=2,
                                                   pad_id=session.pad_id, stats=stats, step_mode="graphs",
                                                   prefix_caching=True, max_batch=1, engines=kept)
                if type(ev).__name__ == "Done"]
        runs.append(([d.token_ids for d in done], stats, kept.engine))
    (tokens_a, stats_a, engine_a), (tokens_b, stats_b, engine_b) = runs
    assert engine_a is engine_b and tokens_a == tokens_b
    assert stats_a["decoder_passes"] == stats_b["decoder_passes"] > 0 and stats_b["graph_passes"] > 0
    # each run starts cold: the second hits only what its own first request cached, as the first run did
    assert stats_a["prefix_cache_hits"] == stats_b["prefix_cache_hits"] > 0
