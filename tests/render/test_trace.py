"""Tests for dgcli.render.trace.read_trace: each way a file can fail to be a whole trace gets its own one-line
error — a file that is not a trace at all, a trace cut short, a trace of another format version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgcli.errors import UserError
from dgcli.render.trace import VERSION, make_header, read_trace

BODY = [{"type": "block_start", "block": 0, "num_blocks": 1, "prefix_len": 2, "canvas": [5, 6]},
        {"type": "commit", "block": 0, "tokens": [7, 8], "stop_index": None},
        {"type": "done", "token_ids": [7, 8], "finish_reason": "length", "token_strings": {"7": "a", "8": "b"}}]


def trace_lines(**header_changes) -> list[str]:
    header = make_header(model="m", settings={}, prompt_ids=[1, 2], canvas_length=2, vocab_size=9) | header_changes
    return [json.dumps(r) for r in [header, *BODY]]


def error(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "t.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as e:
        read_trace(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_whole_trace_reads_back(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(trace_lines()) + "\n")
    header, records = read_trace(path)
    assert header["version"] == VERSION and [r["type"] for r in records] == ["block_start", "commit", "done"]


@pytest.mark.parametrize("text", ["hello, world\n", "Meeting notes\n\n- buy milk\n- call Bob\n", "[1, 2, 3]\n",
                                  '{"type": "other"}\n', b"\x89PNG\r\n\x1a\n\xff\xfe", "   \n"])
def test_a_file_that_is_not_a_trace_is_called_so_and_told_how_to_make_one(tmp_path, text):
    msg = error(tmp_path, text)
    assert "not a dgemma trace" in msg and "--trace FILE" in msg and "truncated" not in msg, msg


@pytest.mark.parametrize("cut", ["last line", "no done", "header line"])
def test_a_trace_cut_short_is_called_truncated(tmp_path, cut):
    lines = trace_lines()
    text = {"last line": "\n".join(lines[:-1] + [lines[-1][:25]]),
            "no done": "\n".join(lines[:-1]) + "\n",
            "header line": lines[0][:60]}[cut]
    msg = error(tmp_path, text)
    assert "truncated" in msg and "not a dgemma trace" not in msg, msg


def test_a_trace_of_another_version_says_so(tmp_path):
    msg = error(tmp_path, "\n".join(trace_lines(version=VERSION + 1, dgemma_version="9.9")) + "\n")
    assert f"version {VERSION + 1} is not {VERSION}" in msg and "dgemma 9.9" in msg and "truncated" not in msg


def test_a_broken_line_inside_a_trace_is_named(tmp_path):
    lines = trace_lines()
    msg = error(tmp_path, "\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert "line 2 is not a trace record" in msg and "truncated" not in msg, msg
