"""The request API (dgcli/runtime/request.py) on the bundled model: one cut at stop ids and max_tokens for
every command, the event stream and the response agree, init-canvas ids, and bad prompts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dgcli.cli import app
from dgcli.cli.options import sampler_flags
from dgcli.errors import UserError
from dgcli.runtime import request
from dgcli.runtime.session import open_session
from dgcli.sampling.events import BlockStart, Done, Step

COUNT = "Count from 7 to 31."  # the bundled model answers it over 2 blocks


def session_with(**flags):
    return open_session(None, None, sampler_flags(device="cpu", **flags))


def test_generate_matches_its_own_event_stream():
    s = session_with(blocks=4)
    r = request.generate(s, COUNT)
    events = list(request.stream(s, r.prompt_ids))
    done = events[-1]
    assert isinstance(done, Done) and done.token_ids == r.token_ids == r.done.token_ids
    assert r.finish_reason == "stop" and r.text == s.tokenizer.answer_text(r.token_ids, stop_ids=s.stop_ids)
    assert r.block_prefix == [e.prefix_len for e in events if isinstance(e, BlockStart)]
    assert len(r.block_prefix) == done.blocks >= 2
    assert sum(isinstance(e, Step) for e in events) == sum(done.steps_per_block)


def test_max_tokens_cuts_the_answer_and_finishes_by_length():
    full = request.generate(session_with(blocks=4), COUNT)
    s = session_with(blocks=4, max_tokens=5)
    cut = request.generate(s, COUNT)
    assert len(full.token_ids) > 5
    assert cut.token_ids == full.token_ids[:5] and cut.finish_reason == "length"
    assert cut.text == s.tokenizer.answer_text(full.token_ids[:5], stop_ids=s.stop_ids)
    assert (full.token_ids, full.finish_reason) == (full.done.token_ids, "stop")  # no budget: nothing cut


@pytest.mark.parametrize("command", [["generate", "--format", "json"], ["watch"]])
def test_every_command_applies_the_same_cut(command):
    r = CliRunner().invoke(app, [*command, "--blocks", "4", "--max-tokens", "5", COUNT])
    assert r.exit_code == 0, (r.output, r.exception)
    want = request.generate(session_with(blocks=4, max_tokens=5), COUNT).text
    if command[0] == "generate":
        row = json.loads(r.stdout)
        assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length" and row["text"] == want
    else:
        assert r.stdout.rstrip("\n").endswith(want.rstrip("\n"))


def test_bench_counts_the_cut_answer(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": COUNT}) + "\n")
    r = CliRunner().invoke(app, ["bench", "--prompts", str(f), "--blocks", "4", "--max-tokens", "5", "--runs", "1",
                                 "--warmup", "0", "--no-measure-peaks", "--format", "jsonl"])
    assert r.exit_code == 0, (r.output, r.exception)
    row = json.loads(r.stdout)
    assert row["total_output_tokens"] == 5 and row["finish_length_rate"] == 1


def init_canvas_ids(session, spec, seed: int) -> list[int]:
    """The whole first canvas, as generate and watch build it from --init-canvas."""
    return request.fill_canvas(session, request.read_init_canvas(session, spec)[0], seed)


def test_init_canvas_ids_and_bad_prompts():
    s = session_with()
    c, v = s.config.canvas_length, s.config.vocab_size
    ids = init_canvas_ids(s, "ids:5,6,7", seed=0)
    assert ids[:3] == [5, 6, 7] and len(ids) == c and all(0 <= i < v for i in ids)
    assert init_canvas_ids(s, "ids:5,6,7", seed=0) == ids  # seeded noise
    assert init_canvas_ids(s, [5, 6, 7], seed=0) == ids  # a JSON list (a JSONL row's) is ids
    with pytest.raises(UserError, match="outside the vocabulary"):
        init_canvas_ids(s, f"ids:1,{v}", seed=0)
    with pytest.raises(UserError, match="canvas holds"):
        init_canvas_ids(s, "ids:" + ",".join(["1"] * (c + 1)), seed=0)
    with pytest.raises(UserError, match="empty"):
        request.encode(s, "  \n")


@pytest.mark.parametrize("spec, needle", [
    ("ids:1,2,abc", r"item 3 'abc' is not a token id"),  # a mistyped id list, not text
    ("ids:1,,2", "item 2 is empty"),
    ("ids:5,6,", "item 3 is empty"),
    ("ids:1 2 3", "item 1 '1 2 3' is not a token id"),
    ("", "--init-canvas is empty"),
    ("  ", "--init-canvas is empty"),
    ("ids:", "--init-canvas is empty"),
    ("ids:-1,2", "outside the vocabulary"),
])
def test_init_canvas_ids_parse_or_fail_in_one_line(spec, needle):
    with pytest.raises(UserError, match=needle) as e:
        init_canvas_ids(session_with(), spec, seed=0)
    assert "\n" not in str(e.value) and "; " in str(e.value)  # one line: the problem; the fix


@pytest.mark.parametrize("spec", ["hello world", "Hi, there", "count 1,2,3", "1 2 3", "7", "5,6,7"])
def test_init_canvas_text_is_tokenised(spec):
    """Digits are text too (issue 23): the sort and count tasks warm-start from "1 2 3"; ids need `ids:`."""
    s = session_with()
    ids = s.tokenizer.encode_text(spec)
    assert request.read_init_canvas(s, spec) == (ids, "text")
    assert init_canvas_ids(s, spec, seed=0)[:len(ids)] == ids
    assert request.read_init_canvas(s, " ids: 5 , 6,7") == ([5, 6, 7], "ids")


@pytest.mark.parametrize("command", ["generate", "watch"])
def test_empty_init_canvas_flag_is_an_error_not_ignored(command):
    r = CliRunner().invoke(app, [command, "--init-canvas", "", "hi"])
    assert isinstance(r.exception, UserError) and "--init-canvas is empty" in str(r.exception), r.output


def test_the_package_shortcuts_are_the_request_api():
    import dgcli

    s = dgcli.open_session(settings={"max_blocks": 4, "device": "cpu"})
    assert dgcli.generate(s, COUNT).token_ids == request.generate(session_with(blocks=4), COUNT).token_ids


def test_the_library_checks_the_context_before_anything_runs():
    """`run`, `stream` and `run_batch` refuse a prompt that does not fit the context with its blocks (as the
    commands and the server do), before the first request runs."""
    s = session_with(blocks=2)
    long = [5] * (s.config.max_position_embeddings - 2 * s.config.canvas_length + 1)
    for call in (lambda: request.run(s, long), lambda: request.stream(s, long),
                 lambda: list(request.run_batch(s, [[5, 6], long], batch_size=2))):
        with pytest.raises(UserError, match="exceed the model's context"):
            call()
