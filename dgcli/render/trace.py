"""The JSONL trace of one generation: a header line, then one record per sampler event.

Owns: writing (`TraceWriter`, flushed per line so an interrupted run keeps what it did) and reading
with validation (`read_trace`: one clear error for a file that is not a trace, from another format
version, or truncated). The record schema is each event's `to_record()` (dgcli/sampling/events.py).
Must not: run the model or render anything.

The format (`--trace FILE`, version 1), one JSON object per line, written as the run goes, by `type`:
  header       first line: `format: "dgemma-trace"`, `version: 1`, `dgemma_version`, `created`, `model`,
               `canvas_length`, `vocab_size`, `settings` (as in `--format json`), `prompt`, `prompt_ids`
  block_start  `block` (0-based), `num_blocks`, `prefix_len`, `canvas` (the initial noise ids)
  step         one per denoising step: `block`, `step` (1-based), `max_steps`, `temperature`,
               `accepted_count`, `mean_entropy`, `canvas` (ids the decoder saw), `argmax`, `entropy` (per
               position, nats), `accepted` (0/1 per position), `stop_reason` (null, `stable_confident` or
               `step_cap` on a block's last step), `elapsed_s`
  commit       `block`, `tokens` (the block's last argmax), `stop_index` (first stop id in it, or null)
  done         last line: `token_ids` (the answer, without the stop id), `finish_reason`, `stop_id`,
               `blocks`, `steps_per_block`, `decoder_passes`, `tokens_per_forward`, `timings`,
               `token_strings` (display string of every id above)
A file without the header, of another version, or without the `done` line is rejected with one line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any, Callable

from dgcli import __version__
from dgcli.errors import UserError

FORMAT = "dgemma-trace"
VERSION = 1
RECORD_TYPES = ("block_start", "step", "commit", "done")


def make_header(*, model: str, settings: dict, prompt_ids: list[int], canvas_length: int, vocab_size: int,
                prompt: str | None = None) -> dict:
    return {"type": "header", "format": FORMAT, "version": VERSION, "dgemma_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model,
            "canvas_length": canvas_length, "vocab_size": vocab_size, "settings": settings,
            "prompt": prompt, "prompt_ids": list(prompt_ids)}


class TraceWriter:
    """Writes the header, then `event(e)` per sampler event. The `done` record also gets `token_strings`: the
    display string of every id the trace mentions (via `token_strings`), so a replay needs no tokenizer."""

    def __init__(self, path: str | Path, header: dict, token_strings: Callable[[list[int]], list[str]] | None = None):
        self.path = Path(path)
        self.token_strings = token_strings
        self.seen: set[int] = set(header.get("prompt_ids", []))
        try:
            self._f: IO[str] = open(self.path, "w", encoding="utf-8")
        except OSError as e:
            raise UserError(f"--trace {path}: cannot write ({e.strerror}); pick a writable path") from None
        self.write(header)

    def event(self, event: Any) -> None:
        rec = event.to_record()
        for key in ("canvas", "argmax", "tokens", "token_ids"):
            if isinstance(rec.get(key), list):
                self.seen.update(rec[key])
        if rec["type"] == "done" and self.token_strings is not None:
            ids = sorted(self.seen)
            rec["token_strings"] = dict(zip(map(str, ids), self.token_strings(ids)))
        self.write(rec)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


HOW_TO = "write one with --trace FILE on `dgemma generate` or `dgemma watch`"


def read_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records). Raises UserError naming the problem for anything that is not a whole trace."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{p}: no such trace file; {HOW_TO}") from None
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a dgemma trace (not UTF-8 text); {HOW_TO}") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read it ({e.strerror}); check the path and its permissions") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UserError(f"{p}: empty, not a dgemma trace; {HOW_TO}")
    # The header decides what the file is: only a file that starts as a trace can be a truncated one.
    n, first = numbered[0]
    header = _record(first)
    if not header or header.get("format") != FORMAT:
        if len(numbered) == 1 and f'"{FORMAT}"' in first:  # cut off inside its header line
            raise UserError(f"{p}: the trace is truncated (its header line is cut off); re-run the generation with --trace")
        raise UserError(f"{p}: not a dgemma trace (line {n} is not a '{FORMAT}' header); {HOW_TO}")
    if header.get("version") != VERSION:
        raise UserError(f"{p}: trace format version {header.get('version')} is not {VERSION} "
                        f"(written by dgemma {header.get('dgemma_version')}); re-record it with this version")
    body: list[dict[str, Any]] = []
    for n, line in numbered[1:]:
        rec = _record(line)
        if not rec:
            # A line cut off mid-write is never a whole JSON object, so only an unparsable last line is truncation.
            if n == numbered[-1][0] and rec is None:
                raise UserError(f"{p}: the last line is cut off: the trace is truncated; re-run the generation with --trace")
            raise UserError(f"{p}: line {n} is not a trace record; re-run the generation with --trace")
        if rec["type"] not in RECORD_TYPES:
            raise UserError(f"{p}: line {n} has unknown record type {rec['type']!r}; is the trace from another program?")
        body.append(rec)
    if not body or body[-1]["type"] != "done":
        raise UserError(f"{p}: the trace is truncated (no 'done' record); the run was interrupted, re-run it")
    return header, body


def _record(line: str) -> dict | bool | None:
    """A line's record: a JSON object with a "type"; False for other JSON, None for a line that is not JSON."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and "type" in rec else False
