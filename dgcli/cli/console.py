"""What commands share at the console: prompts in (argument, stdin, --input-jsonl), notes (the once-per-run
note when answers end at the token budget), `--show-config`, a status line while loading and a one-line
progress display on stderr, one request run with its optional --trace file, and rows in a format (md, csv,
json, jsonl) on stdout after the card.

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

    with Console(file=stream).status(what):
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
    first = [compiling]

    def update(text: str) -> None:
        live.update(f"{text} · {COMPILING}" if first[0] else text)
        first[0] = False

    return live, update


def read_prompt(prompt: str | None) -> str:
    """The prompt text: the argument, or stdin for `-` or no argument (--input-jsonl is cli/batch.py's)."""
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise UserError("no prompt: pass PROMPT, or pipe text on stdin (use - to read stdin explicitly)")
        text = sys.stdin.read()
        if not text.strip():
            raise UserError("stdin is empty; pipe a prompt in or pass it as an argument")
        return text.strip("\n")
    return prompt


class Progress:
    """A one-line Rich status on stderr while a block denoises (only when stderr is a terminal)."""

    def __init__(self, enabled: bool, *, compiling: bool = False):
        # The first step event comes after the first decoder pass, which is when torch.compile works:
        # so the compile note is the opening line, not a suffix on the first update.
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


def document(card: dict, rows: list[dict]) -> dict:
    from dgcli.measure.metrics import DEFINITIONS

    return {"card": card, "definitions": DEFINITIONS, "rows": rows}


def emit(rows: list[dict], *, card: dict, fmt: str, title: str, headline: list[str] = HEADLINE) -> None:
    """Print rows in the chosen format on stdout (the card was printed first)."""
    from dgcli.measure import printers as report
    from dgcli.measure.metrics import DEFINITIONS, NOT_IN_CSV

    if fmt == "md":
        sys.stdout.write(report.to_markdown(rows, headline=headline, definitions=DEFINITIONS, title=title,
                                            skip=NOT_IN_CSV) + "\n")
        sys.stdout.write(report.headline_json(rows, ["label"] + headline) + "\n")
    elif fmt == "csv":
        sys.stdout.write(report.to_csv(rows, skip=NOT_IN_CSV))
    elif fmt == "jsonl":
        sys.stdout.write(report.to_jsonl(rows))
    else:
        sys.stdout.write(report.to_json(document(card, rows)))
    sys.stdout.flush()


def run_one(session: Any, text: str, *, raw: bool, thinking: bool, show_thinking: bool, trace: str | None,
            init_canvas: list[int] | None, on_event: Callable | None = None) -> Any:
    """One prompt through the request API, with the `--trace` file as one more event consumer."""
    from dgcli.render.trace import TraceWriter, make_header
    from dgcli.runtime import request

    ids = request.encode(session, text, raw=raw, thinking=True if thinking else None)
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
        return request.run(session, ids, init_canvas=init_canvas, on_event=both, show_thinking=show_thinking)
    finally:
        if writer is not None:
            writer.close()


def print_answer(response: Any) -> None:
    """The answer on stdout (one line break at the end); `budget_note` says once if answers were cut short."""
    sys.stdout.write(response.text.rstrip("\n") + "\n")
    sys.stdout.flush()


def budget_note(session: Any, cut: int, total: int, *, what: str = "answers") -> str | None:
    """One line for the end of a run when `cut` of `total` answers ended at the token budget (finish
    reason length) rather than at a stop id; None when none did."""
    if not cut:
        return None
    from dgcli.runtime.settings import token_budget

    c, n = session.config.canvas_length, session.num_blocks
    budget = token_budget(session.resolved.run.max_tokens, n, c)
    who = "the answer" if total == 1 else f"{cut} of {total} {what}"
    return (f"dgemma: note: {who} ended at the {budget}-token budget ({n} block{'s' if n != 1 else ''} of {c}); "
            "raise it with --max-tokens or --blocks")


def note_budget(session: Any, responses: list[Any]) -> None:
    """`budget_note` for a run's responses, on stderr (once per run, not per prompt)."""
    msg = budget_note(session, sum(r.finish_reason == "length" for r in responses), len(responses))
    if msg:
        warn(msg)


def show_config(model: str | None, preset: str | None, flags: dict, fmt: str) -> None:
    """`--show-config`: the resolved settings, where each came from, and the block count a run will use."""
    import json

    from dgcli.runtime.session import resolve_for

    path, cfg, _, resolved = resolve_for(model, preset, flags)
    if fmt == "text":
        sys.stdout.write(f"model: {path}\n{resolved.describe(cfg.canvas_length)}\n")
    else:  # json and ndjson: one machine-readable line, like every other output of those formats
        doc = {"model": str(path), **resolved.as_dict(), "blocks": resolved.blocks(cfg.canvas_length)}
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
