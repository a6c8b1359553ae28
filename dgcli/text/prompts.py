"""Prompt files: JSONL, one object per line with a string `prompt` and optionally `answer` (a reference
for exact match) and `family`. generate's --input-jsonl, bench/sweep's --prompts and the bundled held-out
set all use this one reader. Must not: tokenise or run anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dgcli.errors import UserError


def read_prompt_file(path: str | Path, *, flag: str = "--prompts") -> list[dict]:
    """The file's objects in order (blank lines skipped); `-` reads stdin. One clear error per bad line."""
    try:
        text = sys.stdin.read() if str(path) == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror}); pass a JSONL prompt file") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{flag} {path}: line {n} is not JSON; one {{\"prompt\": ...}} object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"{flag} {path}: line {n} has no string 'prompt' field")
        rows.append(row)
    if not rows:
        raise UserError(f"{flag} {path}: no prompts in the file")
    return rows
