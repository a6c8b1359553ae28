"""End-to-end checks of dgemma watch where users see it: a real terminal (tmux) and a real browser (Chromium).

tmux: `dgemma watch` on a random checkpoint inside a tmux pane, read with capture-pane: a mid-run frame,
a resize, the final answer; then Ctrl-C mid-run must leave a usable shell with its cursor shown.
Chromium (headless, driven over its DevTools pipe, no network): the --save-html replay is scrubbed to
the last step with the mouse and screenshotted; the page must then show the final text, with the
canvas positions drawn apart.
Both tools are installed by .ci/run; where one is missing the test skips and says so.
"""

from __future__ import annotations

import base64
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_watch import TEXT_CONFIG

DGEMMA = Path(sys.executable).with_name("dgemma")
TMUX = shutil.which("tmux")
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_tmux = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux; .ci/run does)")
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="Chromium is not installed (apt-get install chromium; .ci/run does)")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from dgcli.checkpoint.random_weights import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("e2e") / "ckpt", TEXT_CONFIG, canvas_length=16)


def _cli(*args: str):
    from dgcli.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _alnum(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "", s)


# ---- tmux ------------------------------------------------------------------------------------------


class Term:
    """A private tmux server (own socket) running a plain bash in one pane."""

    def __init__(self, tmp: Path, width: int = 100, height: int = 30):
        self.base = [TMUX, "-u", "-S", str(tmp / "tmux.sock"), "-f", "/dev/null"]
        env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TMUX", "COLUMNS", "LINES")}
        env |= {"LC_ALL": "C.UTF-8", "PS1": "$ ", "PATH": f"{DGEMMA.parent}:{env.get('PATH', '')}"}
        subprocess.run(self.base + ["new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
                                    "bash --norc --noprofile"], check=True, env=env)

    def tmux(self, *args: str) -> str:
        return subprocess.run(self.base + list(args), check=True, capture_output=True, text=True).stdout

    def send(self, keys: str, *, enter: bool = True) -> None:
        self.tmux("send-keys", "-t", "t", "-l", keys)
        if enter:
            self.tmux("send-keys", "-t", "t", "Enter")

    def screen(self) -> str:
        """Visible screen and scrollback, with lines the terminal wrapped joined back (-J)."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-500", "-t", "t")

    def cursor_visible(self) -> bool:
        return self.tmux("display-message", "-p", "-t", "t", "#{cursor_flag}").strip() == "1"

    def wait_for(self, pattern: str, timeout: float = 90.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.screen())
            if m:
                return m
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} on the screen after {timeout}s:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(self.base + ["kill-server"], capture_output=True)


@pytest.fixture
def term(tmp_path):
    t = Term(tmp_path)
    yield t
    t.close()


def _clean_seed(ckpt: Path, args: list[str]) -> tuple[int, str]:
    """A seed whose answer is printable text (a control byte from random weights would move the cursor)
    and that runs every block (random weights may emit a stop id; which seeds do depends on the
    machine's float summation order, so the seed is chosen here, not fixed)."""
    for seed in range(24):
        out = json.loads(_cli("generate", "--model", str(ckpt), "--seed", str(seed), "--format", "json", *args).stdout)
        text = out["text"].rstrip("\n")
        if (out["finish_reason"] == "length" and len(_alnum(text)) >= 6
                and all(ch.isprintable() or ch == "\n" for ch in text)):
            return seed, text
    raise AssertionError("no seed in 0..23 gave a printable answer that runs every block on the random checkpoint")


@pytest.mark.slow  # ~10 s in tmux; test_watch.py checks frames, wrapping, finished blocks in-process
@needs_tmux
def test_live_view_in_tmux_shows_frames_follows_resize_and_leaves_the_answer(ckpt, term):
    args = ["--diffusion-steps", "6", "--blocks", "2", "hello there"]
    seed, answer = _clean_seed(ckpt, args)
    term.send(f"dgemma watch --model {ckpt} --seed {seed} --step-delay 0.4 {' '.join(args[:-1])} "
              f"'hello there'; echo __END_$?__")
    # A mid-run frame: status line, then the canvas under it; the cursor is hidden while it animates.
    m = term.wait_for(r"block 1 of at most 2 · step ([1-4])/6 · T \d\.\d{3} · accepted \d+/16 · mean H [\d.]+ · elapsed "
                      r"[\d.]+s\n(.+)\n")
    assert m.group(2).strip() and not term.cursor_visible()
    # Narrow the terminal mid-run: the next frames are drawn at the new width.
    term.tmux("resize-window", "-t", "t", "-x", "60")
    shown = term.wait_for(r"block 2 of at most 2 · step [1-5]/6[\s\S]*").group(0)
    assert max(len(line) for line in shown.rstrip("\n").splitlines()) <= 60, shown
    term.wait_for(r"__END_0__")
    screen = term.screen()
    # Each finished block leaves only its status line above; the answer is printed once, after them.
    before_end = screen[: screen.index("__END_0__")]
    # (Rich wraps a status line printed at 60 columns itself, so the lines are joined back first.)
    body = " ".join(before_end[: before_end.rindex("dgemma: note: the answer ended at the")].splitlines())
    m = re.search(r"block 1 of at most 2 · step 6/6 [^│]*?stopped: step cap\s*"
                  r"block 2 of at most 2 · step 6/6 [^│]*?stopped: step cap(.*)$", body)
    assert m and _alnum(m.group(1)) == _alnum(answer), (answer, screen)
    assert term.cursor_visible()


@needs_tmux
def test_ctrl_c_mid_run_leaves_a_usable_shell(ckpt, term):
    term.send(f"dgemma watch --model {ckpt} --diffusion-steps 40 --step-delay 0.5 'hello'; echo __END_$?__")
    term.wait_for(r"block 1 of at most 1 · step [2-9]/40")
    term.tmux("send-keys", "-t", "t", "C-c")
    term.wait_for(r"__END_130__", timeout=20)
    screen = term.screen()
    assert "dgemma: interrupted" in screen and "Traceback" not in screen
    assert term.cursor_visible()  # Rich hid it for the animation and gave it back
    term.send("echo alive-$((6*7))")
    term.wait_for(r"\nalive-42\n", timeout=10)


# ---- Chromium ----------------------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--remote-debugging-pipe"]


class DevTools:
    """Chromium's DevTools protocol over --remote-debugging-pipe (fd 3 in, fd 4 out; NUL-separated JSON)."""

    def __init__(self, profile: Path):
        # The shell maps our stdin/stdout pipes onto the fds 3 and 4 the browser expects.
        self.proc = subprocess.Popen(
            ["sh", "-c", 'exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>/dev/null', CHROMIUM, *CHROMIUM_FLAGS,
             f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.n, self.buf, self.events = 0, b"", []

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise AssertionError("Chromium did not answer in time")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                raise AssertionError("Chromium closed its DevTools pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params) -> dict:
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params} | ({"sessionId": session} if session else {})
        self.proc.stdin.write(json.dumps(msg).encode() + b"\0")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            reply = self._message(deadline)
            if reply.get("id") == self.n:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]
            self.events.append(reply)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@needs_chromium
def test_html_replay_scrubbed_to_the_last_step_shows_the_final_text(ckpt, tmp_path):
    page, trace = tmp_path / "run.html", tmp_path / "run.jsonl"
    _cli("watch", "--model", str(ckpt), "--diffusion-steps", "5", "--blocks", "2", "--trace", str(trace),
         "--save-html", str(page), "hello there")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    strings = records[-1]["token_strings"]
    final = "".join(strings[str(t)] for r in records if r["type"] == "commit"
                    for t in (r["tokens"] if r["stop_index"] is None else r["tokens"][: r["stop_index"]]))
    frames = 2 + sum(records[-1]["steps_per_block"])

    browser = DevTools(tmp_path / "profile")
    try:
        target = browser.call("Target.createTarget", url="about:blank")["targetId"]
        s = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.call("Network.enable", s)
        browser.call("Emulation.setDeviceMetricsOverride", s, width=1000, height=700, deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", s, url=page.as_uri())

        def js(expr: str):
            return browser.call("Runtime.evaluate", s, expression=expr, returnByValue=True)["result"].get("value")

        deadline = time.monotonic() + 30
        while js("document.readyState") != "complete" or not js("document.getElementById('pos').textContent"):
            assert time.monotonic() < deadline, "the replay page did not load"
            time.sleep(0.1)
        assert js("document.getElementById('pos').textContent") == f"frame 1/{frames}"
        box = js("JSON.stringify(document.getElementById('answer').hidden)")
        assert box == "true"  # the final text is not shown before the last step

        def shot(name: str, clip: dict | None = None) -> bytes:
            params = {"format": "png"} | ({"clip": clip | {"scale": 1}} if clip else {})
            png = base64.b64decode(browser.call("Page.captureScreenshot", s, **params)["data"])
            (tmp_path / name).write_bytes(png)
            return png

        region = {"x": 0, "y": 300, "width": 1000, "height": 300}  # under the controls: where the answer appears
        first, first_region = shot("first.png"), shot("first-region.png", region)
        # Scrub with the mouse: press on the slider's thumb and drag it past the right end.
        r = json.loads(js("JSON.stringify(document.getElementById('scrub').getBoundingClientRect())"))
        y = r["y"] + r["height"] / 2
        for kind, x in (("mousePressed", r["x"] + 3), ("mouseMoved", r["x"] + r["width"] / 2),
                        ("mouseMoved", r["x"] + r["width"] + 40), ("mouseReleased", r["x"] + r["width"] + 40)):
            browser.call("Input.dispatchMouseEvent", s, type=kind, x=x, y=y, button="left",
                         buttons=0 if kind == "mouseReleased" else 1, clickCount=1)
        assert js("document.getElementById('pos').textContent") == f"frame {frames}/{frames}"
        assert "stopped: step cap" in js("document.getElementById('status').textContent")
        # Positions are drawn apart: 16 cells with a visible separator between each two.
        cells = json.loads(js("JSON.stringify([...document.getElementById('canvas').children]"
                              ".map((e) => [e.className, e.textContent, e.getBoundingClientRect().width]))"))
        seps = [c for c in cells if c[0] == "sep"]
        assert len(cells) == 31 and len(seps) == 15 and all(c[1] == "│" and c[2] > 0 for c in seps), cells
        assert [c[0] == "sep" for c in cells] == [n % 2 == 1 for n in range(31)]
        answer_rect = json.loads(js("JSON.stringify(document.getElementById('answer').getBoundingClientRect())"))
        assert answer_rect["height"] > 0
        shown = js("document.getElementById('final').innerText")
        assert _alnum(shown) == _alnum(final) and _alnum(final), (shown, final)
        last, last_region = shot("last.png"), shot("last-region.png", region)
        assert last.startswith(b"\x89PNG") and last != first
        assert last_region != first_region  # the answer's pixels were drawn where the page was blank before
        # Nothing was fetched from a network: the page is self-contained.
        urls = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
        assert urls and all(u.startswith(("file:", "data:", "about:")) for u in urls), urls
    finally:
        browser.close()
