"""`dgemma generate --input-jsonl FILE [--batch-size N]`: every line of FILE through the batched loop.

Owns: a JSONL row as a request (the keys a row may carry), every row checked before any runs (a bad row is one
line naming it, exit 2, nothing run or printed), and the results in input order with their `index` and `prompt`.
Must not: contain a denoising loop (dgcli.runtime.request.run_batch), or parse flags.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from dgcli.errors import UserError

REQUEST_KEYS = ("prompt", "seed", "init_canvas", "json_schema", "images")  # images: image files, relative to FILE's folder
# Copied into the JSON result as they are (labels for the caller's own bookkeeping).
PASS_THROUGH = ("id", "name", "label", "answer", "family", "metadata")


@dataclasses.dataclass
class Request:
    """One row, ready to run."""
    prompt_ids: list[int]
    seed: int
    init_canvas: list[int] | None  # the whole first canvas, or None
    json_schema: dict | None = None  # the schema its answer follows, or None
    images: list = dataclasses.field(default_factory=list)  # the engine's images (runtime.vision.engine_images)


def parse_row(session: Any, row: dict, *, raw: bool, thinking: bool, init_flag: list[int] | None = None,
              schema: dict | None = None, folder: str = ".") -> Request:
    """One JSONL row as a request (`init_flag`: the ids --init-canvas gave, for rows without their own
    `init_canvas`); UserError on a bad value."""
    from dgcli.runtime import vision
    from dgcli.runtime.request import encode, fill_canvas, read_init_canvas
    from dgcli.sampling.params import DiffusionEbParams

    unknown = [k for k in row if k not in REQUEST_KEYS + PASS_THROUGH]
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r}; a row may carry {', '.join(REQUEST_KEYS)} "
                        f"(and, copied to the result, {', '.join(PASS_THROUGH)})")
    seed = row.get("seed", session.params.seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"seed {seed!r} is not a whole number; give e.g. \"seed\": 7")
    DiffusionEbParams.check(dataclasses.replace(session.params, seed=seed))  # the one range rule
    images = row.get("images", [])
    if not isinstance(images, list) or not all(isinstance(f, str) for f in images):
        raise UserError(f"images {images!r} is not a list of image files; give e.g. \"images\": [\"cat.png\"]")
    if images:
        from dgcli.text.images import read_files

        paths = [os.path.join(folder, f) for f in images]
        images = vision.read_images(session, read_files(paths, "image"), [f"image {p}" for p in paths])
    ids = encode(session, row["prompt"], raw=raw, thinking=True if thinking else None, images=images)
    images = vision.engine_images(images)
    init = read_init_canvas(session, row["init_canvas"], name="init_canvas")[0] if "init_canvas" in row else init_flag
    if "json_schema" in row:  # compiled (and so checked) now, with the other rows, before any runs
        from dgcli.cli.schema import row_schema
        from dgcli.runtime.request import constraint

        schema = row_schema(row["json_schema"])
        constraint(session, schema, session.num_blocks)
    return Request(ids, seed, fill_canvas(session, init, seed) if init is not None else None, schema, images)


def parse_rows(session: Any, rows: list[dict], path: str, *, raw: bool, thinking: bool,
               init_flag: list[int] | None, schema: dict | None = None) -> list[Request]:
    """Every row checked before any runs; the first bad one is one line naming the file and the row."""
    requests = []
    for n, row in enumerate(rows):
        try:
            requests.append(parse_row(session, row, raw=raw, thinking=thinking, init_flag=init_flag, schema=schema,
                                      folder=os.path.dirname(path)))
        except UserError as e:
            raise UserError(f"--input-jsonl {path}: row {n + 1} (index {n}): {e}") from None
    return requests


def run_rows(session: Any, requests: list[Request], *, batch_size: int, show_thinking: bool,
             on_event: Callable | None, write: Callable[[int, Any], None]) -> list[Any]:
    """The requests through `request.run_batch`; `write(index, response)` is called in input order (a
    finished request waits for the ones before it). Returns the responses."""
    from dgcli.runtime.request import run_batch

    ready: dict[int, Any] = {}
    done: list[Any] = []
    for index, response in run_batch(session, [r.prompt_ids for r in requests], batch_size=batch_size,
                                     seeds=[r.seed for r in requests], init_canvases=[r.init_canvas for r in requests],
                                     show_thinking=show_thinking, on_event=on_event,
                                     json_schemas=[r.json_schema for r in requests],
                                     images=[r.images for r in requests] if any(r.images for r in requests) else None):
        ready[index] = response
        while len(done) in ready:  # input order
            done.append(ready.pop(len(done)))
            write(len(done) - 1, done[-1])
    return done


def json_result(index: int, row: dict, response: Any, settings: dict) -> dict:
    """A row's JSON result: its index, its prompt and pass-through keys, then the response record."""
    extra = {k: row[k] for k in PASS_THROUGH if k in row}
    return {"index": index, "prompt": row["prompt"], **extra, **response.as_dict(settings)}


class RecordFile:
    """`--output FILE`: the `--format json` records appended one whole line at a time (O_APPEND), in input
    order, so a run cut short (a kill, Ctrl-C, every Ray worker gone) keeps what it wrote and `--resume`
    runs only the rows the file lacks."""

    def __init__(self, path: str, *, resume: bool):
        self.path, self.resume = path, resume
        if not resume and os.path.exists(path) and os.path.getsize(path):
            raise UserError(f"--output {path} exists: add --resume to continue it, or choose another --output")
        try:  # now, not after the first answer
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"--output {path}: cannot write ({e.strerror}); pick a writable path") from None

    def done(self, rows: list[dict], settings: dict) -> set[int]:
        """The indexes FILE already holds, each checked against this run's row and settings. A torn last line
        (the run was killed mid-write) is dropped; any other damage is one line."""
        with open(self.path, encoding="utf-8") as f:
            lines, have = f.read().split("\n"), set()
        settings = json.loads(json.dumps(settings))  # as a record holds them (tuples are lists there)
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                index = record["index"]
                same = record["prompt"] == rows[index]["prompt"] and record.get("settings") == settings
            except (ValueError, KeyError, TypeError, IndexError):
                if n == len(lines):  # cut short by a kill: that row runs again
                    with open(self.path, "w", encoding="utf-8") as f:
                        f.write("\n".join(lines[:-1]) + "\n" if n > 1 else "")
                    continue
                raise UserError(f"--resume {self.path}: line {n} is not a record of this --input-jsonl; "
                                "choose another --output") from None
            if not same:
                raise UserError(f"--resume {self.path}: line {n} was written for another prompt or other settings; "
                                "rerun with those, or choose another --output")
            have.add(index)
        return have

    def write(self, result: dict) -> None:
        os.write(self.fd, (json.dumps(result, ensure_ascii=False) + "\n").encode("utf-8"))
