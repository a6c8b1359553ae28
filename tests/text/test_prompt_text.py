"""Prompt text that is not Unicode, and prompt files with bad lines: one `dgemma: error:` line naming the file,
the line and the fix (exit 2), never a UnicodeDecodeError or the tokenizer's TypeError. Fast: the file is read
before the model loads, and the argument / stdin cases use a tiny random checkpoint."""

from __future__ import annotations

import io
import sys

import pytest
from cli_run import run

from dgcli.errors import UserError
from dgcli.text.prompts import not_unicode, read_prompt_file

GOOD = b'{"prompt": "Reverse: a b"}\n'


def one_error(code, out, err) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("dgemma: error: "), err
    return lines[0]


@pytest.mark.parametrize("cmd", [["generate", "--input-jsonl"], ["bench", "--prompts"]])
def test_a_file_that_is_not_utf8_names_the_file_and_line(cmd, tmp_path, capsys):
    f = tmp_path / "f.jsonl"
    f.write_bytes(GOOD + b"\n" + b'{"prompt": "Reverse: \xff\xfe"}\n')
    line = one_error(*run([*cmd, str(f)], capsys))
    assert f"{cmd[1]} {f}: line 3 is not UTF-8 (byte 0xff); save it as UTF-8" in line


def test_stdin_file_not_utf8_whatever_the_locale(monkeypatch):
    # A real stdin decodes strictly under en_US.UTF-8 and with surrogateescape under C.UTF-8: bytes either way.
    strict = io.TextIOWrapper(io.BytesIO(GOOD + b'{"prompt": "\xc3("}\n'), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", strict)
    with pytest.raises(UserError, match=r"^--input-jsonl -: line 2 is not UTF-8 \(byte 0xc3\)"):
        read_prompt_file("-", flag="--input-jsonl")


@pytest.mark.parametrize("row, field", [(rb'{"prompt": "Reverse: \ud800 a"}', "prompt"),
                                        (rb'{"prompt": "hi", "init_canvas": "\udcff"}', "init_canvas")])
def test_a_lone_surrogate_escape_names_the_line_and_field(row, field, tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_bytes(GOOD + row + b"\n")
    with pytest.raises(UserError) as e:
        read_prompt_file(f, flag="--input-jsonl")
    assert str(e.value).startswith(f"--input-jsonl {f}: line 2: '{field}' is not valid UTF-8 text (a lone surrogate")


def test_an_empty_prompt_names_the_file_and_line_not_the_argument(tmp_path, capsys):
    f = tmp_path / "e.jsonl"
    f.write_bytes(GOOD + b'{"prompt": "  "}\n')
    line = one_error(*run(["generate", "--input-jsonl", str(f)], capsys))
    assert f"--input-jsonl {f}: line 2 has an empty 'prompt'" in line
    assert "argument" not in line


def test_lines_are_cut_at_newlines_only(tmp_path):
    # JSON strings may hold U+2028 / U+0085 raw; str.splitlines would cut the row there. \r\n ends are fine.
    f = tmp_path / "u.jsonl"
    f.write_text('{"prompt": "a\u2028b\x85c"}\r\n\n{"prompt": "d"}\n', encoding="utf-8")
    assert [r["prompt"] for r in read_prompt_file(f)] == ["a\u2028b\x85c", "d"]


def test_not_unicode_says_what_and_where():
    assert not_unicode("Reverse: a") is None
    assert not_unicode("ok \U0001F600") is None
    assert not_unicode("Reverse: \udcff a") == "byte 0xff at character 9"  # argv / stdin's surrogateescape
    assert not_unicode("Reverse: \udcff a", read_bytes=False) == "a lone surrogate \\udcff at character 9"
    assert not_unicode("ab\ud800") == "a lone surrogate \\ud800 at character 2"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from hf_oracle import text_config

    from dgcli.checkpoint.random_weights import write_random_checkpoint

    tc, _ = text_config("gqa4_moe8")
    tc["vocab_size"] = 512
    tc["max_position_embeddings"] = 96
    return write_random_checkpoint(tmp_path_factory.mktemp("utf") / "ck", tc, canvas_length=16, seed=2)


@pytest.mark.parametrize("how", ["argument", "raw argument", "stdin", "init-canvas"])
def test_text_that_is_not_unicode_is_one_line_before_the_tokenizer(how, tiny_ckpt, capsys, monkeypatch):
    bad = "Reverse: \udcff a"  # what Python makes of argv / stdin bytes b"Reverse: \xff a"
    argv, stdin = ["generate", "--model", str(tiny_ckpt), "--diffusion-steps", "1"], None
    if how == "argument":
        argv += [bad]
    elif how == "raw argument":
        argv += ["--raw", bad]
    elif how == "stdin":
        argv, stdin = [*argv, "-"], bad
    else:
        argv += ["--init-canvas", "\udcff", "hi"]
    line = one_error(*run(argv, capsys, stdin=stdin, monkeypatch=monkeypatch))
    where = "character 0" if how == "init-canvas" else "character 9"
    assert f"is not valid UTF-8 (byte 0xff at {where}); pass UTF-8 text" in line
    assert line.startswith("dgemma: error: --init-canvas: ") == (how == "init-canvas")  # which value it was


def test_the_tokenizer_refuses_a_lone_surrogate_with_a_user_error(tiny_ckpt):
    from dgcli.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    with pytest.raises(UserError, match=r"^the prompt is not valid UTF-8 \(a lone surrogate \\ud800 at character 3\)"):
        tok.encode_prompt("abc\ud800")
    with pytest.raises(UserError, match=r"^the text is not valid UTF-8"):
        tok.encode_text("\ud800")
