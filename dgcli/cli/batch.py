"""`dgemma generate --input-jsonl FILE [--batch-size N]`: every line of FILE through the batched loop.

Owns: reading a JSONL row into a request (its prompt, its own `seed` and `init_canvas`), the keys a row
may carry, and writing results in input order, each with its `index`. A bad row stops the run at that
row: the rows before it still run and print, then one line names the row and the problem (exit 2).
Must not: contain a denoising loop (dgcli.runtime.request.run_batch), or parse flags.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Callable

from dgcli.errors import UserError

REQUEST_KEYS = ("prompt", "seed", "init_canvas")
# Copied into the JSON result as they are (labels for the caller's own bookkeeping).
PASS_THROUGH = ("id", "name", "label", "answer", "family", "metadata")


def parse_row(session: Any, row: dict, *, raw: bool, thinking: bool,
              init_flag: str | None = None) -> tuple[list[int], int, list[int] | None]:
    """(prompt ids, seed, first-canvas ids or None) for one JSONL row (`init_flag`: --init-canvas, for rows
    without their own); UserError on a bad value."""
    from dgcli.runtime.request import encode, init_canvas_ids
    from dgcli.sampling.params import DiffusionEbParams

    unknown = [k for k in row if k not in REQUEST_KEYS + PASS_THROUGH]
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r}; a row may carry {', '.join(REQUEST_KEYS)} "
                        f"(and, copied to the result, {', '.join(PASS_THROUGH)})")
    seed = row.get("seed", session.params.seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"seed {seed!r} is not a whole number; give e.g. \"seed\": 7")
    DiffusionEbParams.check(dataclasses.replace(session.params, seed=seed))  # the one range rule
    ids = encode(session, row["prompt"], raw=raw, thinking=True if thinking else None)
    init = row.get("init_canvas", init_flag)
    if init is not None:
        if isinstance(init, list):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in init):
                raise UserError("init_canvas must be a list of token ids or a string (ids \"5,6,7\" or text)")
            init = ",".join(map(str, init))
        elif not isinstance(init, str):
            raise UserError("init_canvas must be a list of token ids or a string (ids \"5,6,7\" or text)")
        init = init_canvas_ids(session, init, seed)
    return ids, seed, init


def run_rows(session: Any, rows: list[dict], path: str, *, batch_size: int, raw: bool, thinking: bool,
             show_thinking: bool, init_flag: str | None, on_event: Callable | None,
             write: Callable[[int, dict, Any], None]) -> list[Any]:
    """Run the rows up to the first bad one through `request.run_batch`; `write(index, row, response)` is
    called in input order (a finished request waits for the ones before it). Returns the responses;
    raises the bad row's error after the rows before it have been written."""
    from dgcli.runtime.request import run_batch

    parsed, bad = [], None
    for n, row in enumerate(rows):
        try:
            parsed.append(parse_row(session, row, raw=raw, thinking=thinking, init_flag=init_flag))
        except UserError as e:
            bad = UserError(f"--input-jsonl {path}: row {n + 1} (index {n}): {e}")
            break
    ready: dict[int, Any] = {}
    done: list[Any] = []
    for index, response in run_batch(session, [p for p, _, _ in parsed], batch_size=batch_size,
                                     seeds=[s for _, s, _ in parsed], init_canvases=[c for _, _, c in parsed],
                                     show_thinking=show_thinking, on_event=on_event):
        ready[index] = response
        while len(done) in ready:  # input order
            i = len(done)
            done.append(ready.pop(i))
            write(i, rows[i], done[-1])
    if bad is not None:
        raise bad
    return done


def json_result(index: int, row: dict, response: Any, settings: dict) -> dict:
    """A row's JSON result: its index, its pass-through keys, then the response record."""
    extra = {k: row[k] for k in PASS_THROUGH if k in row}
    return {"index": index, **extra, **response.as_dict(settings)}


def write_event(event: Any) -> None:
    """`--format ndjson` with --input-jsonl: the loop's events, each with the request's index."""
    sys.stdout.write(json.dumps({**event.to_record(), "index": event.row}, separators=(",", ":")) + "\n")
