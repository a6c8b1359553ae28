"""Many requests through the one loop (`generate_batch_events`, `request.run_batch`): every row equals its
solo run and its batch-mates and order do not matter (bundled model, fp32), and batched agreement with
transformers' batched `generate` (left padding, per-row canvases) on a deterministic copy model."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import dgcli
from dgcli.cli.options import sampler_flags
from dgcli.runtime import request
from dgcli.runtime.session import open_session
from dgcli.sampling.events import BlockStart, Commit, Done, Step
from dgcli.engine import generate, generate_batch_events, generate_events
from dgcli.sampling.params import DiffusionEbParams
from dgcli.text.prompts import read_prompt_file


@pytest.fixture(scope="module")
def bundled():
    session = open_session(None, None, sampler_flags(blocks=4, seed=0, device="cpu", dtype="float32"))
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")
    return session, [request.encode(session, row["prompt"]) for row in rows]


def answers(session, prompts, batch_size, order, **kw):
    """{input index: (token ids, steps per block)} for the prompts run in `order`."""
    got = {}
    for i, r in request.run_batch(session, [prompts[j] for j in order], batch_size=batch_size, **kw):
        got[order[i]] = (r.token_ids, r.done.steps_per_block, r.finish_reason)
    return got


def shuffled(n):
    order = list(range(n))
    random.Random(0).shuffle(order)
    return order


ORDERS = {"in order": lambda n: list(range(n)), "reversed": lambda n: list(reversed(range(n))), "shuffled": shuffled}


@pytest.mark.parametrize("size,order", [(8, "shuffled"), pytest.param(3, "in order", marks=pytest.mark.slow),
                                        pytest.param(8, "reversed", marks=pytest.mark.slow)])
def test_batch_size_and_order_do_not_change_any_answer(bundled_heldout, size, order):
    """Every held-out prompt: the same tokens and steps alone (the session's shared solo runs, tests/conftest.py)
    as in batches of 8 shuffled, of 3 in order and of 8 reversed (the last two: slow). The batch shapes
    differ (ragged prompts, rows leaving as they finish), so any row whose numbers depended on its
    batch-mates would show here; none does on this model (fp32, CPU)."""
    session, prompts, responses = bundled_heldout
    n = len(prompts)
    solo = {i: (r.token_ids, r.done.steps_per_block, r.finish_reason) for i, r in enumerate(responses)}
    assert len({len(s) for _, s, _ in solo.values()}) > 1, "rows must end after different numbers of blocks"
    assert len({tuple(s) for _, s, _ in solo.values()}) > 3, "rows must take different numbers of steps"
    got = answers(session, prompts, size, ORDERS[order](n))
    differ = [i for i in range(n) if got[i] != solo[i]]
    assert not differ, f"batch {size} {order}: rows {differ[:5]} differ from their solo runs"


def test_rows_with_their_own_seeds_caps_and_canvases_equal_their_solo_runs(bundled):
    session, prompts = bundled
    params = session.params
    picks = [0, 31, 62, 63, 93, 95]
    seeds = [0, 7, 2**40, 3, 0, 11]
    caps = [4, 1, 2, 4, 3, 1]
    c = session.config.canvas_length
    inits = [None, list(range(5, 5 + c)), None, None, [9] * c, None]
    batch = list(generate_batch_events(session.model, [prompts[i] for i in picks], params=params, num_blocks=caps,
                                       seeds=seeds, stop_ids=session.stop_ids, init_canvases=inits))
    for r, i in enumerate(picks):
        mine = [e for e in batch if e.row == r]
        solo = list(generate_events(session.model, prompts[i], params=DiffusionEbParams(**{**params.__dict__,
                                    "seed": seeds[r]}), num_blocks=caps[r], stop_ids=session.stop_ids,
                                    init_canvas=inits[r]))
        assert [type(e) for e in mine] == [type(e) for e in solo], r
        done, want = mine[-1], solo[-1]
        assert isinstance(done, Done)
        assert (done.token_ids, done.steps_per_block, done.finish_reason) == \
            (want.token_ids, want.steps_per_block, want.finish_reason), r
        assert done.blocks <= caps[r]
        for a, b in zip(mine, solo):
            if isinstance(a, Step):
                assert torch.equal(a.sample, b.sample) and torch.equal(a.canvas_in, b.canvas_in)
            if isinstance(a, BlockStart):
                assert a.prefix_len == b.prefix_len and torch.equal(a.canvas, b.canvas)
            if isinstance(a, Commit):
                assert a.tokens == b.tokens
    # a row frozen by the stop rule emits no more steps while its batch-mates go on
    steps = {(e.row, e.block): e.step for e in batch if isinstance(e, Step)}
    assert len({s for (r, b), s in steps.items() if b == 0}) > 1


def test_bad_batch_inputs_are_one_line_errors(bundled):
    session, prompts = bundled
    from dgcli.errors import UserError

    with pytest.raises(UserError, match="batch-size"):
        list(request.run_batch(session, prompts[:2], batch_size=0))
    with pytest.raises(UserError, match="initial canvas has 3 ids"):
        list(generate_batch_events(session.model, prompts[:2], params=session.params, num_blocks=1,
                                   init_canvases=[None, [1, 2, 3]]))
    with pytest.raises(UserError, match="seed"):
        list(generate_batch_events(session.model, prompts[:2], params=session.params, num_blocks=1, seeds=[0, -1]))


def test_continuous_batching_through_four_slots(bundled):
    """24 requests of mixed prompt lengths, block caps and seeds through 4 slots: each result equals its
    solo run, requests join as slots free up at block boundaries, and the batch needs well under half
    the decoder passes the requests take one by one."""
    session, prompts = bundled
    params = session.params
    picks = list(range(0, 96, 4))[:24]
    caps = [1 + (i % 4) for i in range(24)]
    seeds = [(i * 7919) % 1000 for i in range(24)]
    chosen = [prompts[i] for i in picks]
    assert len({len(p) for p in chosen}) >= 5
    stats = {}
    events = list(generate_batch_events(session.model, chosen, params=params, num_blocks=caps, seeds=seeds,
                                        stop_ids=session.stop_ids, max_batch=4, stats=stats))
    dones = {e.row: e for e in events if isinstance(e, Done)}
    solo_passes = 0
    for r in range(24):
        want = generate(session.model, chosen[r], params=dataclasses.replace(params, seed=seeds[r]),
                        num_blocks=caps[r], stop_ids=session.stop_ids)
        got = dones[r]
        assert (got.token_ids, got.steps_per_block, got.finish_reason) == \
            (want.token_ids, want.steps_per_block, want.finish_reason), r
        solo_passes += want.decoder_passes
    # Never more than 4 rows at once; later requests started only after earlier ones finished.
    assert stats["row_steps"] <= 4 * stats["decoder_passes"]
    first_start = {}
    for i, e in enumerate(events):
        if isinstance(e, BlockStart):
            first_start.setdefault(e.row, i)
    done_at = {e.row: i for i, e in enumerate(events) if isinstance(e, Done)}
    assert first_start[4] > min(done_at.values())
    assert stats["decoder_passes"] < solo_passes / 2, (stats, solo_passes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_model_rows_are_bit_identical_at_every_batch_size(tmp_path, dtype):
    """A random model (never confident: every draw and every rounding shows) with prompts of five lengths:
    each row's step events are the same alone and in batches of 2, 3 and 5. bf16: bit for bit (samples,
    argmaxes, entropies). What makes this hold: ragged rows attend one by one over exactly their own keys
    (a masked, longer key range rounds differently), the CPU vocabulary tiles have a width that does not
    depend on the row count, and oneDNN's bf16 GEMM rows do not depend on their batch-mates at these widths (on a
    CPU with AMX they do at real widths: oneDNN picks its AMX kernel by the row count; benchmarks/RESULTS.md,
    "Eighteenth session").
    fp32: samples and argmaxes bit for bit, entropies within 1e-3 (not bit for bit: ~1e-6 at a block's
    first step, grown to ~1e-4 by self-conditioning four steps later, measured). The cause: MKL's fp32
    GEMM takes a small-matrix kernel for 1-2 rows (an expert that gets one or two of a request's tokens),
    which rounds differently from the same rows inside a larger GEMM (measured: 1-6e-6 apart at M = 1, 2;
    equal from M = 5 on), and a batch gives that expert more rows."""
    from hf_oracle import CLI_CANVAS, CLI_TEXT

    from dgcli.checkpoint.random_weights import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "ck", CLI_TEXT, canvas_length=CLI_CANVAS, dtype=dtype, tokenizer=False)
    model = dgcli.load_model(path)
    assert model.embed_weight.dtype == dtype
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (5, 19, 9, 12, 30)]
    params = DiffusionEbParams(max_denoising_steps=4, confidence_threshold=0.0)

    def steps(max_batch):
        return {(e.row, e.block, e.step): e for e in generate_batch_events(
            model, prompts, params=params, num_blocks=2, seeds=[1, 2, 3, 4, 5], max_batch=max_batch)
            if isinstance(e, Step)}

    solo = steps(1)
    assert len(solo) == 5 * 2 * 4
    for size in (2, 3, 5):
        got = steps(size)
        for k, want in solo.items():
            x = got[k]
            assert torch.equal(x.sample, want.sample) and torch.equal(x.argmax, want.argmax), (size, k)
            if dtype == torch.bfloat16:
                assert torch.equal(x.entropy, want.entropy), (size, k)
            else:
                torch.testing.assert_close(x.entropy, want.entropy, rtol=0, atol=1e-3)


def test_rows_with_their_own_sampler_settings_equal_their_solo_runs(bundled):
    """Requests that differ in every setting that keeps the shapes (steps, temperatures, entropy bound,
    stability and confidence thresholds, seed, block cap) share 3 slots; each equals its solo run, and a
    row with 48 steps per block does not make a row with 4 run more than its own."""
    session, prompts = bundled
    base = session.params
    settings = [dict(max_denoising_steps=4), dict(t_min=0.2, t_max=1.2), dict(entropy_bound=0.3),
                dict(stability_threshold=2), dict(stability_threshold=0, confidence_threshold=0.02),
                dict(confidence_threshold=0.0, max_denoising_steps=6), dict(seed=9), {}]
    params = [dataclasses.replace(base, **kw) for kw in settings]
    picks = [1, 33, 65, 90, 7, 40, 70, 94]
    chosen = [prompts[i] for i in picks]
    caps = [2, 3, 1, 4, 2, 1, 3, 2]
    dones = {e.row: e for e in generate_batch_events(session.model, chosen, params=params, num_blocks=caps,
                                                     stop_ids=session.stop_ids, max_batch=3)
             if isinstance(e, Done)}
    for r in range(len(chosen)):
        want = generate(session.model, chosen[r], params=params[r], num_blocks=caps[r], stop_ids=session.stop_ids)
        got = dones[r]
        assert (got.token_ids, got.steps_per_block, got.finish_reason) == \
            (want.token_ids, want.steps_per_block, want.finish_reason), (r, settings[r])
        assert max(got.steps_per_block) <= params[r].max_denoising_steps
    assert dones[5].steps_per_block == [6]  # fixed work: exactly its own 6 steps


def test_rows_with_their_own_stop_ids(bundled):
    """One prompt twice: the row that may stop at the model's end-of-turn stops there; the row whose only
    stop id never appears runs out of blocks (finish_reason length), as the same row alone does."""
    session, prompts = bundled
    p = prompts[0]
    dones = {e.row: e for e in generate_batch_events(session.model, [p, p], params=session.params, num_blocks=2,
                                                     stop_ids=[list(session.stop_ids), [session.config.vocab_size - 1]])
             if isinstance(e, Done)}
    solo = generate(session.model, p, params=session.params, num_blocks=2, stop_ids=[session.config.vocab_size - 1])
    assert dones[0].finish_reason == "stop" and dones[1].finish_reason == "length"
    assert (dones[1].token_ids, dones[1].steps_per_block) == (solo.token_ids, solo.steps_per_block)
    with pytest.raises(Exception, match="one set of stop ids each"):
        list(generate_batch_events(session.model, [p, p], params=session.params, num_blocks=1, stop_ids=[[1]]))


def test_a_request_submitted_while_the_engine_runs_joins_at_the_next_pass(bundled):
    """The server's case: requests arrive while others denoise. One submitted between two events of a
    running engine takes the free slot at the next pass and equals its solo run."""
    from dgcli.engine import LLMEngine as Engine, Request

    session, prompts = bundled
    p = session.params
    engine = Engine(session.model, slots=2, max_len=200)

    def request(i, rid, blocks):
        return Request(id=rid, prompt=torch.tensor(prompts[i]), params=p, num_blocks=blocks, seed=rid,
                       stops=set(session.stop_ids))

    engine.submit(request(40, 0, 3))
    seen, late_submitted = [], False
    for ev in engine.events():
        seen.append(ev)
        if not late_submitted and isinstance(ev, Step) and ev.row == 0 and ev.step == 1:
            engine.submit(request(70, 1, 2))  # arrives while request 0 runs
            late_submitted = True
    dones = {e.row: e for e in seen if isinstance(e, Done)}
    first_of_1 = next(i for i, e in enumerate(seen) if e.row == 1)
    assert isinstance(seen[first_of_1], BlockStart) and any(isinstance(e, Step) and e.row == 0
                                                            for e in seen[:first_of_1])
    for rid, i, blocks in ((0, 40, 3), (1, 70, 2)):
        want = generate(session.model, prompts[i], params=dataclasses.replace(p, seed=rid), num_blocks=blocks,
                        stop_ids=session.stop_ids)
        assert (dones[rid].token_ids, dones[rid].steps_per_block) == (want.token_ids, want.steps_per_block)
    assert engine.idle
    with pytest.raises(Exception, match="cache positions"):
        engine.submit(request(40, 2, 20))  # 20 blocks do not fit a 200-position slot


def test_cancelled_requests_leave_and_the_others_keep_their_solo_answers(bundled):
    """The server's disconnects: a queued request withdrawn never runs; a running one withdrawn mid-block
    frees its slot before the next pass (no more events, no Done) and the next queued request takes it;
    the rest equal their solo runs."""
    from dgcli.engine import LLMEngine as Engine, Request

    session, prompts = bundled
    p = session.params
    engine = Engine(session.model, slots=2, max_len=200)
    jobs = {0: 40, 1: 70, 2: 5, 3: 60}  # request id -> prompt index
    for rid, i in jobs.items():
        engine.submit(Request(id=rid, prompt=torch.tensor(prompts[i]), params=p, num_blocks=3, seed=rid,
                              stops=set(session.stop_ids)))
    assert engine.cancel(3) and not engine.cancel(99)  # 3 is still queued: it leaves at once
    seen, cut_at = [], None
    for ev in engine.events():
        seen.append(ev)
        if cut_at is None and isinstance(ev, Step) and ev.row == 1 and ev.step == 1:
            assert engine.cancel(1)  # running, mid-block
            cut_at = len(seen)
    assert cut_at is not None
    assert not any(e.row == 1 for e in seen[cut_at:]) and not any(e.row == 3 for e in seen)
    dones = {e.row: e for e in seen if isinstance(e, Done)}
    assert set(dones) == {0, 2}
    for rid in (0, 2):
        want = generate(session.model, prompts[jobs[rid]], params=dataclasses.replace(p, seed=rid), num_blocks=3,
                        stop_ids=session.stop_ids)
        assert (dones[rid].token_ids, dones[rid].steps_per_block) == (want.token_ids, want.steps_per_block)
    assert engine.idle and engine.sched.free == [0, 1] and engine.cache.tables == {}
