"""Issue 23, "What a new user hit": empty answers get their own note, a file given for --model is one line,
--init-canvas reads text unless told `ids:`, --input-jsonl checks every row before running any, and the
small things (quantized files' mode, multi-line stdin, empty presets, bare `dgemma`, the `client` extra).
All on the bundled model or a tiny random checkpoint: fast."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_run import run

EMPTY_RAW = "the answer is empty (only padding): this checkpoint answers chat-formatted prompts; drop --raw"
# A prompt already in the bundled model's chat format: with --raw it still gets an answer (a counting one).
CHAT_COUNT = "<|turn>user\nCount from 7 to 40.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"


def notes(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("dgemma: note:")]


def jsonl(tmp_path: Path, rows: list, name: str = "p.jsonl") -> Path:
    f = tmp_path / name
    f.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return f


# --- item 4: an answer that is only padding says so, and the budget note does not point the wrong way ----------

def test_a_raw_prompt_with_an_empty_answer_says_drop_raw(capsys):
    code, out, err = run(["generate", "--raw", "Reverse: c a t"], capsys)
    assert code == 0 and out == "\n"
    assert notes(err) == [f"dgemma: note: {EMPTY_RAW}"]  # and not "raise it with --max-tokens"


def test_empty_answers_are_counted_once_per_run_apart_from_the_budget_note(capsys, tmp_path):
    f = jsonl(tmp_path, [{"prompt": CHAT_COUNT}, {"prompt": "Reverse: c a t"}, {"prompt": "Sort: 3 1 2"}])
    code, out, err = run(["generate", "--raw", "--input-jsonl", str(f), "--blocks", "1"], capsys)
    assert code == 0 and out.split("\n")[1:] == ["", "", ""]  # answers 2 and 3 are empty lines
    assert out.startswith("7 8 9 10")
    assert notes(err) == [
        "dgemma: note: 2 of 3 answers were empty (only padding): this checkpoint answers chat-formatted prompts; "
        "drop --raw",
        # all three ran out of blocks (finish_reason length); only the one with text was cut by the budget
        "dgemma: note: 1 of 3 answers ended at the 16-token budget (1 block of 16); raise it with --max-tokens or "
        "--blocks"]


def test_bench_and_every_command_share_the_answer_notes():
    """bench's notes come from the same place (`answer_notes`): an empty answer counts as empty, never as cut."""
    from dgcli.cli.console import answer_notes

    session = SimpleNamespace(pad_id=0, config=SimpleNamespace(canvas_length=16), num_blocks=2,
                              resolved=SimpleNamespace(run=SimpleNamespace(max_tokens=None)))
    answer = lambda ids, text, finish: SimpleNamespace(token_ids=ids, text=text, finish_reason=finish)  # noqa: E731
    responses = [answer([0] * 32, None, "length"), answer([5, 6], None, "length"), answer([], None, "stop"),
                 answer([7], "hi", "stop")]
    assert answer_notes(session, responses) == [
        "dgemma: note: 2 of 4 answers were empty: the model gave no text for the prompt; rephrase it or try another "
        "--seed",  # one was only padding, one stopped at once: not "(only padding)" for both
        "dgemma: note: 1 of 4 answers ended at the 32-token budget (2 blocks of 16); raise it with --max-tokens or "
        "--blocks"]
    assert answer_notes(session, responses[3:]) == []


# --- item 5: --model given a file (or a folder that is not a checkpoint) is one line in every command ----------

COMMANDS = {
    "generate": lambda m, tmp: ["generate", "--model", m, "hi"],
    "watch": lambda m, tmp: ["watch", "--model", m, "hi"],
    "bench": lambda m, tmp: ["bench", "--model", m, "--no-measure-peaks"],
    "sweep": lambda m, tmp: ["sweep", "--model", m, "-o", str(tmp / "rows.jsonl")],
    "info": lambda m, tmp: ["info", "--model", m],
    "serve": lambda m, tmp: ["serve", "--model", m, "--port", "0"],
    "quantize": lambda m, tmp: ["quantize", m, str(tmp / "out"), "--fp8"],
}


def _weights_file(ckpt: Path, tmp: Path) -> tuple[Path, str]:
    return ckpt / "model.safetensors", (
        "is a file; pass the checkpoint directory that holds config.json, model*.safetensors and tokenizer.json")


def _gguf_file(ckpt: Path, tmp: Path) -> tuple[Path, str]:
    f = tmp / "model-q8_0.bin"  # known by its magic bytes, whatever its name
    f.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    return f, "GGUF"  # read as a GGUF file: no DiffusionGemma architecture in it (quantize: not a directory)


def _not_a_checkpoint(ckpt: Path, tmp: Path) -> tuple[Path, str]:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "readme.txt").write_text("hello")
    return tmp / "notes", "not a checkpoint directory (no config.json); pass the directory that holds config.json"


def _binary_config(ckpt: Path, tmp: Path) -> tuple[Path, str]:
    bad = tmp / "bad"
    shutil.copytree(ckpt, bad)
    shutil.copy(ckpt / "model.safetensors", bad / "config.json")  # a config.json that is not text
    return bad, "config.json: not a JSON text file (not UTF-8); re-download or fix the file"


@pytest.mark.parametrize("case", [_weights_file, _gguf_file, _not_a_checkpoint, _binary_config],
                         ids=["weights-file", "gguf", "not-a-checkpoint", "binary-config"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_model_that_is_not_a_checkpoint_directory_is_one_line(command, case, cli_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, needle = case(cli_ckpt, tmp_path)
    code, out, err = run(COMMANDS[command](str(path), tmp_path), capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("dgemma: error: ") and needle in last and str(path) in last, err
    if command not in ("sweep", "quantize", "info") and case is not _binary_config:  # (that names the file)
        assert f"--model {path}" in last, last  # the option is named where it was given as one
    if command != "sweep":  # sweep says where its rows will go first
        assert err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_config_json_that_is_not_json_or_not_an_object(cli_ckpt, tmp_path):
    import dgcli
    from dgcli.errors import UserError

    bad = tmp_path / "bad"
    shutil.copytree(cli_ckpt, bad)
    for text, needle in (("{oops", "not valid JSON"), ("[1, 2]", "expected a JSON object, found a list")):
        (bad / "config.json").write_text(text)
        with pytest.raises(UserError, match=re.escape(needle)):
            dgcli.load_model(bad)


# --- item 6: --init-canvas is text unless it says ids:, and stderr says which --------------------------------

def _first_canvas(trace: Path) -> list[int]:
    from dgcli.render.trace import read_trace

    return read_trace(trace)[1][0]["canvas"]


@pytest.mark.parametrize("spec, note", [
    ("1 2 3", "--init-canvas read as text: {n} tokens (token ids need the prefix: ids:5,6,7)"),
    ("7", "--init-canvas read as text: {n} token (token ids need the prefix: ids:5,6,7)"),  # was token id 7
    ("ids:7,8,9", "--init-canvas read as 3 token ids"),
])
def test_init_canvas_is_text_unless_prefixed_with_ids(spec, note, capsys, tmp_path):
    from dgcli.text.tokenizer import load_tokenizer
    from dgcli.runtime.session import default_model_path

    want = [7, 8, 9] if spec.startswith("ids:") else load_tokenizer(default_model_path()).encode_text(spec)
    trace = tmp_path / "t.jsonl"
    code, _, err = run(["generate", "--blocks", "1", "--diffusion-steps", "2", "--init-canvas", spec,
                        "--trace", str(trace), "Sort: 3 1 2"], capsys)
    assert code == 0, err
    assert f"dgemma: note: {note.format(n=len(want))}" in notes(err)
    assert _first_canvas(trace)[:len(want)] == want
    code, _, err = run(["watch", "--blocks", "1", "--diffusion-steps", "2", "--step-delay", "0", "--init-canvas",
                        spec, "--trace", str(trace), "Sort: 3 1 2"], capsys)  # watch reads it the same way
    assert code == 0, err
    assert f"dgemma: note: {note.format(n=len(want))}" in notes(err)
    assert _first_canvas(trace)[:len(want)] == want


def test_a_rows_init_canvas_error_names_the_key_and_the_row(capsys, tmp_path):
    f = jsonl(tmp_path, [{"prompt": "Sort: 3 1 2", "init_canvas": [5, 6]},
                         {"prompt": "Sort: 3 1 2", "init_canvas": "ids:1,,2"}])
    code, out, err = run(["generate", "--input-jsonl", str(f), "--init-canvas", "1 2"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (f"dgemma: error: --input-jsonl {f}: row 2 (index 1): init_canvas 'ids:1,,2': "
                                    "item 2 is empty; after ids: give comma-separated token ids only (e.g. ids:5,6,7), "
                                    "or drop the prefix for text")


# --- item 8: every row is checked before any runs; results carry the prompt -----------------------------------

@pytest.mark.parametrize("bad, needle", [
    ({"prompt": "Sort: 3 1", "seed": "x"}, "seed 'x' is not a whole number"),
    ({"prompt": "word " * 5000}, "exceed the model's context"),
    ({"prompt": "Sort: 3 1", "init_canvas": "ids:99999"}, "init_canvas: id 99999 is outside the vocabulary"),
])
@pytest.mark.parametrize("fmt", ["text", "ndjson"])
def test_a_bad_row_stops_the_run_before_anything_runs(bad, needle, fmt, capsys, tmp_path, monkeypatch):
    from dgcli.runtime import request

    ran = []
    real = request.run_batch
    monkeypatch.setattr(request, "run_batch", lambda *a, **k: ran.append(1) or real(*a, **k))
    f = jsonl(tmp_path, [{"prompt": "Reverse: a b c"}, {"prompt": "Sort: 9 1 5"}, bad, {"prompt": "Reverse: x"}])
    code, out, err = run(["generate", "--input-jsonl", str(f), "--format", fmt], capsys)
    assert code == 2 and out == "" and ran == []
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dgemma: error: --input-jsonl {f}: row 3 (index 2): ")
    assert needle in lines[0], lines[0]


def test_results_carry_the_rows_prompt(capsys, tmp_path):
    prompts = ["Reverse: a b c", "Sort: 9 1 5"]
    f = jsonl(tmp_path, [{"prompt": p, "id": n} for n, p in enumerate(prompts)])
    for fmt in ("json", "ndjson"):
        code, out, _ = run(["generate", "--input-jsonl", str(f), "--format", fmt, "--blocks", "1"], capsys)
        assert code == 0
        results = [r for r in map(json.loads, out.splitlines()) if r.get("type", "result") == "result"]
        assert [(r["index"], r["id"], r["prompt"]) for r in results] == [(0, 0, prompts[0]), (1, 1, prompts[1])]


# --- item 10: the small things ---------------------------------------------------------------------------------

def test_quantized_weights_get_the_mode_of_any_new_file(cli_ckpt, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        code, _, err = run(["quantize", str(cli_ckpt), str(tmp_path / "q"), "--fp8"], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "q").iterdir()}
    assert modes["model.safetensors"] == 0o644 and modes["config.json"] == 0o644, modes  # safetensors wrote 0600


@pytest.mark.parametrize("stdin, note", [
    ("Sort: 3 1\nSort: 5 4\nReverse: a b\n", "stdin has 3 lines: read as one prompt; for one prompt per line use "
                                             "--input-jsonl"),
    ("Sort: 3 1 2\n", None),  # the line break `echo` adds is not a second line
])
def test_multi_line_stdin_says_it_is_one_prompt(stdin, note, capsys, monkeypatch):
    code, _, err = run(["generate", "--blocks", "1", "--diffusion-steps", "2"], capsys, stdin=stdin,
                       monkeypatch=monkeypatch)
    assert code == 0, err
    assert [n for n in notes(err) if "stdin" in n] == ([f"dgemma: note: {note}"] if note else [])


def test_an_empty_preset_file_is_an_error_naming_it(capsys, tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("")
    code, out, err = run(["generate", "--preset", str(p), "hi"], capsys)
    assert code == 2 and out == ""
    assert err == f"dgemma: error: preset {p}: the file is empty; write the settings as flat 'key: value' lines " \
                  "(e.g. max_denoising_steps: 24)\n"


def test_bare_dgemma_shows_the_help_and_succeeds(capsys):
    code, out, err = run([], capsys)
    assert code == 0 and err == ""
    assert out.startswith("Usage: ") and "Commands:" in out and "generate" in out


def test_the_client_extra_installs_the_openai_client():
    """The README's serve snippet uses the `openai` package: `pip install 'dgemma[client]'` gives it."""
    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    assert any(d.startswith("openai") for d in extras["client"])
    assert any(d.startswith("openai") for d in extras["test"])  # the tests that use it keep it
