"""What commands share at the console: the prompt (argument or stdin) and what goes with it, the once-per-run
notes about the answers, `--show-config`, status lines on stderr, one request run with its --trace file, and
rows in a format (md, csv, json, jsonl) on stdout after the card.

Owns: where input comes from and output goes. Must not: measure, decide figures (dgcli.measure does),
or contain a denoising loop (requests go through dgcli.runtime.request).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dgcli.errors import UserError

HEADLINE = ["mode", "max_denoising_steps", "blocks", "quality", "output_throughput", "diffusion_committed_throughput",
            "diffusion_canvas_positions_per_s", "mean_ttft_ms", "mean_step_ms", "diffusion_committed_per_step",
            "diffusion_steps_per_canvas", "p90_steps_per_block", "cap_hit_rate", "peak_memory_bytes", "step_vs_floor"]


def warn(msg: str) -> None:
    print(msg, file=sys.stderr)


COMPILING = "compiling the decoder (one-off, tens of seconds)…"
THINKING_NOTE = "dgemma: note: --show-thinking has nothing to show without --thinking (the model does not think)"


@contextmanager
def loading(what: str, *, stream: Any = None) -> Iterator[None]:
    """A Rich status line (`what`) on stderr while a slow start runs, only when stderr is a terminal:
    in a pipe or a log file it would be noise. The line is erased when the block ends."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        yield
        return
    from rich.console import Console
    from rich.live import Live
    from rich.spinner import Spinner

    # Live drawn at once on entry (Console.status waits for its refresh thread): the line must be up before a slow
    # import or load starts, not after it.
    with Live(Spinner("dots", text=what, style="status.spinner"), console=Console(file=stream), transient=True,
              refresh_per_second=12.5):
        yield


def status(enabled: bool, *, compiling: bool = False, start: str = "…"):
    """A one-line progress display on stderr when it is a terminal; a no-op otherwise. With `compiling`
    (a --compile session) the first line says so: torch.compile compiles during the first request."""
    if not enabled:
        return None, lambda text: None
    from rich.console import Console
    from rich.status import Status

    live = Status(COMPILING if compiling else start, console=Console(stderr=True))
    live.start()
    return live, _first_compiling(live.update, compiling)


def counting(enabled: bool, total: int, *, compiling: bool = False):
    """`status` with a bar: what runs, requests done of `total`, elapsed and time left, on stderr when it is a
    terminal (bench's timed runs); no-ops otherwise. Returns (live or None, update(text), advance())."""
    if not enabled:
        return None, lambda text: None, lambda: None
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                   TextColumn("requests"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task(COMPILING if compiling else "…", total=total)
    bar.start()
    show = _first_compiling(lambda text: bar.update(task, description=text), compiling)
    # "batch size 1  run 2/3: 1/4 requests done": the bar counts the requests
    return bar, lambda text: show(text.split(":")[0]), lambda: bar.advance(task)


def _first_compiling(show: Callable[[str], None], compiling: bool) -> Callable[[str], None]:
    """`show`, the compile note added to its first text when `compiling`."""
    first = [compiling]

    def update(text: str) -> None:
        show(f"{text} · {COMPILING}" if first[0] else text)
        first[0] = False

    return update


def read_prompt(prompt: str | None) -> str:
    """The prompt text: the argument, or stdin for `-` or no argument (--input-jsonl is cli/batch.py's)."""
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise UserError("no prompt: pass PROMPT, or pipe text on stdin (use - to read stdin explicitly)")
        raw = getattr(sys.stdin, "buffer", None)  # bytes: a bad one is reported by the tokenizer, whatever the locale
        text = raw.read().decode("utf-8", "surrogateescape") if raw is not None else sys.stdin.read()
        if not text.strip():
            raise UserError("stdin is empty; pipe a prompt in or pass it as an argument")
        if "\x00" in text:  # binary data (a file piped by mistake); the tokenizer would take it as a prompt
            raise UserError(f"stdin holds a NUL byte (at character {text.index(chr(0)):,}): it is binary data, not "
                            "a prompt; pipe text")
        text = text.strip("\n")  # `echo` and files end with a line break: it is not a second line
        lines = len(text.splitlines())
        if lines > 1:  # several prompts piped in would otherwise run silently as one
            warn(f"dgemma: note: stdin has {lines} lines: read as one prompt; "
                 "for one prompt per line use --input-jsonl")
        return text
    return prompt


def check_writable(flag: str, path: str, example: str = "FILE") -> None:
    """Before any model work: an output file that cannot be written must not cost the run. Its folder must exist
    and take files; the file is opened for appending (created, then removed, when new), since permission bits
    alone do not tell (root passes them; /proc and read-only mounts still refuse)."""
    import os
    from pathlib import Path

    p = Path(path).resolve()
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a directory; name a file in it, e.g. {flag} {Path(path) / example}")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {path}: no folder {p.parent}; create it (mkdir -p {p.parent}) or pick another path")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UserError(f"{flag} {path}: cannot write there (permission denied); pick another path")
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror}); pick another path") from None
    if not existed:
        p.unlink(missing_ok=True)


_ID_CHARS = frozenset("0123456789,- \t")


def init_canvas_note(spec: str, how: str, n: int) -> str:
    """Which way `--init-canvas` was read (`dgcli.runtime.request.read_init_canvas`): text, or token ids."""
    if how == "ids":
        return f"dgemma: note: --init-canvas read as {n} token id{'s' if n != 1 else ''}"
    hint = " (token ids need the prefix: ids:5,6,7)" if set(spec) <= _ID_CHARS else ""  # "7": text or id 7?
    return f"dgemma: note: --init-canvas read as text: {n} token{'s' if n != 1 else ''}{hint}"


class Progress:
    """A one-line Rich status on stderr while a block denoises (only when stderr is a terminal). The first step
    event comes after the first decoder pass, when torch.compile works: the compile note is the opening line."""

    def __init__(self, enabled: bool, *, compiling: bool = False):
        self.live, _ = status(enabled, start=COMPILING if compiling else "starting…")

    def __call__(self, event) -> None:
        if self.live is None:
            return
        from dgcli.sampling.events import Step

        if isinstance(event, Step):
            self.live.update(f"block {event.block + 1}  step {event.step}/{event.max_steps}  "
                             f"T={event.temperature:.3f}  accepted {int(event.accepted_count)}  "
                             f"mean entropy {float(event.mean_entropy):.4f}")

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


def document(card: dict, rows: list[dict], definitions: dict | None = None) -> dict:
    from dgcli.measure.metrics import DEFINITIONS

    return {"card": card, "definitions": definitions or DEFINITIONS, "rows": rows}


def emit(rows: list[dict], *, card: dict, fmt: str, title: str, headline: list[str] = HEADLINE,
         definitions: dict | None = None, markdown: str | None = None) -> None:
    """Print rows in the chosen format on stdout (the card was printed first); `markdown`: the md text, where the
    rows' own (`bench --base-url`'s) replaces the table of in-process rows."""
    from dgcli.measure import printers as report
    from dgcli.measure.metrics import DEFINITIONS, NOT_IN_CSV

    if fmt == "md" and markdown is not None:
        sys.stdout.write(markdown)
    elif fmt == "md":
        sys.stdout.write(report.to_markdown(rows, headline=headline, definitions=DEFINITIONS, title=title,
                                            skip=NOT_IN_CSV) + "\n")
        sys.stdout.write(report.headline_json(rows, ["label"] + headline) + "\n")
    elif fmt == "csv":
        sys.stdout.write(report.to_csv(rows, skip=NOT_IN_CSV))
    elif fmt == "jsonl":
        sys.stdout.write(report.to_jsonl(rows))
    else:
        sys.stdout.write(report.to_json(document(card, rows, definitions)))
    sys.stdout.flush()


def prompt_inputs(session: Any, init_canvas: str | None, image: list[str] | None,
                  image_bytes: list[bytes]) -> tuple[list[int] | None, list[int] | None, list | None]:
    """generate and watch, once the model and its tokenizer loaded: (the --init-canvas ids, read once with a note on
    stderr; the first canvas they fill; the --image pictures preprocessed for the tower)."""
    from dgcli.runtime.request import fill_canvas, read_init_canvas
    from dgcli.runtime.vision import read_images

    given = canvas = None
    if init_canvas is not None:
        given, how = read_init_canvas(session, init_canvas)
        warn(init_canvas_note(init_canvas, how, len(given)))
        canvas = fill_canvas(session, given, session.params.seed)
    images = read_images(session, image_bytes, [f"--image {f}" for f in image]) if image else None
    return given, canvas, images


def run_one(session: Any, text: str, *, raw: bool, thinking: bool, show_thinking: bool, trace: str | None,
            init_canvas: list[int] | None, on_event: Callable | None = None, json_schema: dict | None = None,
            images: list | None = None) -> Any:
    """One prompt through the request API, the `--trace` file one more event consumer; `images` as
    `prompt_inputs` returns them."""
    from dgcli.render.trace import TraceWriter, make_header
    from dgcli.runtime import request, vision

    ids = request.encode(session, text, raw=raw, thinking=True if thinking else None, images=images or ())
    writer = None
    if trace:
        header = make_header(model=str(session.path), settings=session.resolved.as_dict(), prompt_ids=ids,
                             canvas_length=session.config.canvas_length, vocab_size=session.config.vocab_size,
                             prompt=text)
        writer = TraceWriter(trace, header, token_strings=session.tokenizer.token_strings)

    def both(event) -> None:
        if writer is not None:
            writer.event(event)
        if on_event is not None:
            on_event(event)

    try:
        return request.run(session, ids, init_canvas=init_canvas, on_event=both, show_thinking=show_thinking,
                           json_schema=json_schema, images=vision.engine_images(images or []))
    finally:
        if writer is not None:
            writer.close()


def print_answer(response: Any) -> None:
    """The answer on stdout, one line break at the end."""
    sys.stdout.write(response.text.rstrip("\n") + "\n")
    sys.stdout.flush()


def answer_notes(session: Any, responses: list[Any], *, raw: bool = False) -> list[str]:
    """The notes about a run's answers, decided here for every command, once per run (never per prompt):
    how many were empty, then how many ended at the token budget. An empty answer counts only as empty:
    a bigger budget would not fill it, so the budget note would point the wrong way."""
    from dgcli.runtime.request import is_empty, only_padding
    from dgcli.runtime.settings import token_budget

    pad, total, notes = session.pad_id, len(responses), []
    empty = [r for r in responses if is_empty(r.token_ids, r.text, pad)]
    cut = sum(r.finish_reason == "length" and not is_empty(r.token_ids, r.text, pad) for r in responses)
    if empty:
        who = "the answer is" if total == 1 else f"{len(empty)} of {total} answers were"
        why = " (only padding)" if all(only_padding(r.token_ids, pad) for r in empty) else ""
        fix = ("this checkpoint answers chat-formatted prompts; drop --raw" if raw
               else "the model gave no text for the prompt; rephrase it or try another --seed")
        notes.append(f"dgemma: note: {who} empty{why}: {fix}")
    if cut:
        c, n = session.config.canvas_length, session.num_blocks
        who = "the answer" if total == 1 else f"{cut} of {total} answers"
        notes.append(f"dgemma: note: {who} ended at the {token_budget(session.resolved.run.max_tokens, n, c)}-token "
                     f"budget ({n} block{'s' if n != 1 else ''} of {c}); raise it with --max-tokens or --blocks")
    return notes


def note_answers(session: Any, responses: list[Any], *, raw: bool = False) -> None:
    for msg in answer_notes(session, responses, raw=raw):
        warn(msg)


def show_config(model: str | None, preset: str | None, flags: dict, fmt: str, dummy: str | None = None,
                layers: int | None = None) -> None:
    """`--show-config`: the resolved settings, where each came from, and the block count a run will use."""
    import json

    from dgcli.runtime.preflight import resolve_for

    path, cfg, _, resolved = resolve_for(model, preset, flags, dummy, layers)
    if fmt == "text":
        sys.stdout.write(f"model: {path}\n{resolved.describe(cfg.canvas_length)}\n")
    else:  # json and ndjson: one machine-readable line, like every other output of those formats
        doc = {"model": str(path), **resolved.as_dict(), "blocks": resolved.blocks(cfg.canvas_length)}
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
