"""What `dgemma watch` shows: frames of the canvas (dgcli.render.frames) drawn on a terminal or exported.

Owns: a frame drawn with Rich (the canvas in its colour classes, the status line), the terminal display and
its pacing (`Display`: the answer so far shows in the live view, so the one copy that stays is the one
dgcli.cli.watch prints at the end), and the pictures: SVG (Rich's export) and the HTML replay (this module
fills dgcli/data/replay.html). Must not: fold records into frames, run the model, tokenize, or touch traces.
"""

from __future__ import annotations

import io
import json
import re
import time
from html import escape
from importlib.resources import files
from pathlib import Path
from typing import Literal

from rich.console import CONSOLE_SVG_FORMAT, Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.segment import Segment
from rich.text import Text
from rich.theme import Theme

from dgcli.errors import UserError
from dgcli.render.frames import CLASSES, SEPARATOR, Committed, Frame, Pieces, Watch, display_piece, status_line

STYLES = {"acc0": "red", "acc1": "yellow", "acc2": "green", "acc3": "bold bright_green",
          "renoised": "dim", "changed": "underline", "status": "bold", "sep": "dim"}
# Underline (not only a colour) marks changed positions, so they still stand out under NO_COLOR.
THEME = Theme({f"watch.{k}": v for k, v in STYLES.items()})
SVG_WIDTH = 120  # columns of the exported pictures, so they look the same whatever the terminal was
# Columns of a console that is not a terminal (the block frames on stderr): a log has no width to wrap at,
# and Rich's 80-column guess cut canvases in the middle; one line per status line and per canvas instead.
NO_WRAP = 1_000_000
ANSWER_LINES = 3  # the live view's answer so far: its last lines, so the canvas under it stays on screen


def canvas_text(f: Frame, pieces: Pieces) -> Text:
    """One span per position, styled by its classes (theme names `watch.<class>`), a dim SEPARATOR between."""
    text = Text(overflow="fold")  # a noise run with no spaces still wraps at the edge
    for i, tid in enumerate(f.ids):
        if i:
            text.append(SEPARATOR, style="watch.sep")
        start = len(text)
        text.append(display_piece(pieces[tid]), style=f"watch.{CLASSES[f.kinds[i]]}")
        if f.changed[i]:
            text.stylize("watch.changed", start, len(text))
    return text


def render_frame(f: Frame, pieces: Pieces) -> RenderableType:
    # Status first: a canvas taller than the terminal is cropped at the bottom, never the status line.
    return Group(Text(status_line(f), style="watch.status"), canvas_text(f, pieces))


class _Tail:
    """The last `n` lines of a text as wrapped at the width it is drawn at (a resize reflows it)."""

    def __init__(self, text: Text, n: int):
        self.text, self.n = text, n

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in console.render_lines(self.text, options.update(height=None), pad=False)[-self.n:]:
            yield from line
            yield Segment.line()


def live_view(f: Frame, answer: list[int], pieces: Pieces) -> RenderableType:
    """The live view: the answer so far (the finished blocks' plain text, its last lines), then the frame."""
    if not answer:
        return render_frame(f, pieces)
    return Group(_Tail(Text(pieces.text(answer)), ANSWER_LINES), render_frame(f, pieces))


def make_console(**kw) -> Console:
    """A console that knows the watch styles. NO_COLOR is honoured by Rich unless `no_color=False` is passed."""
    return Console(theme=THEME, **kw)


def plain(renderable: RenderableType, width: int = SVG_WIDTH) -> str:
    """The text a renderable shows at `width` columns, without styles (what frame comparisons use)."""
    console = make_console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


Mode = Literal["live", "blocks"]


class Display:
    """Shows a run's frames on a console as they come. live: a Rich Live view redrawn in place (each finished
    block leaves its status line above it); blocks: each block's last frame printed once (not a terminal).
    `fps` caps the redraw rate (a block's first and last frames always drawn); `step_delay` sleeps after each
    step; `speed` (replay) first waits each step's recorded time / speed (0: none); `pace` makes each step take
    at least that many seconds, model time included."""

    def __init__(self, console: Console | None, mode: Mode, pieces: Pieces, *, fps: float | None = None,
                 step_delay: float = 0.0, speed: float | None = None, pace: float = 0.0):
        self.console, self.mode, self.pieces = console, mode, pieces
        self.fps, self.step_delay, self.speed, self.pace = fps, step_delay, speed, pace
        self.live: Live | None = None
        self.last_draw = 0.0
        self.prev_elapsed = 0.0
        self.step_start = 0.0  # when the step now being computed began (for `pace`)
        self.answer: list[int] = []  # the finished blocks' ids, shown in the live view

    def __enter__(self) -> "Display":
        if self.mode == "live":
            # Auto-refresh redraws the current frame a few times a second, at the console's current
            # width: that is what follows a terminal resize while a slow step runs.
            self.live = Live(console=self.console, transient=True, auto_refresh=True, refresh_per_second=4,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            # An empty view first: stop() redraws the last frame uncropped, and one taller than the terminal
            # could not be erased above its top (it stayed in the scrollback, a second answer among it).
            self.live.update(Text(""), refresh=True)
            self.live.stop()  # also on Ctrl-C: shows the cursor again and clears the view
            self.live = None

    def show(self, item: Frame | Committed) -> None:
        if isinstance(item, Committed):
            if self.mode == "live":
                # Only why it stopped stays above: the text is shown in the view, and printed once at the end.
                self.live.console.print(Text(status_line(item.last), style="dim"))
                self.answer += item.ids
            else:
                self.console.print(render_frame(item.last, self.pieces))
                self.console.print()
            return
        if self.mode != "live":
            return
        if self.speed and item.step > 0:
            time.sleep(max(0.0, item.elapsed_s - self.prev_elapsed) / self.speed)
        self.prev_elapsed = item.elapsed_s
        now = time.monotonic()
        edge = item.step == 0 or item.stop_reason is not None
        if edge or not self.fps or now - self.last_draw >= 1.0 / self.fps:
            self.last_draw = now
            self.live.update(live_view(item, self.answer, self.pieces), refresh=True)
        if self.step_delay and item.step > 0:
            time.sleep(self.step_delay)
        if self.pace and item.step > 0:
            time.sleep(max(0.0, self.pace - (time.monotonic() - self.step_start)))
        self.step_start = time.monotonic()


def save_svg(path: str | Path, w: Watch, title: str) -> None:
    """The last frame of every block, one under the other, as Rich's SVG export."""
    console = make_console(record=True, file=io.StringIO(), width=SVG_WIDTH, force_terminal=True,
                           color_system="truecolor", no_color=False)  # a picture keeps its colours
    for c in w.commits:
        console.print(render_frame(c.last, w.pieces))
        console.print()
    try:
        console.save_svg(str(path), title=title, code_format=_SVG_FORMAT)
    except OSError as e:
        raise UserError(f"--save-svg {path}: cannot write ({e.strerror}); pick a writable path") from None


# Rich's template would fetch its font from a CDN where Fira Code is not installed; keep the local()
# sources only, so the picture never touches the network (monospace is the fallback).
_SVG_FORMAT = re.sub(r',\s*url\("https?://[^"]*"\) format\("[^"]*"\)', "", CONSOLE_SVG_FORMAT)

# The terminal STYLES as CSS, one rule per colour class (the template's {{CLASSES}}).
_CSS_COLOURS = {"acc0": "color:#ff6b6b", "acc1": "color:#e5c07b", "acc2": "color:#7ec16e",
                "acc3": "color:#5cff7a;font-weight:bold", "renoised": "color:#6b7280",
                "changed": "text-decoration:underline;background:#2b3242"}
_PLACEHOLDER = re.compile(r"\{\{(TITLE|META|CLASSES|DATA)\}\}")


def html_data(w: Watch, title: str, meta: str) -> dict:
    """The replay page's data: a string table, then per frame its ids, kinds/changed codes and status (the page
    draws `sep` between canvas positions; `raw` is the answer text)."""
    ids = sorted({i for f in w.frames for i in f.ids} | {i for c in w.commits for i in c.ids})
    index = {tid: n for n, tid in enumerate(ids)}
    frames = [{"b": f.block, "i": [index[t] for t in f.ids], "status": status_line(f),
               "k": "".join(str(k + 5 * ch) for k, ch in zip(f.kinds, f.changed))} for f in w.frames]
    return {"title": title, "meta": meta, "sep": SEPARATOR, "cell": [display_piece(w.pieces[t]) for t in ids],
            "raw": [w.pieces[t] for t in ids], "frames": frames,
            "blocks": [[index[t] for t in c.ids] for c in w.commits], "classes": list(CLASSES)}


def html_page(w: Watch, title: str, meta: str = "") -> str:
    """The replay page: dgcli/data/replay.html with its placeholders filled."""
    data = json.dumps(html_data(w, title, meta), ensure_ascii=False, separators=(",", ":"))
    # Model text may hold "</script>" or "<!--": with every "<" escaped none can end the data block early
    # (JSON.parse reads \u003c back as "<").
    data = data.replace("<", "\\u003c")
    fill = {"TITLE": escape(title), "META": escape(meta), "DATA": data,
            "CLASSES": "\n".join(f".{k}{{{v}}}" for k, v in _CSS_COLOURS.items())}
    template = (files("dgcli") / "data" / "replay.html").read_text(encoding="utf-8")
    return _PLACEHOLDER.sub(lambda m: fill[m.group(1)], template)  # one pass: filled text is never re-scanned


def save_html(path: str | Path, w: Watch, title: str, meta: str = "") -> None:
    """A self-contained page (inline CSS, JS and data; no network) that replays every frame."""
    try:
        Path(path).write_text(html_page(w, title, meta), encoding="utf-8")
    except OSError as e:
        raise UserError(f"--save-html {path}: cannot write ({e.strerror}); pick a writable path") from None
