"""The engine with lag 1 (CUDA's: pass n+1 launched before pass n's stop flags are read, a stopped request's
speculative step discarded) gives every request exactly lag 0's events: the same steps, stop reasons, argmax
canvases, accepted masks, commits and answers. Forced on CPU here; also chunked prefill (a small per-pass
token budget) against whole prompts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dgcli
from dgcli.cli.options import sampler_flags
from dgcli.runtime import request
from dgcli.runtime.session import open_session
from dgcli.engine import LLMEngine as Engine, Request, new_engine
from dgcli.sampling.events import BlockStart, Commit, Done, Step
from dgcli.text.prompts import read_prompt_file


@pytest.fixture(scope="module")
def bundled():
    session = open_session(None, None, sampler_flags(blocks=4, seed=0, device="cpu", dtype="float32"))
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")
    return session, [request.encode(session, row["prompt"]) for row in rows]


def record(ev):
    if isinstance(ev, Step):
        return ("step", ev.block, ev.step, ev.stop_reason, ev.argmax.tolist(), ev.accepted_mask.tolist(),
                ev.next_canvas.tolist(), float(ev.mean_entropy))
    if isinstance(ev, Commit):
        return ("commit", ev.block, ev.tokens, ev.stop_index)
    if isinstance(ev, Done):
        return ("done", ev.token_ids, ev.steps_per_block, ev.finish_reason)
    assert isinstance(ev, BlockStart)
    return ("start", ev.block, ev.prefix_len, ev.canvas.tolist())


def same(a: dict, b: dict, tol: float = 1e-4) -> None:
    """Equal event records, but mean entropies within `tol` (1e-4): in fp32 the two engines may batch a request with
    different batch-mates in a pass, and MKL's small-matrix GEMM rounds differently (1e-6, grown by
    self-conditioning; the fp32 caveat of tests/sampling/test_batch.py). Tokens, masks, steps: exact."""
    assert a.keys() == b.keys()
    for rid in a:
        assert len(a[rid]) == len(b[rid]), rid
        for x, y in zip(a[rid], b[rid]):
            if x[0] == "step":
                assert x[:7] == y[:7] and abs(x[7] - y[7]) < tol, (rid, x[:4], y[:4])
            else:
                assert x == y, rid


def run_jobs(engine, session, jobs, cancel=None) -> dict[int, list]:
    """Submit `jobs` [(ids, params, blocks)] (request id = index, seed = id) and run the engine dry: {request id:
    its events as records}; `cancel` = (id, after its Nth step event) withdraws it."""
    for rid, (ids, params, blocks) in enumerate(jobs):
        engine.submit(Request(id=rid, prompt=torch.tensor(ids), params=params, num_blocks=blocks, seed=rid,
                              stops=set(session.stop_ids)))
    got: dict[int, list] = {}
    for ev in engine.events():
        got.setdefault(ev.row, []).append(record(ev))
        if cancel and ev.row == cancel[0] and sum(r[0] == "step" for r in got[ev.row]) == cancel[1]:
            assert engine.cancel(cancel[0])
    return got


def per_request(lag, session, jobs, slots, cancel=None, **kw):
    """`run_jobs` on a fresh engine of `slots` slots at `lag`, then every block is checked back."""
    engine = Engine(session.model, slots=slots, max_len=400, pad_id=session.pad_id, lag=lag, **kw)
    got = run_jobs(engine, session, jobs, cancel)
    assert engine.idle and engine.sched.free == list(range(slots)) and engine.cache.tables == {}
    assert all(len(p.free) == p.n for p in engine.cache.groups.values())  # every block back
    return got, engine.stats


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_lag_one_gives_every_request_lag_zeros_events(bundled, slots):
    session, prompts = bundled
    p = session.params
    jobs = [(prompts[i], p, 4) for i in range(0, 90, 5)]  # 18 requests through `slots` slots
    sync, _ = per_request(0, session, jobs, slots)
    fast, stats = per_request(1, session, jobs, slots)
    same(fast, sync)
    early = sum(r[3] == "stable_confident" for rows in sync.values() for r in rows if r[0] == "step")
    assert early > 10 and stats["discarded_row_steps"] >= 1  # early stops happened: speculation was discarded


def mixed_jobs(session, prompts) -> list:
    """Five requests with their own settings: fixed work, a deeper stability rule, the defaults, another
    entropy bound and step cap (as (prompt ids, params, blocks))."""
    p = session.params
    return [(prompts[3], dataclasses.replace(p, confidence_threshold=0.0, max_denoising_steps=5), 2),
            (prompts[40], dataclasses.replace(p, stability_threshold=3), 3),
            (prompts[70], p, 4),
            (prompts[11], dataclasses.replace(p, entropy_bound=0.3, max_denoising_steps=7), 3),
            (prompts[55], p, 3)]


def test_mixed_settings_depths_and_a_cancel(bundled):
    session, prompts = bundled
    jobs = mixed_jobs(session, prompts)
    for cancel in (None, (2, 3)):
        sync, _ = per_request(0, session, jobs, 3, cancel)
        fast, _ = per_request(1, session, jobs, 3, cancel)
        same(fast, sync)


def test_new_engine_picks_by_device(bundled):
    session, _ = bundled
    assert new_engine(session.model, slots=1, max_len=64).lag == 0  # CPU: nothing to overlap
    assert new_engine(session.model, lag=1, slots=1, max_len=64).lag == 1


@pytest.mark.parametrize("lag", [0, 1])
def test_chunked_prefill_gives_the_same_tokens(bundled, lag):
    """A per-pass budget of one canvas: prompts are encoded in chunks while other requests denoise. Tokens,
    masks and steps equal the whole-prompt run's (the chunks' attention sums over the same keys; fp32 here)."""
    session, prompts = bundled
    jobs = [(prompts[i], session.params, 3) for i in (2, 30, 61, 77)]
    whole, _ = per_request(lag, session, jobs, 2)
    chunked, stats = per_request(lag, session, jobs, 2, budget=1)
    assert stats["encoder_passes"] > len(jobs) * 2  # prompts took several passes each
    same(chunked, whole)
