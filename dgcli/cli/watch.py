"""`dgemma watch [PROMPT|-]` and `dgemma watch --replay TRACE`: the canvas denoising, block by block.

Owns: where the animation goes (a terminal on stdout, else on stderr, else each block's last frame on stderr,
unwrapped), its default pace, feeding one request's events (`console.run_one`, as generate) or a trace's
records into `dgcli.render.watch`, the pictures, and the answer on stdout once at the end (so the scrollback
holds it). Must not: contain a denoising loop or draw frames itself (dgcli.render.watch does).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

import dgcli.cli.options as o
from dgcli.cli.schema import JsonObject, JsonSchema, read_schema, resolve
from dgcli.errors import UserError

EXAMPLES = ['dgemma watch "Count from 7 to 31." --blocks 3',
            'dgemma watch "Sort: 7 2 9 2" --step-delay 0.3',
            'dgemma watch "Reverse: c a t" --trace run.jsonl',
            'dgemma watch --replay run.jsonl --speed 0.5']
# The least time a step stays on screen on a terminal when no pace is chosen: the bundled model's steps take
# a few ms, so an unpaced run (2 steps, 0.02 s for the README's prompts) is over before anything is seen.
DEFAULT_PACE_S = 0.15
REPLAY_OPTIONS = ("replay", "speed", "fps", "step_delay", "save_svg", "save_html")  # the rest run the model
NOT_A_TERMINAL_NOTE = ("dgemma: note: not a terminal, so no animation: the last frame of each block goes to "
                       "stderr and the answer to stdout")


def _check_pacing(fps: float | None, step_delay: float | None, speed: float | None, replay: str | None) -> None:
    for flag, value in (("--fps", fps), ("--step-delay", step_delay), ("--speed", speed)):
        if value is not None and not math.isfinite(value):
            raise UserError(f"{flag} {value}: give a finite number")
    if speed is not None and 0 < speed < 1e-6:
        raise UserError(f"--speed {speed}: too slow to wait out; use 0.001 or more (0 = no waiting)")
    if fps is not None and fps <= 0:
        raise UserError(f"--fps {fps}: the redraw rate must be above 0 (leave it out to draw every step)")
    if step_delay is not None and step_delay < 0:
        raise UserError(f"--step-delay {step_delay}: use 0 or more seconds")
    if speed is not None and replay is None:
        raise UserError("--speed paces a replay; add --replay TRACE, or use --step-delay to slow a live run")
    if speed is not None and speed < 0:
        raise UserError(f"--speed {speed}: use a factor >= 0 (1 = as recorded, 2 = twice as fast, 0 = no waiting)")


def _check_outputs(**paths: str | None) -> None:
    """Before any model work: a picture (or trace) that cannot be written must not cost a whole run."""
    from dgcli.cli.console import check_writable

    for flag, path in paths.items():
        if path is not None:
            check_writable(f"--{flag.replace('_', '-')}", path)


def _screen():
    """(console, mode, note): animate on whichever of stdout and stderr is a terminal, stdout first."""
    from dgcli.render.watch import NO_WRAP, make_console

    dumb = os.environ.get("TERM") == "dumb"  # no cursor movement: a live view would draw nothing
    if sys.stdout.isatty() and not dumb:
        return make_console(), "live", None
    if sys.stderr.isatty() and not dumb:
        return make_console(stderr=True), "live", None
    return make_console(stderr=True, width=NO_WRAP), "blocks", NOT_A_TERMINAL_NOTE


def _watch(pieces, max_steps: int, *, fps: float | None, step_delay: float | None, speed: float | None,
           replay: bool):
    """The Watch, its Display on `_screen`'s console, paced as the user chose (--fps, --step-delay, --speed), else
    DEFAULT_PACE_S a step on a terminal, so a fast model's run can be followed."""
    from dgcli.render.watch import Display, Watch

    console, mode, note = _screen()
    if note:
        print(note, file=sys.stderr)
    chose = fps is not None or step_delay is not None or speed is not None
    pace = DEFAULT_PACE_S if mode == "live" and not chose else 0.0
    recorded = (1.0 if speed is None else speed) if replay else None  # a replay waits the recorded step times
    return Watch(pieces, max_steps,
                 Display(console, mode, pieces, fps=fps, step_delay=step_delay or 0.0, speed=recorded, pace=pace))


def _describe(model: str, settings: dict, prompt: str | None) -> tuple[str, str]:
    """Title and one meta line for the pictures, from what both a live run and its trace know."""
    p = settings.get("params", {})
    title = f"dgemma watch · {Path(model).name}"
    meta = (f"steps ≤ {p.get('max_denoising_steps')} · T {p.get('t_max')}→{p.get('t_min')} · "
            f"entropy bound {p.get('entropy_bound')} · seed {p.get('seed')}")
    return title, (f"prompt: {prompt}\n" if prompt else "") + meta


def watch(
    ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Argument(metavar="PROMPT|-", help="Prompt text; - or nothing reads stdin.")] = None,
    model: o.Model = None, preset: o.Preset = None, device: o.Device = None, dtype: o.Dtype = None,
    seed: o.Seed = None, steps: o.Steps = None, t_min: o.TMin = None, t_max: o.TMax = None,
    entropy_bound: o.EntropyBound = None, stability_threshold: o.Stability = None,
    confidence_threshold: o.Confidence = None, blocks: o.Blocks = None, max_tokens: o.MaxTokens = None,
    threads: o.Threads = None, show_config: o.ShowConfig = False,
    replay: Annotated[Optional[str], typer.Option("--replay", metavar="TRACE", help="Animate a trace written by generate/watch --trace; no model is loaded.")] = None,
    speed: Annotated[Optional[float], typer.Option("--speed", metavar="X", help=o.dflt("Replay pace: 1 = as recorded, 2 = twice as fast, 0 = no waiting.", "1"))] = None,
    fps: Annotated[Optional[float], typer.Option("--fps", metavar="X", help=o.dflt("Most redraws per second.", "every step, as fast as it comes"))] = None,
    step_delay: Annotated[Optional[float], typer.Option("--step-delay", metavar="SECONDS", help=o.dflt("Seconds to pause after each step (slow motion for demos); 0 turns the default pace off.", f"on a terminal, each step takes at least {DEFAULT_PACE_S} s unless --fps or --speed is given; elsewhere 0"))] = None,
    save_svg: Annotated[Optional[str], typer.Option("--save-svg", metavar="FILE", help="Write the last frame of every block to FILE as SVG.")] = None,
    save_html: Annotated[Optional[str], typer.Option("--save-html", metavar="FILE", help="Write a self-contained HTML replay (play, pause, scrub) to FILE.")] = None,
    trace: o.Trace = None,
    init_canvas: o.InitCanvas = None,
    image: o.Image = None,
    thinking: o.Thinking = False,
    show_thinking: o.ShowThinking = False,
    raw: o.Raw = False,
    json_schema: JsonSchema = None,
    json_object: JsonObject = False,
) -> None:
    """Watch the canvas denoise live, or replay a trace.

    The answer is printed on stdout at the end, as `dgemma generate` prints it.
    """
    from dgcli.render.watch import Pieces

    _check_pacing(fps, step_delay, speed, replay)
    _check_outputs(save_svg=save_svg, save_html=save_html, trace=trace if replay is None else None)
    flags = o.sampler_flags(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                            stability=stability_threshold, confidence=confidence_threshold, seed=seed,
                            blocks=blocks, device=device, dtype=dtype, max_tokens=max_tokens)
    if replay is not None:
        stray = [flag for flag, _ in o.given(ctx, set(ctx.params) - set(REPLAY_OPTIONS))]
        if stray:
            raise UserError(f"--replay animates a saved trace as recorded; drop {', '.join(stray)} (or drop --replay "
                            "to run the model)")
        return _replay(replay, speed=speed, fps=fps, step_delay=step_delay, save_svg=save_svg, save_html=save_html)
    schema = resolve(read_schema(json_schema, json_object))

    from dgcli.cli.console import (THINKING_NOTE, loading, note_answers, print_answer, prompt_inputs, read_prompt,
                                   run_one, show_config as print_config)

    if show_config:
        print_config(model, preset, flags, "text")
        return
    from dgcli.text.images import read_files

    image_bytes = read_files(image or [], "--image")  # before the model loads
    text = read_prompt(prompt)
    if show_thinking and not thinking:
        print(THINKING_NOTE, file=sys.stderr)
    with loading("loading the model…"):  # up before torch is imported: that alone takes seconds
        from dgcli.runtime.session import open_session

        session = open_session(model, preset, flags, threads=threads, chat=not raw)
    _, canvas, images = prompt_inputs(session, init_canvas, image, image_bytes)
    pieces = Pieces(fetch=session.tokenizer.token_strings)
    w = _watch(pieces, session.params.max_denoising_steps, fps=fps, step_delay=step_delay, speed=None, replay=False)
    try:
        with w.display:
            response = run_one(session, text, raw=raw, thinking=thinking, show_thinking=show_thinking, trace=trace,
                               init_canvas=canvas, on_event=lambda event: w.feed(event.to_record()), json_schema=schema,
                               images=images)
    except KeyboardInterrupt:
        _interrupted(w)
    print_answer(response)  # first: a picture that fails to write must not cost the answer
    note_answers(session, [response], raw=raw)
    _summary(response.done.to_record())
    title, meta = _describe(str(session.path), session.resolved.as_dict(), text)
    _pictures(w, title, meta, save_svg, save_html)


def _replay(path: str, *, speed: float | None, fps: float | None, step_delay: float | None, save_svg: str | None,
            save_html: str | None) -> None:
    from dgcli.render.trace import read_trace
    from dgcli.render.watch import Pieces

    header, records = read_trace(path)  # one clear UserError for a truncated, foreign or other-version file
    bad = UserError(f"{path}: a record lacks the fields a step trace has, or has them of another type; "
                    "re-record it with --trace")
    w = None
    try:
        pieces = Pieces.from_trace(records[-1])
        first_step = next((r for r in records if r["type"] == "step"), {})
        settings = header.get("settings") or {}
        max_steps = settings.get("params", {}).get("max_denoising_steps") or first_step.get("max_steps", 0)
        w = _watch(pieces, max_steps, fps=fps, step_delay=step_delay, speed=speed, replay=True)
        with w.display:
            for rec in records:
                w.feed(rec)
        title, meta = _describe(str(header.get("model", "trace")), settings, header.get("prompt"))
        answer = w.final_text().rstrip("\n") + "\n"
    except KeyboardInterrupt:
        if w is None:
            raise
        _interrupted(w)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError):  # fields missing or of the wrong type
        raise bad from None
    sys.stdout.write(answer)  # first: a picture that fails to write must not cost the answer
    sys.stdout.flush()
    try:
        _summary(records[-1])  # read_trace checked it is the `done` record
        _pictures(w, title, meta, save_svg, save_html)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError):
        raise bad from None


def _summary(done: dict | None) -> None:
    """One line on stderr at the end (a replay: the recorded run's): blocks, steps, ms per step (denoising time,
    the display's pace not counted) and tokens per step."""
    if not done or not done.get("decoder_passes"):
        return
    steps, blocks = done["decoder_passes"], done.get("blocks", 0)
    denoise = (done.get("timings") or {}).get("denoise_s")
    per_step = f"{denoise / steps * 1e3:.3g} ms per step, " if isinstance(denoise, (int, float)) else ""
    print(f"dgemma: {blocks} block{'s' if blocks != 1 else ''}, {steps} "
          f"denoising step{'s' if steps != 1 else ''}: {per_step}{done.get('tokens_per_forward', 0):.3g} tokens per "
          "step (answer ids up to the stop id, padding excluded)", file=sys.stderr)


def _interrupted(w) -> None:
    """Ctrl-C: the finished blocks' text (it was only in the stopped view) to stdout, where on stderr, exit 130.
    SystemExit, because Typer turns KeyboardInterrupt into a return value the CLI would not see."""
    from dgcli.render.frames import block_label

    done = w.final_text().rstrip("\n")
    if done.strip():
        print(done)
    f = w.frames[-1] if w.frames else None
    where = f" at {block_label(f)}, step {f.step}/{f.max_steps}" if f else ""
    print(f"dgemma: interrupted{where}", file=sys.stderr)
    raise SystemExit(130)


def _pictures(w, title: str, meta: str, svg: str | None, html: str | None) -> None:
    from dgcli.render.watch import save_html, save_svg

    if svg:
        save_svg(svg, w, title)
    if html:
        save_html(html, w, title, meta)
