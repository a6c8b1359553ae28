"""The engine as its callers see it: a session keeps one engine across calls (each call's events and counts as a new
engine's), an abandoned call does not leak into the next, and `LLMEngine`'s public API (add_request, cancel, step)
serves a request exactly as the loop does."""

from __future__ import annotations

import dataclasses

import pytest

import dgcli
from dgcli.cli.options import sampler_flags
from dgcli.engine import KeptEngine, LLMEngine, generate_batch_events, generate_events
from dgcli.runtime import request
from dgcli.runtime.session import open_session
from dgcli.sampling.events import Done
from dgcli.text.prompts import read_prompt_file


@pytest.fixture(scope="module")
def bundled():
    session = open_session(None, None, sampler_flags(blocks=2, seed=0, device="cpu", dtype="float32"))
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")
    return session, [request.encode(session, row["prompt"]) for row in rows[:6]]


def answers(session, prompts, stats=None):
    got = dict(request.run_batch(session, prompts, batch_size=2, stats=stats))
    return [(got[i].token_ids, got[i].finish_reason, got[i].done.steps_per_block) for i in range(len(prompts))]


def test_a_session_keeps_its_engine_and_each_call_starts_as_a_new_one(bundled):
    session, prompts = bundled
    batch = [prompts[0], prompts[1], prompts[0]]  # the third hits the first's cached prompt blocks
    first_stats, second_stats = {}, {}
    first = answers(session, batch, first_stats)
    engine = session.engines.engine
    second = answers(session, batch, second_stats)
    assert session.engines.engine is engine  # kept: its cache was not built again
    counts = [{k: v for k, v in st.items() if not k.endswith("_s")} for st in (first_stats, second_stats)]  # not clocks
    assert first == second and counts[0] == counts[1]  # counters at zero, no cached blocks carried over
    assert first_stats["prefix_cache_hits"] > 0 and first_stats["decoder_passes"] > 0
    fresh = {e.row: e for e in generate_batch_events(session.model, batch, params=session.params, num_blocks=2,
                                                      stop_ids=session.stop_ids, pad_id=session.pad_id, max_batch=2,
                                                      prefix_caching=True) if isinstance(e, Done)}
    assert [fresh[i].token_ids for i in range(3)] == [a[0] for a in first]  # as a one-call engine's
    answers(session, [prompts[5]])  # another shape (one slot): another engine, the old one let go
    assert session.engines.engine is not engine


def test_an_abandoned_call_does_not_leak_into_the_next(bundled):
    session, prompts = bundled
    before = request.run(session, prompts[2])
    events = request.stream(session, prompts[2])
    next(events), next(events)  # a consumer that leaves mid-request (watch quit, Ctrl-C in bench)
    events.close()
    after = request.run(session, prompts[2])
    assert (after.token_ids, after.done.steps_per_block) == (before.token_ids, before.done.steps_per_block)


def test_add_request_cancel_and_step_serve_a_request_as_the_loop_does(bundled):
    session, prompts = bundled
    params = dataclasses.replace(session.params, seed=5)
    engine = LLMEngine(session.model, slots=2, max_len=max(map(len, prompts[3:5])) + session.config.canvas_length,
                       pad_id=session.pad_id)
    engine.add_request(prompts[3], request_id=7, params=params, num_blocks=2, stop_ids=session.stop_ids)
    engine.add_request(prompts[4], request_id=9, params=params, num_blocks=2, stop_ids=session.stop_ids)
    rows = [e.row for e in engine.step()]
    assert set(rows) == {7, 9}
    assert engine.cancel(9) and not engine.cancel(11)
    events = []
    while not engine.idle:
        events += list(engine.step())
    assert {e.row for e in events} == {7}  # nothing of the cancelled request after its cancel
    done = next(e for e in events if isinstance(e, Done))
    *_, solo = generate_events(session.model, prompts[3], params=params, num_blocks=2, stop_ids=session.stop_ids,
                               pad_id=session.pad_id)
    assert (done.token_ids, done.steps_per_block) == (solo.token_ids, solo.steps_per_block)


def test_a_kept_engine_is_rebuilt_when_a_call_needs_another_shape(bundled):
    session, _ = bundled
    kept = KeptEngine()
    a = kept.get(session.model, slots=2, max_len=64)
    assert kept.get(session.model, slots=2, max_len=64) is a
    b = kept.get(session.model, slots=2, max_len=80)
    assert b is not a and kept.get(session.model, slots=2, max_len=80) is b
