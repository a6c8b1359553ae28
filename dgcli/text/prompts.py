"""Prompt files: JSONL, one object per line with a string `prompt` and optionally `answer` (a reference
for exact match) and `family`. generate's --input-jsonl, bench/sweep's --prompts and the bundled held-out
set all use this one reader. Also owns `not_unicode`, the check that prompt text is Unicode the tokenizer
can take (every entry point runs it). Must not: tokenise or run anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dgcli.errors import UserError


def not_unicode(text: str, *, read_bytes: bool = True) -> str | None:
    """Why `text` is no Unicode text (None when it is): a lone surrogate, from JSON's \\ud800 escape, or where
    `read_bytes` (text from argv or stdin) a byte that is not UTF-8, which Python keeps as U+DC80..U+DCFF."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if read_bytes and 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the byte as read
            return f"byte 0x{code - 0xDC00:02x} at character {e.start}"
        return f"a lone surrogate \\u{code:04x} at character {e.start}"


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{where}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x}); save it as UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)") from None


def _read(path: str | Path, flag: str) -> str:
    if str(path) == "-":  # bytes where there are, so a bad byte is found here whatever the locale's stdin errors
        buffer = getattr(sys.stdin, "buffer", None)
        return sys.stdin.read() if buffer is None else _decode(buffer.read(), f"{flag} -")
    try:
        return _decode(Path(path).read_bytes(), f"{flag} {path}")
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror}); pass a JSONL prompt file") from None


def read_prompt_file(path: str | Path, *, flag: str = "--prompts") -> list[dict]:
    """The file's objects in order (blank lines skipped); `-` reads stdin. One clear error per bad line."""
    text = _read(path, flag)
    rows = []
    # "\n" only: JSON strings may hold U+2028, U+0085 etc. raw, which str.splitlines would cut at.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{flag} {path}: line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{where} is not JSON; one {{\"prompt\": ...}} object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"{where} has no string 'prompt' field")
        if not row["prompt"].strip():
            raise UserError(f"{where} has an empty 'prompt'; put the prompt text in it, or delete the line")
        for key, value in row.items():
            problem = not_unicode(value, read_bytes=False) if isinstance(value, str) else None
            if problem:
                raise UserError(f"{where}: '{key}' is not valid UTF-8 text ({problem}); write a character beyond "
                                "U+FFFF as itself or as a surrogate pair")
        rows.append(row)
    if not rows:
        raise UserError(f"{flag} {path}: no prompts in the file")
    return rows
