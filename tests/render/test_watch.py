"""Tests for dgcli.render.frames and .watch (frames, colour classes, status line, pictures) and dgemma watch
(live = replay).

A scripted event stream (real `dgcli.sampling.events` objects, so the records are the sampler's) checks the
rendering exactly; a random checkpoint checks that a replayed trace gives the live run's frames.
The terminal (tmux) and browser (chromium) checks are in test_watch_e2e.py.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from rich.text import Text
from typer.testing import CliRunner

from dgcli.render.frames import RENOISED, SEPARATOR, Committed, Frame, display_piece, kind_of, status_line
from dgcli.render.watch import (Display, Pieces, Watch, canvas_text, html_data, html_page, live_view, make_console,
                                plain, render_frame, save_html, save_svg)
from dgcli.sampling.events import BlockStart, Commit, Done, Step

PIECES = {1: "<eos>", 10: " The", 11: " cat", 12: " sat", 13: " on", 14: " the", 15: " mat",
          20: "zq", 21: "\nxv", 22: "kk"}
START = [20, 21, 22, 20, 21, 22]
STEP1 = dict(argmax=[10, 21, 12, 22, 20, 1], accepted=[1, 0, 1, 0, 0, 0], entropy=[5e-4, 2.0, 0.05, 3.0, 3.0, 2.5])
STEP2 = dict(argmax=[10, 11, 12, 13, 15, 1], accepted=[1, 1, 1, 1, 1, 1], entropy=[1e-4, 5e-3, 0.02, 0.2, 9e-4, 3e-3])


def _step(step: int, argmax, accepted, entropy, temperature: float, stop=None) -> Step:
    a, h = torch.tensor(argmax), torch.tensor(entropy, dtype=torch.float32)
    m = torch.tensor(accepted, dtype=torch.bool)
    return Step(block=0, step=step, max_steps=3, temperature=temperature, canvas_in=torch.tensor(START), argmax=a,
                sample=a, accepted_mask=m, accepted_count=m.sum(), entropy=h, mean_entropy=h.mean(),
                next_canvas=a, stop_reason=stop, elapsed_s=0.25)


def scripted_records() -> list[dict]:
    """One block of six positions: noise, a half-accepted step, a fully accepted stop, the commit."""
    events = [BlockStart(block=0, num_blocks=1, prefix_len=4, canvas=torch.tensor(START)),
              _step(1, **STEP1, temperature=0.8),
              _step(2, **STEP2, temperature=0.6, stop="stable_confident"),
              Commit(block=0, tokens=STEP2["argmax"], stop_index=5),
              Done(token_ids=STEP2["argmax"][:5], finish_reason="stop", stop_id=1, blocks=1, steps_per_block=[2],
                   decoder_passes=2, tokens_per_forward=3.0)]
    return [e.to_record() for e in events]


def fed(display: Display | None = None) -> Watch:
    w = Watch(Pieces(table=PIECES), max_steps=3, display=display)
    for rec in scripted_records():
        w.feed(rec)
    return w


def span_classes(text) -> list[set[str]]:
    """The `watch.*` classes on each canvas cell (cells are the spans of the main class; separators are not cells)."""
    cells = [s for s in text.spans if s.style not in ("watch.changed", "watch.sep")]
    changed = [s for s in text.spans if s.style == "watch.changed"]
    return [{s.style.removeprefix("watch.")} | {"changed" for c in changed if (c.start, c.end) == (s.start, s.end)}
            for s in cells]


def test_frames_carry_kinds_changes_and_status():
    w = fed()
    start, first, last = w.frames
    assert start.step == 0 and start.kinds == (RENOISED,) * 6 and not any(start.changed)
    # Step 1: accepted cells by entropy (5e-4 -> level 3, 0.05 -> level 1), the rest renoised; changed
    # compares with the starting canvas (cell 1 kept id 21).
    assert first.kinds == (3, RENOISED, 1, RENOISED, RENOISED, RENOISED)
    assert first.changed == (True, False, True, True, True, True)
    assert last.kinds == (3, 2, 1, 0, 3, 2)
    assert last.changed == (False, True, False, True, True, False)
    mean = float(torch.tensor(STEP2["entropy"]).mean())
    # The block count is a cap (the answer may end at an earlier block): "of at most", never "1/4".
    assert status_line(last) == (f"block 1 of at most 1 · step 2/3 · T 0.600 · accepted 6/6 · mean H {mean:.4f} · "
                                 "elapsed 0.50s · stopped: stable+confident")
    assert status_line(start) == "block 1 of at most 1 · step 0/3 · noise · elapsed 0.00s"
    assert [c.ids for c in w.commits] == [(10, 11, 12, 13, 15)]
    assert w.final_text() == " The cat sat on mat"


def test_canvas_cells_have_the_class_of_their_state():
    w = fed()
    first, last = w.frames[1], w.frames[2]
    assert span_classes(canvas_text(first, w.pieces)) == [
        {"acc3", "changed"}, {"renoised"}, {"acc1", "changed"}, {"renoised", "changed"}, {"renoised", "changed"},
        {"renoised", "changed"}]
    assert span_classes(canvas_text(last, w.pieces)) == [
        {"acc3"}, {"acc2", "changed"}, {"acc1"}, {"acc0", "changed"}, {"acc3", "changed"}, {"acc2"}]


def test_recorded_console_shows_status_styles_and_final_text():
    console = make_console(record=True, file=io.StringIO(), width=120, force_terminal=True,
                           color_system="truecolor", no_color=False)
    w = fed(Display(console, "blocks", Pieces(table=PIECES)))
    out = console.export_text()
    # "blocks" mode prints the last frame of each block: status line first, then the canvas.
    assert out.splitlines()[0] == status_line(w.frames[-1])
    assert out.splitlines()[1] == " The│ cat│ sat│ on│ mat│<eos>"  # one cell per position, separated
    # The resolved styles per cell: the colour classes really reach the terminal.
    segs = [s for s in console.render(canvas_text(w.frames[1], w.pieces)) if s.text.strip()]
    by_text = {s.text: s.style for s in segs}
    assert by_text[" The"].bold and by_text[" The"].color.name == "bright_green" and by_text[" The"].underline
    assert by_text["↵xv"].dim and not by_text["↵xv"].underline  # renoised, unchanged
    assert by_text["kk"].dim and by_text["kk"].underline  # renoised, changed
    assert by_text[" sat"].color.name == "yellow"


def test_adjacent_word_pieces_are_drawn_apart_but_the_answer_is_the_real_text(tmp_path):
    # " G" + "od": two positions of one English word; drawn joined they would read as one cell " God".
    pieces = Pieces(table={30: " And", 31: " G", 32: "od", 33: " said"})
    ids = (30, 31, 32, 33)
    f = Frame(0, 1, 1, 4, ids, (3,) * 4, (False,) * 4, 0.1, 0.5, 4, 0.0, "stable_confident")
    w = Watch(pieces, 4)
    w.frames.append(f)
    w.commits.append(Committed(0, ids, f))
    assert plain(canvas_text(f, pieces)) == " And│ G│od│ said\n"  # terminal: a boundary inside the word
    # The live view's answer so far is the real text above the next frame.
    assert plain(live_view(f, list(ids), pieces)).startswith(" And God said\n") and w.final_text() == " And God said"
    save_svg(tmp_path / "run.svg", w, "t")
    svg = (tmp_path / "run.svg").read_text().replace("&#160;", " ")
    assert re.search(r">\s?G</text>.*?>│</text>.*?>od</text>", svg, re.S)  # SVG: the separator between them
    data = html_data(w, "t", "")
    assert data["sep"] == SEPARATOR and [data["cell"][i] for i in data["frames"][0]["i"]] == list(
        map(pieces.__getitem__, ids))  # HTML: the page draws `sep` between cells (checked in Chromium)
    assert "".join(data["raw"][i] for i in data["blocks"][0]) == " And God said"


def test_no_color_keeps_dim_and_underline_but_drops_colours(monkeypatch):
    def sgr_params(ansi: str) -> set[int]:
        return {int(p) for m in re.findall(r"\x1b\[([\d;]*)m", ansi) for p in m.split(";") if p}

    colour = set(range(30, 50)) | set(range(90, 108))
    w = fed()
    for no_color in (False, True):
        if no_color:
            monkeypatch.setenv("NO_COLOR", "1")
        console = make_console(file=io.StringIO(), width=80, force_terminal=True, color_system="truecolor")
        console.print(render_frame(w.frames[1], w.pieces))
        params = sgr_params(console.file.getvalue())
        assert {2, 4} <= params  # dim (renoised) and underline (changed) survive NO_COLOR
        assert bool(params & colour) is not no_color


def test_long_canvas_wraps_to_the_width():
    pieces = Pieces(table={i: f" w{i}" for i in range(200)} | {999: "x" * 70})
    ids = tuple(range(200)) + (999,)
    f = Frame(0, 2, 5, 8, ids, (0,) * len(ids), (False,) * len(ids), 1.5, 0.5, 12, 0.25, None)
    lines = plain(render_frame(f, pieces), width=30).splitlines()
    assert len(lines) > 20 and max(len(line) for line in lines) <= 30
    assert "".join(lines).replace(" ", "").startswith("block1ofatmost2·step5/8")
    assert "x" * 30 in lines[-3:][0] + lines[-3:][1] + lines[-3:][2]  # a run with no spaces is folded


def test_display_piece_keeps_the_layout():
    assert [display_piece(p) for p in ("\n", "a\tb", "", "\x1b[31m", " ok")] == ["↵", "a→b", "∅", "·[31m", " ok"]
    assert kind_of(0, 0.0) == RENOISED and [kind_of(1, h) for h in (0.5, 0.05, 0.005, 0.0005)] == [0, 1, 2, 3]


def test_html_replay_is_self_contained_and_holds_every_frame(tmp_path):
    w = fed()
    w.pieces.table[12] = "</script><script>alert(1)</script>"  # model text must not end the data block
    path = tmp_path / "run.html"
    save_html(path, w, "dgemma watch · test", "prompt: <b>x</b>")
    page = path.read_text()
    assert page.count("<script") == 2 and "<b>x</b>" not in page
    assert not re.search(r"(src|href)\s*=|<link|@import|url\(|https?://", page)  # nothing to fetch
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1))
    assert [f["status"] for f in data["frames"]] == [status_line(f) for f in w.frames]
    assert "".join(data["raw"][i] for b in data["blocks"] for i in b).startswith(" The cat</script>")
    for name in ("play", "scrub", "speed", "canvas", "status", "answer", "final"):
        assert f'id="{name}"' in page


def test_html_template_is_filled_once_and_escaped():
    template = (files("dgcli") / "data" / "replay.html").read_text(encoding="utf-8")
    assert re.findall(r"\{\{(\w+)\}\}", template) == ["TITLE", "CLASSES", "TITLE", "META", "DATA"]
    w = fed()
    w.pieces.table[13] = " {{TITLE}}<!--"  # placeholder-like model text stays text (one pass, "<" escaped)
    page = html_page(w, "t & <i>", "meta {{DATA}} <b>")
    assert "<title>t &amp; &lt;i&gt;</title>" in page and '<div id="meta">meta {{DATA}} &lt;b&gt;</div>' in page
    assert ".acc3{color:#5cff7a;font-weight:bold}" in page and "{{CLASSES}}" not in page
    data = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S).group(1))
    assert " {{TITLE}}<!--" in data["raw"] and "<!--" not in page.split('id="data">')[1]


def test_svg_holds_the_last_frame_of_every_block(tmp_path):
    w = fed()
    path = tmp_path / "run.svg"
    save_svg(path, w, "dgemma watch · test")
    svg = path.read_text()
    assert svg.startswith("<svg") and "dgemma&#160;watch" in svg.replace(" ", "&#160;")
    assert "stable+confident" in svg.replace("&#160;", " ")
    assert not re.search(r"url\(\W*http", svg)  # no web font fetched (url(#clip) refs are local)
    with pytest.raises(Exception, match="--save-svg"):
        save_svg(tmp_path / "missing" / "x.svg", w, "t")


# ---- the command, on a random checkpoint ---------------------------------------------------------

S, F = "sliding_attention", "full_attention"
TEXT_CONFIG = dict(vocab_size=512, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1,
                   head_dim=8, global_head_dim=16, num_experts=4, top_k_experts=2, sliding_window=6,
                   layer_types=[S, F], max_position_embeddings=4096)
RUN = ["--diffusion-steps", "5", "--blocks", "2", "--seed", "3", "hello there"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from dgcli.checkpoint.random_weights import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("watch") / "ckpt", TEXT_CONFIG, canvas_length=16)


def _invoke(*args: str):
    from dgcli.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _html_frames(path: Path) -> dict:
    page = path.read_text()
    return json.loads(re.search(r'id="data">(.*?)</script>', page, re.S).group(1))


def _trace_records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for volatile in ("created", "elapsed_s", "timings"):  # wall-clock values
            rec.pop(volatile, None)
        out.append(rec)
    return out


def test_replay_reproduces_the_live_frames(ckpt, tmp_path):
    t, live_html, live_svg = tmp_path / "t.jsonl", tmp_path / "live.html", tmp_path / "live.svg"
    live = _invoke("watch", "--model", str(ckpt), "--trace", str(t), "--save-html", str(live_html),
                   "--save-svg", str(live_svg), *RUN)
    generated = _invoke("generate", "--model", str(ckpt), "--trace", str(tmp_path / "g.jsonl"), *RUN)
    assert live.stdout == generated.stdout  # the final answer is printed as generate prints it
    assert _trace_records(t) == _trace_records(tmp_path / "g.jsonl")  # watch --trace is generate's trace
    # Not a terminal here: one frame per block on stderr, with a note.
    assert "not a terminal" in live.stderr
    # Whole lines, not wrapped at 80 columns: a log has no width (random weights: never stable).
    status = [ln for ln in live.stderr.splitlines() if ln.startswith("block ")]
    assert [ln.split(" · ")[:2] for ln in status] == [["block 1 of at most 2", "step 5/5"],
                                                      ["block 2 of at most 2", "step 5/5"]]
    assert all(len(ln) > 80 and ln.endswith(" · stopped: step cap") for ln in status), status
    canvases = [live.stderr.splitlines()[live.stderr.splitlines().index(ln) + 1] for ln in status]
    assert all(c.count(SEPARATOR) >= 15 for c in canvases), canvases  # 16 positions on the line under it

    replay_html, replay_svg = tmp_path / "replay.html", tmp_path / "replay.svg"
    replay = _invoke("watch", "--replay", str(t), "--speed", "0", "--save-html", str(replay_html),
                     "--save-svg", str(replay_svg))
    frames = _html_frames(live_html)
    assert len(frames["frames"]) == 2 + sum(json.loads(t.read_text().splitlines()[-1])["steps_per_block"])
    assert _html_frames(replay_html) == frames  # every frame: ids, classes, status line
    assert replay_svg.read_text() == live_svg.read_text()
    budget_note = re.compile(r"^dgemma: note: the answer ended at the .*budget.*\n", re.M)  # live only: replay has no budget
    assert replay.stderr == budget_note.sub("", live.stderr)
    final = "".join(frames["raw"][i] for block in frames["blocks"] for i in block)
    assert replay.stdout == final.rstrip("\n") + "\n"


class _Clock:
    """A stand-in for dgcli.render.watch's `time`: sleeping advances it, and each sleep is recorded."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_terminal_gets_a_default_pace_unless_one_is_chosen(ckpt, monkeypatch):
    """The README's prompts end in 2 steps (0.02 s): on a terminal each step is held DEFAULT_PACE_S unless
    --fps, --step-delay or --speed chose a pace; --step-delay 0 turns it off; a pipe is never paced."""
    import dgcli.cli.watch as cmd
    import dgcli.render.watch as rw

    terminal = lambda: (make_console(file=io.StringIO(), force_terminal=True, width=100), "live", None)  # noqa: E731
    for args, tty, paced in (([], True, True), (["--step-delay", "0"], True, False), (["--fps", "30"], True, False),
                             ([], False, False)):
        clock = _Clock()
        monkeypatch.setattr(rw, "time", clock)
        with monkeypatch.context() as m:
            if tty:
                m.setattr(cmd, "_screen", terminal)
            _invoke("watch", "--model", str(ckpt), *args, *RUN)
        assert (set(clock.sleeps) == {cmd.DEFAULT_PACE_S} if paced else clock.sleeps == []), (args, tty, clock.sleeps)
    assert 0.1 <= cmd.DEFAULT_PACE_S <= 0.3


def test_on_a_terminal_a_finished_block_leaves_its_status_line_not_its_text(monkeypatch):
    """The answer is printed once at the end (dgcli.cli.watch): a finished block must not also leave its
    text above the live view, where the end's copy would repeat it."""
    console = make_console(file=io.StringIO(), force_terminal=True, width=100)
    printed, real = [], console.print
    monkeypatch.setattr(console, "print", lambda *a, **k: (printed.append(a), real(*a, **k)))
    display = Display(console, "live", Pieces(table=PIECES))
    with display:
        w = fed(display)
    above = [plain(a[0]) for a in printed if a and isinstance(a[0], Text)]
    assert above == [status_line(w.frames[-1]) + "\n"]
    assert display.answer == list(w.commits[0].ids)  # shown in the view instead, until the end


def test_a_dumb_terminal_gets_the_blocks_view(monkeypatch):
    """TERM=dumb: no cursor movement, so a live view would show nothing but the status lines: the pipe's view."""
    import dgcli.cli.watch as cmd

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "dumb")
    assert cmd._screen()[1] == "blocks"
    monkeypatch.setenv("TERM", "xterm-256color")
    assert cmd._screen()[1] == "live"


def test_a_picture_place_that_is_not_writable_is_refused_before_the_run(monkeypatch, tmp_path):
    import os

    from dgcli.cli.watch import _check_outputs
    from dgcli.errors import UserError

    real = os.access  # root writes anywhere: the folder answers as it would for a user
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path) else real(p, mode, **kw))
    with pytest.raises(UserError, match="--save-svg .*x.svg: cannot write there"):
        _check_outputs(save_svg=str(tmp_path / "x.svg"))


def test_a_picture_that_fails_to_write_costs_no_answer(ckpt, monkeypatch, tmp_path):
    import dgcli.render.watch as rw

    def fail(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(rw, "save_svg", fail)
    from dgcli.cli import app

    r = CliRunner().invoke(app, ["watch", "--model", str(ckpt), "--save-svg", str(tmp_path / "x.svg"), *RUN])
    assert r.stdout.strip() and isinstance(r.exception, OSError)  # the answer came out before the picture failed


def _dgemma(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("dgemma")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)


def test_bad_traces_give_one_line_and_exit_2(tmp_path):
    good = scripted_records()
    good[-1]["token_strings"] = {str(k): v for k, v in PIECES.items()}  # as TraceWriter adds them
    header = {"type": "header", "format": "dgemma-trace", "version": 1, "settings": {}, "model": "m"}
    lines = [json.dumps(header)] + [json.dumps(r) for r in good]
    cases = {"truncated.jsonl": ("\n".join(lines[:-1]) + "\n" + lines[-1][:20], "truncated"),
             "nodone.jsonl": ("\n".join(lines[:-1]) + "\n", "truncated"),
             "version.jsonl": ("\n".join([json.dumps(header | {"version": 99})] + lines[1:]) + "\n", "version 99"),
             "notes.txt": ("hello, world\n", "not a dgemma trace"),
             # fields of another type (a list for settings, a list for the answer's token strings): was a traceback
             "types.jsonl": ("\n".join([json.dumps(header | {"settings": [1]})] + lines[1:]) + "\n", "another type"),
             "strings.jsonl": ("\n".join(lines[:-1] + [json.dumps(good[-1] | {"token_strings": [1]})]) + "\n",
                               "another type")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        r = _dgemma("watch", "--replay", str(tmp_path / name))
        assert r.returncode == 2 and r.stdout == "", (name, r)
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("dgemma: error: "), (name, r.stderr)
        assert message in r.stderr and (message == "truncated") == ("truncated" in r.stderr), (name, r.stderr)
    (tmp_path / "ok.jsonl").write_text("\n".join(lines) + "\n")
    ok = _dgemma("watch", "--replay", str(tmp_path / "ok.jsonl"), "--speed", "0")
    assert ok.returncode == 0 and ok.stdout == " The cat sat on mat\n", ok


@pytest.mark.parametrize("args, message", [
    (["--fps", "0", "x"], "--fps"), (["--step-delay", "-1", "x"], "--step-delay"), (["--speed", "2", "x"], "--speed"),
    (["--replay", "t.jsonl", "prompt"], "drop PROMPT"), (["--save-html", "/no/such/dir/x.html", "x"], "--save-html"), (["--replay", "t.jsonl", "--diffusion-steps", "4"], "drop"),
    (["--step-delay", "nan", "x"], "--step-delay nan: give a finite number"), (["--fps", "inf", "x"], "--fps inf"),
    (["--replay", "t.jsonl", "--speed", "1e-300"], "too slow"), (["--save-svg", "/tmp", "x"], "is a directory"),
    (["--replay", "t.jsonl", "--raw", "--thinking"], "drop --thinking, --raw")])  # a replay reads no prompt
def test_bad_options_are_one_line_errors(args, message):
    from dgcli.cli.watch import watch
    from dgcli.errors import UserError

    import typer

    app = typer.Typer()
    app.command()(watch)
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, UserError) and message in str(result.exception), result.output
