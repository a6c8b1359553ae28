"""What `dgemma watch` shows: frames of the canvas, built from sampler records, drawn or exported.

Owns: folding the record dicts of one run (`event.to_record()` live, `read_trace` records in a replay)
into `Frame`s (pure data: one per block start and per step), rendering a frame with Rich (canvas of
current best tokens, colour classes, status line), the terminal display with its pacing (`Display`),
and the two pictures: SVG (Rich's export) and a self-contained HTML replay. Live and replay feed the
same records through the same `Watch`, so they produce the same frames by construction.
Must not: run the model, tokenize, or read or write traces (cmd_watch, the sampler and dgcli.render.trace do).

Colour classes (terminal styles, SVG and HTML CSS share the names):
  renoised   the position was not accepted this step: its sample is replaced by noise (dim)
  acc0..acc3 accepted, by the entropy of its distribution: acc3 < 0.001 <= acc2 < 0.01 <= acc1 < 0.1 <= acc0 nats
  changed    its best token differs from the previous step's (first step: from the starting canvas)
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Callable, Iterable, Literal

from rich.console import CONSOLE_SVG_FORMAT, Console, Group, RenderableType
from rich.live import Live
from rich.text import Text
from rich.theme import Theme

from dgcli.errors import UserError

RENOISED = 4  # kind of a position that was renoised; 0..3 are the accepted confidence levels
ENTROPY_EDGES = (1e-1, 1e-2, 1e-3)  # nats; accepted positions below edge i are at least level i + 1
CLASSES = ("acc0", "acc1", "acc2", "acc3", "renoised")  # index = kind
STYLES = {"acc0": "red", "acc1": "yellow", "acc2": "green", "acc3": "bold bright_green",
          "renoised": "dim", "changed": "underline", "status": "bold"}
# Underline (not only a colour) marks changed positions, so they still stand out under NO_COLOR.
THEME = Theme({f"watch.{k}": v for k, v in STYLES.items()})
STOP_LABELS = {"stable_confident": "stable+confident", "step_cap": "step cap"}
SVG_WIDTH = 120  # columns of the exported pictures, so they look the same whatever the terminal was


def kind_of(accepted: int, entropy: float) -> int:
    """RENOISED, or the confidence level 0..3 of an accepted position."""
    if not accepted:
        return RENOISED
    return sum(entropy < edge for edge in ENTROPY_EDGES)


def display_piece(piece: str) -> str:
    """A token piece as one canvas cell: visible whitespace, so noise never breaks the layout."""
    if piece == "":
        return "∅"
    return "".join({"\n": "↵", "\t": "→", "\r": "␍"}.get(ch, "·" if ord(ch) < 32 or ord(ch) == 127 else ch)
                   for ch in piece)


class Pieces:
    """Token id -> display string, from a tokenizer (live) or a trace's `token_strings` (replay)."""

    def __init__(self, fetch: Callable[[list[int]], list[str]] | None = None, table: dict[int, str] | None = None):
        self.fetch = fetch
        self.table: dict[int, str] = dict(table or {})

    @classmethod
    def from_trace(cls, done: dict) -> "Pieces":
        return cls(table={int(k): v for k, v in (done.get("token_strings") or {}).items()})

    def learn(self, ids: Iterable[int]) -> None:
        missing = sorted({i for i in ids if i not in self.table})
        if missing and self.fetch is not None:
            self.table.update(zip(missing, self.fetch(missing)))

    def __getitem__(self, i: int) -> str:
        return self.table.get(i, f"⟨{i}⟩")  # a trace written without a tokenizer still replays, as ids

    def text(self, ids: Iterable[int]) -> str:
        return "".join(self[i] for i in ids)


# ---- records -> frames ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """What the screen shows at one moment: a block's canvas after a step (step 0: the starting noise)."""

    block: int  # 0-based
    num_blocks: int
    step: int  # 0 = the block's starting canvas, else 1-based step
    max_steps: int
    ids: tuple[int, ...]  # the current best token per position (step 0: the starting canvas)
    kinds: tuple[int, ...]  # per position: RENOISED or accepted level 0..3
    changed: tuple[bool, ...]  # per position: best token differs from the previous frame's
    elapsed_s: float  # model time so far (sum of recorded step times): the same live and in replay
    temperature: float | None = None
    accepted: int | None = None
    mean_entropy: float | None = None
    stop_reason: str | None = None

    def classes(self, i: int) -> list[str]:
        return [CLASSES[self.kinds[i]]] + (["changed"] if self.changed[i] else [])


@dataclass(frozen=True)
class Committed:
    """A finished block: its answer ids (cut at the stop id) and the frame it ended on."""

    block: int
    ids: tuple[int, ...]
    last: Frame


class Tracker:
    """Folds one run's records (block_start, step, commit, done) into Frames and Committed blocks."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.prev: list[int] = []
        self.elapsed = 0.0
        self.num_blocks = 1
        self.last: Frame | None = None

    def feed(self, rec: dict) -> Frame | Committed | None:
        kind = rec["type"]
        if kind == "block_start":
            self.num_blocks, self.prev = rec["num_blocks"], list(rec["canvas"])
            c = len(self.prev)
            self.last = Frame(rec["block"], self.num_blocks, 0, self.max_steps, tuple(self.prev),
                              (RENOISED,) * c, (False,) * c, self.elapsed)
            return self.last
        if kind == "step":
            ids = rec["argmax"]
            self.elapsed += rec["elapsed_s"]
            self.max_steps = rec["max_steps"]
            self.last = Frame(
                rec["block"], self.num_blocks, rec["step"], rec["max_steps"], tuple(ids),
                tuple(kind_of(a, h) for a, h in zip(rec["accepted"], rec["entropy"])),
                tuple(a != b for a, b in zip(ids, self.prev)), self.elapsed, rec["temperature"],
                rec["accepted_count"], rec["mean_entropy"], rec["stop_reason"])
            self.prev = list(ids)
            return self.last
        if kind == "commit":
            tokens = rec["tokens"] if rec["stop_index"] is None else rec["tokens"][: rec["stop_index"]]
            return Committed(rec["block"], tuple(tokens), self.last)
        return None  # done: nothing new to show


# ---- rendering -----------------------------------------------------------------------------------


def status_line(f: Frame) -> str:
    parts = [f"block {f.block + 1}/{f.num_blocks}", f"step {f.step}/{f.max_steps}"]
    if f.step == 0:
        parts.append("noise")
    else:
        parts += [f"T {f.temperature:.3f}", f"accepted {f.accepted}/{len(f.ids)}", f"mean H {f.mean_entropy:.4f}"]
    parts.append(f"elapsed {f.elapsed_s:.2f}s")
    if f.stop_reason:
        parts.append("stopped: " + STOP_LABELS.get(f.stop_reason, f.stop_reason))
    return " · ".join(parts)


def canvas_text(f: Frame, pieces: Pieces) -> Text:
    """One span per position, styled by its classes (theme names `watch.<class>`)."""
    text = Text(overflow="fold")  # a noise run with no spaces still wraps at the edge
    for i, tid in enumerate(f.ids):
        start = len(text)
        text.append(display_piece(pieces[tid]), style=f"watch.{CLASSES[f.kinds[i]]}")
        if f.changed[i]:
            text.stylize("watch.changed", start, len(text))
    return text


def render_frame(f: Frame, pieces: Pieces) -> RenderableType:
    # Status first: a canvas taller than the terminal is cropped at the bottom, never the status line.
    return Group(Text(status_line(f), style="watch.status"), canvas_text(f, pieces))


def committed_text(c: Committed, pieces: Pieces) -> Text:
    """A finished block as it stays above the live view: why it stopped (dim), then its plain text."""
    return Text.assemble((status_line(c.last), "dim"), "\n", pieces.text(c.ids))


def make_console(**kw) -> Console:
    """A console that knows the watch styles. NO_COLOR is honoured by Rich unless `no_color=False` is passed."""
    return Console(theme=THEME, **kw)


def plain(renderable: RenderableType, width: int = SVG_WIDTH) -> str:
    """The text a renderable shows at `width` columns, without styles (what frame comparisons use)."""
    console = make_console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


# ---- the display ---------------------------------------------------------------------------------

Mode = Literal["live", "blocks", "off"]


class Display:
    """Shows a run's frames on a console as they come.

    live: a Rich Live view redrawn in place (committed blocks are printed above it); blocks: the last
    frame of each block printed once (for a console that is not a terminal); off: nothing.
    Pacing: by default every frame is drawn as it comes; `fps` caps the redraw rate (a block's first
    and last frames are always drawn); `step_delay` sleeps after each drawn step; `speed` (replay)
    waits each step's recorded time divided by `speed` first (0: no wait).
    """

    def __init__(self, console: Console | None, mode: Mode, pieces: Pieces, *, fps: float | None = None,
                 step_delay: float = 0.0, speed: float | None = None):
        self.console, self.mode, self.pieces = console, mode, pieces
        self.fps, self.step_delay, self.speed = fps, step_delay, speed
        self.live: Live | None = None
        self.last_draw = 0.0
        self.prev_elapsed = 0.0

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
            self.live.stop()  # also on Ctrl-C: shows the cursor again and clears the view
            self.live = None

    def show(self, item: Frame | Committed) -> None:
        if self.mode == "off":
            return
        if isinstance(item, Committed):
            if self.mode == "live":
                self.live.console.print(committed_text(item, self.pieces))  # printed above the live view
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
            self.live.update(render_frame(item, self.pieces), refresh=True)
        if self.step_delay and item.step > 0:
            time.sleep(self.step_delay)


@dataclass
class Watch:
    """Feed it a run's records in order; it keeps every frame and block, and shows them on `display`."""

    pieces: Pieces
    max_steps: int
    display: Display | None = None
    frames: list[Frame] = field(default_factory=list)
    commits: list[Committed] = field(default_factory=list)
    done: dict | None = None

    def __post_init__(self) -> None:
        self.tracker = Tracker(self.max_steps)

    def feed(self, rec: dict) -> None:
        self.pieces.learn(rec.get("argmax") or rec.get("canvas") or rec.get("tokens") or [])
        item = self.tracker.feed(rec)
        if rec["type"] == "done":
            self.done = rec
        elif isinstance(item, Frame):
            self.frames.append(item)
        elif isinstance(item, Committed):
            self.commits.append(item)
        if item is not None and self.display is not None:
            self.display.show(item)

    def final_text(self) -> str:
        """The run's text from the display pieces (a replay has no tokenizer to decode with)."""
        return "".join(self.pieces.text(c.ids) for c in self.commits)


# ---- pictures ------------------------------------------------------------------------------------


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


def html_data(w: Watch, title: str, meta: str) -> dict:
    """The replay page's data: a string table, then per frame its ids, kinds/changed codes and status."""
    ids = sorted({i for f in w.frames for i in f.ids} | {i for c in w.commits for i in c.ids})
    index = {tid: n for n, tid in enumerate(ids)}
    frames = [{"b": f.block, "i": [index[t] for t in f.ids], "status": status_line(f),
               "k": "".join(str(k + 5 * ch) for k, ch in zip(f.kinds, f.changed))} for f in w.frames]
    return {"title": title, "meta": meta, "cell": [display_piece(w.pieces[t]) for t in ids],
            "raw": [w.pieces[t] for t in ids], "frames": frames,
            "blocks": [[index[t] for t in c.ids] for c in w.commits], "classes": list(CLASSES)}


def save_html(path: str | Path, w: Watch, title: str, meta: str = "") -> None:
    """A self-contained page (inline CSS, JS and data; no network) that replays every frame."""
    data = json.dumps(html_data(w, title, meta), ensure_ascii=False, separators=(",", ":"))
    data = data.replace("<", "\\u003c")  # no "</script>" can end the data block early
    fill = {"TITLE": escape(title), "DATA": data}
    page = re.sub(r"__(TITLE|DATA)__", lambda m: fill[m.group(1)], _HTML)  # one pass: no re-substitution
    try:
        Path(path).write_text(page, encoding="utf-8")
    except OSError as e:
        raise UserError(f"--save-html {path}: cannot write ({e.strerror}); pick a writable path") from None


_CSS_COLOURS = {"acc0": "color:#ff6b6b", "acc1": "color:#e5c07b", "acc2": "color:#7ec16e",
                "acc3": "color:#5cff7a;font-weight:bold", "renoised": "color:#6b7280",
                "changed": "text-decoration:underline;background:#2b3242"}

_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{background:#16181d;color:#d7dae0;font:15px/1.5 ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace;margin:1.5em}
h1{font-size:1.1em;margin:0 0 .2em} #meta{color:#8b93a1;margin-bottom:1em;white-space:pre-wrap}
#controls{display:flex;gap:.8em;align-items:center;margin-bottom:1em} #scrub{flex:1}
button,select{font:inherit;background:#262a33;color:inherit;border:1px solid #444;border-radius:4px;padding:.1em .7em}
#above{white-space:pre-wrap;color:#d7dae0} #canvas{white-space:pre-wrap;word-break:break-all;margin:.2em 0}
#status{font-weight:bold;margin-top:.6em} #answer{white-space:pre-wrap;border-top:1px solid #444;margin-top:1em;padding-top:.6em}
.label{color:#8b93a1} #legend{color:#8b93a1;margin-top:1.5em} #legend span{margin-right:1.2em}
__CLASSES__
</style></head><body>
<h1>__TITLE__</h1><div id="meta"></div>
<div id="controls"><button id="play">play</button>
<input id="scrub" type="range" min="0" value="0" aria-label="step">
<span id="pos"></span>
<label>speed <select id="speed"><option value="400">slow</option><option value="120" selected>normal</option>
<option value="30">fast</option></select></label></div>
<div id="above"></div><div id="status"></div><div id="canvas"></div>
<div id="answer" hidden><div class="label">final text</div><div id="final"></div></div>
<div id="legend"><span class="renoised">renoised</span><span class="acc0">accepted H&ge;0.1</span>
<span class="acc1">H&lt;0.1</span><span class="acc2">H&lt;0.01</span><span class="acc3">H&lt;0.001</span>
<span class="changed">changed this step</span>; space: play/pause, &larr; &rarr;: step</div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const $ = (id) => document.getElementById(id);
const last = D.frames.length - 1;
let k = 0, timer = null;
$("meta").textContent = D.meta;
$("scrub").max = String(last);
const rawText = (ids) => ids.map((i) => D.raw[i]).join("");
function show(n) {
  k = Math.max(0, Math.min(last, n));
  const f = D.frames[k];
  $("scrub").value = String(k);
  $("pos").textContent = "frame " + (k + 1) + "/" + (last + 1);
  $("above").textContent = D.blocks.slice(0, f.b).map(rawText).join("");
  const box = document.createDocumentFragment();
  f.i.forEach((t, p) => {
    const code = Number(f.k[p]), s = document.createElement("span");
    s.className = D.classes[code % 5] + (code >= 5 ? " changed" : "");
    s.textContent = D.cell[t];
    box.appendChild(s);
  });
  $("canvas").replaceChildren(box);
  $("status").textContent = f.status;
  $("answer").hidden = k !== last;
  $("final").textContent = D.blocks.map(rawText).join("");
}
function pause() { clearInterval(timer); timer = null; $("play").textContent = "play"; }
function play() {
  if (k === last) show(0);
  timer = setInterval(() => { if (k >= last) pause(); else show(k + 1); }, Number($("speed").value));
  $("play").textContent = "pause";
}
$("play").onclick = () => (timer ? pause() : play());
$("speed").onchange = () => { if (timer) { pause(); play(); } };
$("scrub").oninput = (e) => { pause(); show(Number(e.target.value)); };
document.onkeydown = (e) => {
  if (e.key === " ") { e.preventDefault(); timer ? pause() : play(); }
  if (e.key === "ArrowRight") { pause(); show(k + 1); }
  if (e.key === "ArrowLeft") { pause(); show(k - 1); }
};
const m = /step=(last|\\d+)/.exec(location.hash);
show(m ? (m[1] === "last" ? last : Number(m[1])) : 0);
</script></body></html>
""".replace("__CLASSES__", "\n".join(f".{k}{{{v}}}" for k, v in _CSS_COLOURS.items()))
