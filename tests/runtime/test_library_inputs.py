"""The library's public entries (`dgcli.load_model / open_session / generate`, `request.stream / run / run_batch`)
refuse wrong inputs with one UserError line naming the argument (and, in a batch, the prompt's index) and the
fix, at the call, before anything runs; on the bundled model with 4 denoising steps and one block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dgcli
from dgcli.errors import UserError
from dgcli.runtime import request
from dgcli.runtime.session import BUNDLED
from dgcli.sampling.events import Step
from dgcli.engine import generate_batch_events, generate_events

COUNT = "Count from 7 to 31."


@pytest.fixture(scope="module")
def s():
    return dgcli.open_session(settings={"max_denoising_steps": 4, "max_blocks": 1, "device": "cpu"})


@pytest.fixture(scope="module")
def p(s):
    return request.encode(s, COUNT)


def refused(call, *needles: str) -> str:
    with pytest.raises(UserError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.mark.parametrize("device, needle", [("gpu", "device='gpu': use \"cpu\""), (5, "device=5"),
                                            ("cuda:x", "device='cuda:x'")])
def test_load_model_names_a_bad_device_before_reading_anything(tmp_path, device, needle):
    refused(lambda: dgcli.load_model(tmp_path / "missing", device=device), needle)


def test_load_model_on_cuda_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(lambda: dgcli.load_model(BUNDLED, device="cuda"), "device=cuda: no CUDA device", "use device=cpu")
    refused(lambda: dgcli.load_model(5), "path=5")


@pytest.mark.parametrize("kw, needle", [
    ({"settings": "seed=1"}, "settings='seed=1': give a dict"),
    ({"settings": [("seed", 1)]}, "give a dict"),
    ({"model": 5}, "model=5: give a checkpoint directory"),
    ({"preset": 5}, "preset=5"),
])
def test_open_session_names_the_argument(kw, needle):
    refused(lambda: dgcli.open_session(**kw), needle)


@pytest.mark.parametrize("prompt, needle", [(None, "the prompt is None"), (b"hi", "decode it first"),
                                            ([1, 2], "request.run(session, ids)"), (7, "pass a str")])
def test_generate_takes_text(s, prompt, needle):
    refused(lambda: dgcli.generate(s, prompt), needle)


TEXT_FIX = "pass token ids (request.encode(session, text)) or use dgcli.generate for text"


@pytest.mark.parametrize("ids, needle", [
    ("text", "prompt_ids is text, not token ids; " + TEXT_FIX),
    (None, "prompt_ids is None"),
    (5, "prompt_ids is int"),
    ([1.5, 2.0], "prompt_ids[0] is 1.5; token ids are ints"),
    ([5, 2.0], "prompt_ids[1] is 2.0"),
    ([5, True], "prompt_ids[1] is True"),
    (torch.tensor([5.0, 6.0]), "prompt_ids[0] is 5.0"),
    ([], "prompt_ids is empty"),
    ([5, -1], "prompt_ids[1] = -1 is outside the vocabulary"),
])
def test_stream_and_run_take_token_ids(s, ids, needle):
    refused(lambda: request.stream(s, ids), needle)
    refused(lambda: request.run(s, ids), needle)


def test_integer_tensors_and_arrays_are_token_ids(s, p):
    want = request.run(s, p)
    assert request.run(s, torch.tensor(p)).token_ids == want.token_ids
    assert request.run(s, np.array(p, dtype=np.int32)).prompt_ids == p


def test_run_batch_checks_every_input_at_the_call(s, p):
    v = s.config.vocab_size
    run = request.run_batch
    refused(lambda: run(s, "text", batch_size=2), "prompts is str; pass a list of token-id lists")
    refused(lambda: run(s, ["text"], batch_size=2), "prompts[0] is text", TEXT_FIX)
    refused(lambda: run(s, [p, [1.5, 2.0]], batch_size=2), "prompts[1][0] is 1.5")
    refused(lambda: run(s, [p, []], batch_size=2), "prompts[1] is empty")
    refused(lambda: run(s, [p, p, [3, v]], batch_size=2), f"prompts[2][1] = {v} is outside the vocabulary")
    refused(lambda: run(s, [p] * 5, batch_size=2, seeds=[1, 2]), "seeds has 2 items for 5 prompts")
    refused(lambda: run(s, [p], batch_size=2, seeds=["a"]), "seeds[0] is 'a'; a seed is a whole number")
    refused(lambda: run(s, [p], batch_size=2, seeds=7), "seeds is int; give a list")
    refused(lambda: run(s, [p, p], batch_size=2, init_canvases=[None]), "init_canvases has 1 items for 2 prompts")
    refused(lambda: run(s, [p, p], batch_size=2, init_canvases=[None, [5, 6]]),
            f"init_canvases[1] has 2 ids; the canvas holds {s.config.canvas_length}", "request.fill_canvas")
    long = [5] * (s.config.max_position_embeddings)
    refused(lambda: run(s, [p, long], batch_size=2), "prompts[1]: the prompt", "exceed the model's context")


def test_run_batch_reads_any_iterable(s, p):
    q = request.encode(s, "Count from 3 to 9.")
    want = dict(request.run_batch(s, [p, q], batch_size=2, seeds=[1, 2]))
    got = dict(request.run_batch(s, (ids for ids in (p, q)), batch_size=2, seeds=iter([1, 2])))
    assert {i: r.token_ids for i, r in got.items()} == {i: r.token_ids for i, r in want.items()}
    assert list(request.run_batch(s, iter(()), batch_size=2)) == []


def test_generate_reads_a_text_init_canvas_as_the_cli_does(s, p):
    """A str is read as --init-canvas is (text or ids:), the rest seeded noise; ids must be a whole canvas."""
    for spec in ("1 2 3", "ids:5,6,7"):
        canvas = request.fill_canvas(s, request.read_init_canvas(s, spec)[0], s.params.seed)
        seen, want = [], []
        got = dgcli.generate(s, COUNT, init_canvas=spec, on_event=seen.append)
        assert got.token_ids == request.run(s, p, init_canvas=canvas, on_event=want.append).token_ids
        first = [next(e for e in events if isinstance(e, Step)).canvas_in.tolist() for events in (seen, want)]
        assert first == [canvas, canvas]  # the first step starts from the canvas the CLI builds
    refused(lambda: dgcli.generate(s, COUNT, init_canvas=""), "init_canvas is empty")
    refused(lambda: dgcli.generate(s, COUNT, init_canvas=[5, 6]), "init_canvas has 2 ids", "read_init_canvas")
    refused(lambda: request.stream(s, p, init_canvas="1 2 3"), "init_canvas is text", "dgcli.generate takes text")


def test_the_batched_loop_names_each_argument(s, p):
    """`generate_batch_events` (the loop's entry, under run_batch): lengths per argument, no truncated float ids."""
    kw = {"params": s.params, "num_blocks": 1}
    refused(lambda: list(generate_batch_events(s.model, [p, p], seeds=[1], **kw)), "seeds has 1 items for 2 prompts")
    refused(lambda: list(generate_batch_events(s.model, [p, p], params=s.params, num_blocks=[1])),
            "num_blocks has 1 items for 2 prompts")
    refused(lambda: list(generate_batch_events(s.model, [p], seeds=["3"], **kw)), "seeds[0] is '3'")
    refused(lambda: list(generate_batch_events(s.model, [p, [s.config.vocab_size]], **kw)),
            f"prompts[1][0] = {s.config.vocab_size} is outside the vocabulary")
    refused(lambda: list(generate_events(s.model, [1.5, 2.0], **kw)), "prompt[0] is 1.5; token ids are ints")
    refused(lambda: list(generate_events(s.model, torch.tensor([1.5, 2.0]), **kw)), "integer tensor")
    refused(lambda: list(generate_events(s.model, "text", **kw)), "integer tensor")
