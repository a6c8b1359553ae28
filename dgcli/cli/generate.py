"""`dgemma generate [PROMPT|-]`: prompts in (argument, stdin or --input-jsonl), answers out.

stdout carries only answers (text, one JSON object per prompt, or typed ndjson events); progress and
warnings go to stderr. Owns: reading prompts, the per-prompt run that feeds one sampler event stream to
the trace writer, the progress display and the output formats. Must not: contain a denoising loop.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Iterator, Optional

import typer

from dgcli.cli import options as o
from dgcli.errors import UserError
from dgcli.text.prompts import read_prompt_file

FORMATS = ("text", "json", "ndjson")


def read_prompts(prompt: str | None, input_jsonl: str | None) -> Iterator[tuple[str, dict]]:
    """(prompt text, extra fields) pairs, from --input-jsonl, the argument, or stdin."""
    if input_jsonl is not None:
        if prompt not in (None, "-"):
            raise UserError("give either a PROMPT argument or --input-jsonl, not both")
        for row in read_prompt_file(input_jsonl, flag="--input-jsonl"):
            yield row["prompt"], {k: v for k, v in row.items() if k != "prompt"}
        return
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise UserError("no prompt: pass PROMPT, or pipe text on stdin (use - to read stdin explicitly)")
        text = sys.stdin.read()
        if not text.strip():
            raise UserError("stdin is empty; pipe a prompt in or pass it as an argument")
        yield text.strip("\n"), {}
        return
    yield prompt, {}


def parse_init_canvas(spec: str, session, seed: int) -> list[int]:
    """Comma-separated ids, or text that is tokenised; the rest of the canvas stays uniform noise."""
    import torch

    c, v = session.config.canvas_length, session.config.vocab_size
    parts = [p.strip() for p in spec.split(",")]
    if all(p.lstrip("-").isdigit() for p in parts if p) and any(parts):
        ids = [int(p) for p in parts if p]
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise UserError(f"--init-canvas: id {bad[0]} is outside the vocabulary [0, {v})")
    else:
        ids = session.tokenizer.encode_text(spec)
    if len(ids) > c:
        raise UserError(f"--init-canvas has {len(ids)} tokens; the canvas holds {c}: shorten it")
    g = torch.Generator().manual_seed(seed + 1)
    return ids + torch.randint(0, v, (c - len(ids),), generator=g).tolist()


def run_prompt(session, text: str, *, raw: bool, thinking: bool, show_thinking: bool, trace: str | None,
               init_canvas: list[int] | None, on_event=None) -> dict:
    """One prompt through the sampler's event stream; returns the JSON-format result."""
    from dgcli.runtime.session import encode_prompt
    from dgcli.sampling.loop import generate_events
    from dgcli.render.trace import TraceWriter, make_header

    tok = session.tokenizer
    ids = encode_prompt(session, text, raw=raw, thinking=thinking)
    settings = session.resolved.as_dict()
    writer = None
    if trace:
        header = make_header(model=str(session.path), settings=settings, prompt_ids=ids,
                             canvas_length=session.config.canvas_length, vocab_size=session.config.vocab_size,
                             prompt=text)
        writer = TraceWriter(trace, header, token_strings=tok.token_strings)
    done = None
    try:
        for event in generate_events(session.model, ids, params=session.params, num_blocks=session.num_blocks,
                                     stop_ids=session.stop_ids, pad_id=tok.pad_id, init_canvas=init_canvas):
            if writer:
                writer.event(event)
            if on_event:
                on_event(event)
            done = event
    finally:
        if writer:
            writer.close()
    token_ids = done.token_ids
    max_tokens = session.resolved.run.max_tokens
    finish = done.finish_reason
    if max_tokens is not None and len(token_ids) > max_tokens:
        token_ids, finish = token_ids[:max_tokens], "length"
    answer = tok.answer_text(token_ids, show_thinking=show_thinking, stop_ids=session.stop_ids)
    return {"text": answer, "token_ids": token_ids, "finish_reason": finish, "blocks": done.blocks,
            "steps_per_block": done.steps_per_block, "tokens_per_forward": done.tokens_per_forward,
            "timings": done.timings, "settings": settings, "prompt_tokens": len(ids)}


class Progress:
    """A one-line Rich status on stderr while a block denoises (only when stderr is a terminal)."""

    def __init__(self, enabled: bool):
        self.live = None
        if enabled:
            from rich.console import Console
            from rich.status import Status

            self.live = Status("loading…", console=Console(stderr=True))
            self.live.start()

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


def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text; - or nothing reads stdin.")] = None,
    model: o.Model = None, preset: o.Preset = None, device: o.Device = None, dtype: o.Dtype = None,
    seed: o.Seed = None, steps: o.Steps = None, t_min: o.TMin = None, t_max: o.TMax = None,
    entropy_bound: o.EntropyBound = None, stability_threshold: o.Stability = None,
    confidence_threshold: o.Confidence = None, blocks: o.Blocks = None, max_tokens: o.MaxTokens = None,
    show_config: o.ShowConfig = False,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text | json | ndjson")] = "text",
    input_jsonl: Annotated[Optional[str], typer.Option("--input-jsonl", help="Run every {\"prompt\": ...} line of FILE.")] = None,
    trace: o.Trace = None,
    init_canvas: o.InitCanvas = None,
    thinking: o.Thinking = False,
    show_thinking: o.ShowThinking = False,
    raw: o.Raw = False,
    compile: o.Compile = False,
) -> None:
    """Generate text for a prompt (argument, stdin, or --input-jsonl)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    from dgcli.sampling.events import Done
    from dgcli.runtime.session import open_session, resolve_for

    flags = o.sampler_flags(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                            stability=stability_threshold, confidence=confidence_threshold, seed=seed,
                            blocks=blocks, device=device, dtype=dtype, max_tokens=max_tokens)
    if show_config:
        path, _, _, resolved = resolve_for(model, preset, flags)
        typer.echo(f"model: {path}\n{resolved.describe()}")
        return
    prompts = list(read_prompts(prompt, input_jsonl))
    if trace and len(prompts) > 1:
        raise UserError("--trace records one generation; run one prompt, or drop --trace for --input-jsonl")
    session = open_session(model, preset, flags, compile=compile)
    if session.tokenizer is None:
        raise UserError(f"{session.path}: no tokenizer.json; dgemma generate needs the checkpoint's tokenizer")
    canvas = parse_init_canvas(init_canvas, session, session.params.seed) if init_canvas else None
    progress = Progress(sys.stderr.isatty() and fmt != "ndjson")
    try:
        def on_event(event) -> None:
            progress(event)
            if fmt == "ndjson" and not isinstance(event, Done):  # the result line replaces `done`
                sys.stdout.write(json.dumps(event.to_record(), separators=(",", ":")) + "\n")

        for text, extra in prompts:
            result = run_prompt(session, text, raw=raw, thinking=thinking or session.resolved.run.thinking,
                                show_thinking=show_thinking, trace=trace, init_canvas=canvas, on_event=on_event)
            if fmt == "text":
                sys.stdout.write(result["text"].rstrip("\n") + "\n")
            elif fmt == "json":
                sys.stdout.write(json.dumps({**extra, **result}, ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(json.dumps({"type": "result", **extra, **result}, ensure_ascii=False) + "\n")
            sys.stdout.flush()
            if result["finish_reason"] == "length" and fmt == "text":
                print(f"dgemma: note: the answer hit the block budget ({result['blocks']} block(s)); "
                      "raise --blocks or --max-tokens for more", file=sys.stderr)
    finally:
        progress.stop()
