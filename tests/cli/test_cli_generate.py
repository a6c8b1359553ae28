"""`dgemma generate` end to end on a random checkpoint: inputs, formats, trace, and every bad input."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from cli_run import run
from hf_oracle import text_config
from safetensors.torch import load_file, save_file

from dgcli.checkpoint.random_weights import write_random_checkpoint
from dgcli.render.trace import read_trace


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tc, _ = text_config("gqa4_moe8")
    tc["vocab_size"] = 512
    tc["max_position_embeddings"] = 96
    return write_random_checkpoint(tmp_path_factory.mktemp("gen") / "ck", tc, canvas_length=16, seed=2)


FAST = ["--diffusion-steps", "3"]


def test_argument_prompt_prints_only_the_answer(ckpt, capsys):
    code, out, err = run(["generate", "--model", str(ckpt), *FAST, "hello"], capsys)
    assert code == 0
    assert out.endswith("\n") and out.count("\n") >= 1
    assert "step" not in out  # progress never reaches stdout


@pytest.mark.parametrize("cmd", ["generate", "watch"])
def test_an_unquoted_prompt_is_told_to_quote_it(capsys, cmd):
    code, out, err = run([cmd, "Reverse:", "c", "a", "t"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "unexpected extra argument(s) (c a t)" in err and f'quote it, dgemma {cmd} "..."' in err
    code, _, err = run(["info", "a", "b"], capsys)  # no prompt there: the usual hint
    assert code == 2 and "quote it" not in err and "info --help'" in err


def test_stdin_and_dash(ckpt, capsys, monkeypatch):
    a = run(["generate", "--model", str(ckpt), *FAST, "-"], capsys, stdin="hello\n", monkeypatch=monkeypatch)
    b = run(["generate", "--model", str(ckpt), *FAST], capsys, stdin="hello\n", monkeypatch=monkeypatch)
    c = run(["generate", "--model", str(ckpt), *FAST, "hello"], capsys)
    assert a[0] == b[0] == c[0] == 0
    assert a[1] == b[1] == c[1]  # same seed, same prompt: the same answer


def test_json_format_has_the_product_fields(ckpt, capsys):
    code, out, _ = run(["generate", "--model", str(ckpt), *FAST, "--blocks", "2", "--format", "json", "hi"], capsys)
    assert code == 0
    rec = json.loads(out)
    for key in ("text", "token_ids", "finish_reason", "blocks", "steps_per_block", "tokens_per_forward",
                "timings", "settings"):
        assert key in rec
    assert rec["finish_reason"] in ("stop", "length")
    assert rec["settings"]["params"]["max_denoising_steps"] == 3
    assert rec["settings"]["sources"]["max_denoising_steps"] == "flag"
    assert all(s <= 3 for s in rec["steps_per_block"]) and len(rec["steps_per_block"]) == rec["blocks"]


def test_jsonl_batch_one_result_per_line(ckpt, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one", "id": 1}\n\n{"prompt": "two", "id": 2}\n')
    code, out, _ = run(["generate", "--model", str(ckpt), *FAST, "--format", "json", "--input-jsonl", str(f)], capsys)
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [1, 2]


def test_ndjson_streams_typed_events(ckpt, capsys):
    code, out, _ = run(["generate", "--model", str(ckpt), *FAST, "--format", "ndjson", "hi"], capsys)
    types = [json.loads(line)["type"] for line in out.splitlines()]
    assert code == 0 and types[0] == "block_start" and types[-1] == "result" and "step" in types


def test_trace_parses_and_its_last_argmax_is_the_output(ckpt, capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    code, out, _ = run(["generate", "--model", str(ckpt), *FAST, "--blocks", "2", "--format", "json",
                        "--trace", str(trace), "hi"], capsys)
    assert code == 0
    rec = json.loads(out)
    header, records = read_trace(trace)
    assert header["prompt"] == "hi" and header["settings"] == rec["settings"]
    steps = [r for r in records if r["type"] == "step"]
    commits = [r for r in records if r["type"] == "commit"]
    last_argmax = [s["argmax"] for s in steps if s["stop_reason"]]
    assert [c["tokens"] for c in commits] == last_argmax  # each block commits its last argmax
    generated = [t for c in commits for t in c["tokens"]]
    assert rec["token_ids"] == generated[:len(rec["token_ids"])]
    assert records[-1]["type"] == "done" and records[-1]["token_ids"] == rec["token_ids"]
    assert set(records[-1]["token_strings"]) >= {str(t) for t in rec["token_ids"]}


def test_show_config_names_sources(ckpt, capsys):
    code, out, _ = run(["generate", "--model", str(ckpt), "--show-config", "--t-max", "0.9", "--preset", "fast"], capsys)
    assert code == 0
    line = next(l for l in out.splitlines() if l.startswith("t_max"))
    assert "0.9" in line and "flag" in line
    assert "preset" in next(l for l in out.splitlines() if l.startswith("max_denoising_steps"))


def test_init_canvas_warm_start_is_used(ckpt, capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    ids = "ids:" + ",".join(str(i) for i in range(200, 216))
    code, _, _ = run(["generate", "--model", str(ckpt), *FAST, "--init-canvas", ids, "--trace", str(trace), "hi"], capsys)
    assert code == 0
    _, records = read_trace(trace)
    assert records[0]["canvas"] == list(range(200, 216))


def corrupt_shape(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    state = load_file(bad / "model.safetensors")
    state["model.decoder.norm.weight"] = torch.ones(7)
    save_file(state, str(bad / "model.safetensors"))
    return bad


@pytest.mark.parametrize("case", [
    "missing_model", "partial_checkpoint", "wrong_shape", "unknown_preset_key", "t_min_gt_t_max", "steps_zero",
    "negative_blocks", "prompt_too_long", "no_such_device", "empty_stdin", "bad_format", "bad_init_canvas",
    "unknown_option",
])
def test_bad_input_gives_one_line_and_nonzero_exit(case, ckpt, capsys, tmp_path, monkeypatch):
    m = ["--model", str(ckpt)]
    stdin = None
    if case == "missing_model":
        argv, needle = ["--model", str(tmp_path / "nope"), "hi"], "no such checkpoint directory"
    elif case == "partial_checkpoint":
        import shutil

        part = tmp_path / "part"
        shutil.copytree(ckpt, part)
        (part / "model.safetensors").unlink()
        argv, needle = ["--model", str(part), "hi"], "model.safetensors"
    elif case == "wrong_shape":
        argv, needle = ["--model", str(corrupt_shape(ckpt, tmp_path)), "hi"], "model.decoder.norm.weight"
    elif case == "unknown_preset_key":
        p = tmp_path / "p.yaml"
        p.write_text("entropy_bund: 0.2\n")
        argv, needle = [*m, "--preset", str(p), "hi"], "entropy_bund"
    elif case == "t_min_gt_t_max":
        argv, needle = [*m, "--t-min", "0.9", "--t-max", "0.5", "hi"], "t_min"
    elif case == "steps_zero":
        argv, needle = [*m, "--diffusion-steps", "0", "hi"], "max_denoising_steps"
    elif case == "negative_blocks":
        argv, needle = [*m, "--blocks", "-1", "hi"], "max_blocks"
    elif case == "prompt_too_long":
        argv, needle = [*m, "--raw", "word " * 200], "context"
    elif case == "no_such_device":
        argv, needle = [*m, "--device", "cuda:7", "hi"], "cuda:7"
    elif case == "empty_stdin":
        argv, needle, stdin = [*m, "-"], "stdin is empty", "  \n"
    elif case == "bad_format":
        argv, needle = [*m, "--format", "xml", "hi"], "--format"
    elif case == "unknown_option":
        argv, needle = [*m, "--steps", "0", "hi"], "--steps"
    else:
        argv, needle = [*m, "--init-canvas", "ids:1,2,99999", "hi"], "99999"
    code, out, err = run(["generate", *argv], capsys, stdin=stdin, monkeypatch=monkeypatch)
    assert code != 0
    assert out == ""
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


@pytest.mark.slow  # end to end; test_closed_pipe_exits_141_quietly and test_startup run the console script too
def test_real_subprocess_pipeline(ckpt):
    """The installed console script, as a shell pipeline would run it."""
    ok = subprocess.run(["dgemma", "generate", "--model", str(ckpt), *FAST, "--format", "json"],
                        input="hello", capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["finish_reason"] in ("stop", "length")
    bad = subprocess.run(["dgemma", "generate", "--model", str(ckpt), "--t-min", "2", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr
    assert "transformers" not in subprocess.run(
        [sys.executable, "-c", "import sys, dgcli.cli, dgcli.runtime.session, dgcli.engine.loop, dgcli.model.gemma; print(sorted(sys.modules))"],
        capture_output=True, text=True).stdout  # transformers is the test oracle only


# ---- issue 14: closed pipes, --show-config as JSON, --show-thinking alone, the loading status ------------


def test_closed_pipe_exits_141_quietly(ckpt, tmp_path):
    """`dgemma generate ... | head -1`: the reader leaves after one line; dgemma stops with 141, says nothing."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n' * 40)
    p = subprocess.Popen(["dgemma", "generate", "--model", str(ckpt), *FAST, "--format", "json", "--input-jsonl", str(f)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert json.loads(p.stdout.readline())["finish_reason"] in ("stop", "length")
    p.stdout.close()  # what head does after its line; 39 answers are still to come
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux): a device that is always full")
def test_a_full_disk_under_stdout_is_one_line(ckpt):
    """`dgemma generate ... > /dev/full` (ENOSPC on the answer's write): one error line, exit 2, no traceback."""
    with open("/dev/full", "w") as full:
        p = subprocess.run(["dgemma", "generate", "--model", str(ckpt), *FAST, "hi"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "dgemma: error: cannot write the output: No space left on device (free space, or write elsewhere)"], p.stderr


def test_show_config_honours_format_json(ckpt, capsys):
    code, out, _ = run(["generate", "--model", str(ckpt), "--show-config", "--t-max", "0.9", "--format", "json"], capsys)
    assert code == 0
    rec = json.loads(out)
    assert rec["model"] == str(ckpt) and rec["params"]["t_max"] == 0.9 and rec["sources"]["t_max"] == "flag"


@pytest.mark.parametrize("cmd", ["generate", "watch"])
def test_show_thinking_without_thinking_says_so(ckpt, capsys, cmd):
    code, _, err = run([cmd, "--model", str(ckpt), *FAST, "--show-thinking", "hi"], capsys)
    assert code == 0 and "--show-thinking has nothing to show without --thinking" in err
    code, _, err = run([cmd, "--model", str(ckpt), *FAST, "--show-thinking", "--thinking", "hi"], capsys)
    assert code == 0 and "--show-thinking" not in err


class _TTY(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def rich_terminal(monkeypatch):
    """An environment where Rich draws a status on a terminal (no CI overrides of its detection)."""
    monkeypatch.setenv("TERM", "xterm")
    for var in ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)


def test_loading_status_only_on_a_terminal(rich_terminal):
    from dgcli.cli.console import loading

    tty, pipe = _TTY(), io.StringIO()
    with loading("loading the model…", stream=tty):
        pass
    with loading("loading the model…", stream=pipe):
        pass
    assert "loading the model…" in tty.getvalue() and pipe.getvalue() == ""


BENCH = ["--random-prompts", "--random-input-len", "4", "--no-measure-peaks", "--num-prompts", "1", "--runs", "1",
         "--warmup", "0", "--format", "json"]


@pytest.mark.parametrize("cmd, args", [("generate", ["hi"]), ("watch", ["hi"]), ("bench", BENCH),
                                       ("sweep", [*BENCH, "--output"])], ids=lambda v: v if isinstance(v, str) else "")
def test_commands_show_loading_on_a_terminal_stderr_only(ckpt, capsys, monkeypatch, rich_terminal, tmp_path, cmd, args):
    for i, tty in enumerate((None, _TTY())):
        if tty is not None:
            monkeypatch.setattr(sys, "stderr", tty)
        extra = [str(tmp_path / f"s{i}.jsonl")] if cmd == "sweep" else []
        code, _, err = run([cmd, "--model", str(ckpt), *FAST, *args, *extra], capsys)
        assert code == 0
        if tty is None:
            assert "loading the model" not in err  # stderr is not a terminal here: no status text
        else:
            assert "loading the model…" in tty.getvalue()


def test_compile_says_so_in_the_first_status(rich_terminal, monkeypatch):
    """torch.compile compiles during the first request: its status line (bench/sweep) says so, then not."""
    from dgcli.cli.console import COMPILING, Progress, status

    monkeypatch.setattr(sys, "stderr", _TTY())
    live, update = status(True, compiling=True)
    update("warm-up 1/1")
    first = str(live.status)
    update("run 1/3")
    assert first == f"warm-up 1/1 · {COMPILING}" and str(live.status) == "run 1/3"
    live.stop()
    progress = Progress(True, compiling=True)  # generate's line, until the first step event
    assert str(progress.live.status) == COMPILING
    progress.stop()
