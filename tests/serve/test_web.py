"""The web page at `/` end to end, in a real headless Chromium (Debian's `chromium`, driven by Playwright; no
browser download): `dgemma serve --api-key` on the bundled model, a wrong key shows the server's error, the
canvas is drawn live from draft events (at least two distinct frames before the answer), the final text is the
API's answer for the same messages, settings and seed (two turns), a failed request (400, 401) gives its
prompt back, New chat (keyboard, 360 px, mid-request) empties the history and the transcript, and Stop cancels
a long request and frees its slot (Stop button and Escape); each step stays on screen at watch's pace unless Pace
is off, each block's last canvas stays folded with a replay and tokens/step without padding, the empty page offers
the bundled model's four prompt shapes, errors name the form's labels, and drawing never scrolls away from a
reader who scrolled up. With DGEMMA_WEB_SHOTS=1 it also writes benchmarks/web-360.png and
benchmarks/web-1440.png. Fast checks: `serve --open` with and without a display, and the page's files ship in
the package and load nothing from another site."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from dgcli.cli import serve as serve_cli
from server_proc import serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

KEY = "web-key"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]
SETTINGS = {"steps": "16", "seed": "3", "blocks": "3"}  # the page's field ids; several steps per block
BODY = {"max_denoising_steps": 16, "seed": 3, "max_blocks": 3}  # the same settings as API fields
SHOTS = Path(__file__).resolve().parents[2] / "benchmarks"
# Records the current canvas each time the page changes it, while its turn is still running.
OBSERVE = """() => {
  window.frames_seen = [];
  new MutationObserver(() => {
    const turn = document.querySelector('#log li.assistant:last-child');
    const canvas = turn && turn.dataset.state === 'running' && turn.querySelector('.canvas');
    if (canvas && canvas.innerHTML && canvas.innerHTML !== window.frames_seen.at(-1)) window.frames_seen.push(canvas.innerHTML);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true, attributes: true});
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve("--max-batch-size", "2", "--api-key", KEY, tmp_path=tmp_path_factory.mktemp("web")) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def page(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); the web page test needs a real browser")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.set_default_timeout(30_000)
        yield page
        browser.close()


def api_answer(server, messages: list[dict], **extra) -> str:
    reply = httpx.post(server.v1 + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"messages": messages, **BODY, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return float(re.search(rf"^dgemma_{name} (\S+)$", text, re.M).group(1))


def fill(page, values: dict[str, str]) -> None:
    for field, value in values.items():
        page.fill(f"#{field}", value)


def ask(page, prompt: str) -> None:
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def turn(page, n: int):
    """The n-th (0-based) assistant turn."""
    return page.locator("#log li.assistant").nth(n)


def wait_state(page, n: int, state: str) -> None:
    from playwright.sync_api import expect

    expect(turn(page, n)).to_have_attribute("data-state", state, timeout=30_000)


@pytest.mark.slow
def test_page_asks_for_the_key_and_shows_the_servers_error(server, page):
    assert httpx.get(server.base_url + "/").status_code == 200  # the page itself needs no key
    asked = []
    page.on("request", lambda r: asked.append(r.url))
    page.goto(server.base_url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.get_attribute("link[rel=icon]", "href").startswith("data:")  # no /favicon.ico 404
    assert not [u for u in asked if u.endswith("/favicon.ico")], asked
    page.get_by_label("This server needs an API key").fill("wrong")
    page.get_by_role("button", name="Use key").click()
    wanted = httpx.get(server.v1 + "/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["message"]
    page.wait_for_function("m => document.getElementById('key-error').textContent === m", arg=wanted)
    page.get_by_label("This server needs an API key").fill(KEY)
    page.get_by_role("button", name="Use key").click()
    page.wait_for_selector("#key-form[hidden]", state="attached")
    assert page.text_content("#model") == "tiny"


@pytest.mark.slow
def test_canvas_frames_then_the_apis_answer_over_two_turns(server, page):
    fill(page, SETTINGS)
    page.evaluate(OBSERVE)
    ask(page, "Count from 7 to 31.")
    wait_state(page, 0, "done")
    frames = page.evaluate("window.frames_seen")
    assert len(frames) >= 2 and len(set(frames)) == len(frames), frames
    assert all("nats" in f for f in frames)  # each cell's entropy, from the draft's per-position fields
    first = turn(page, 0).locator(".answer").text_content()
    assert first == api_answer(server, [{"role": "user", "content": "Count from 7 to 31."}])
    stats = turn(page, 0).locator(".blocks summary").all_text_contents()
    assert stats and all(re.fullmatch(r"block \d+: \d+ steps · [\d.]+ s · [\d.]+ tokens/step", s) for s in stats)

    ask(page, "Sort: 7 2 9 2")  # the second turn carries the first as context
    wait_state(page, 1, "done")
    second = turn(page, 1).locator(".answer").text_content()
    assert second == api_answer(server, [{"role": "user", "content": "Count from 7 to 31."},
                                         {"role": "assistant", "content": first},
                                         {"role": "user", "content": "Sort: 7 2 9 2"}])


def sent_messages(page, prompt: str) -> list[dict]:
    """Asks `prompt` and returns the messages the page sent with it."""
    with page.expect_request("**/v1/chat/completions") as request:
        ask(page, prompt)
    return request.value.post_data_json["messages"]


@pytest.mark.slow
@pytest.mark.parametrize("status", [400, 401])
def test_a_failed_request_gives_the_prompt_back(server, page, status):
    n = page.locator("#log li.assistant").count()
    if status == 400:
        page.fill("#seed", "1e30")  # a whole number, but past 2**63-1
    else:
        page.evaluate("sessionStorage.setItem('dgemma-api-key', 'wrong')")
    ask(page, "Sort: 3 1 2")
    wait_state(page, n, "error")
    assert page.input_value("#prompt") == "Sort: 3 1 2"
    assert turn(page, n).get_by_role("alert").text_content()
    if status == 400:  # the form's label, not the API's field name
        assert "Seed" in turn(page, n).get_by_role("alert").text_content()
        page.fill("#seed", SETTINGS["seed"])
    else:
        page.wait_for_selector("#key-form:not([hidden])")
        page.get_by_label("This server needs an API key").fill(KEY)
        page.get_by_role("button", name="Use key").click()
        page.wait_for_selector("#key-form[hidden]", state="attached")
    page.press("#prompt", "Enter")  # resent as it came back
    wait_state(page, n + 1, "done")
    assert page.input_value("#prompt") == ""


@pytest.mark.slow
def test_an_attached_image_is_sent_as_an_image_url_part(server, page, tmp_path):
    """The file picker's image goes to the server as an OpenAI image_url data URL: the bundled model (no vision
    tower) answers with its one-line 400, shown in the turn; the prompt and the image stay for a resend."""
    import base64

    png = tmp_path / "dot.png"  # a 1x1 PNG
    png.write_bytes(base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2O"
                                     "UAAAAABJRU5ErkJggg=="))
    n = page.locator("#log li.assistant").count()
    page.set_input_files("#image", str(png))
    ask(page, "What is in the picture?")
    wait_state(page, n, "error")
    assert "no vision tower" in turn(page, n).get_by_role("alert").text_content()
    assert page.input_value("#prompt") == "What is in the picture?"
    assert page.eval_on_selector("#image", "e => e.files.length") == 1
    page.set_input_files("#image", [])
    page.fill("#prompt", "")


@pytest.mark.slow
def test_new_chat_empties_the_history_and_the_transcript(server, page):
    from playwright.sync_api import expect

    assert page.locator("#log li.assistant").count() >= 2  # the turns of the tests above
    assert len(sent_messages(page, "Sort: 7 2 9 2")) > 1  # ... carried as context
    wait_state(page, page.locator("#log li.assistant").count() - 1, "done")
    # A real button, reached with Tab and pressed with Enter.
    page.evaluate("document.activeElement.blur()")
    for _ in range(30):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "new-chat":
            break
    else:
        pytest.fail("Tab never reaches the New chat button")
    page.keyboard.press("Enter")
    expect(page.locator("#log > li")).to_have_count(0)
    assert page.evaluate("document.activeElement.id") == "prompt"
    assert sent_messages(page, "Sort: 7 2 9 2") == [{"role": "user", "content": "Sort: 7 2 9 2"}]
    wait_state(page, 0, "done")
    assert turn(page, 0).locator(".answer").text_content() == api_answer(
        server, [{"role": "user", "content": "Sort: 7 2 9 2"}])

    # At phone width, mid-request: it stops the request (freeing its slot) and clears the page.
    page.set_viewport_size({"width": 360, "height": 780})
    try:
        fill(page, {"steps": "4096", "entropy_bound": "0", "blocks": "4"})
        ask(page, "Continue: And God said")
        turn(page, 1).locator(".canvas .tok").first.wait_for()
        button = page.get_by_role("button", name="New chat")
        box = button.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 360, box
        assert page.evaluate("document.documentElement.scrollWidth") <= 360
        button.click()
        expect(page.locator("#log > li")).to_have_count(0)
        deadline = time.monotonic() + 10
        while metric(server, "slots_busy") != 0:
            assert time.monotonic() < deadline, "the request New chat stopped still holds its slot"
            time.sleep(0.1)
        assert page.is_enabled("#send") and not page.is_enabled("#stop")
        assert page.input_value("#prompt") == "" and page.text_content("#status") == ""
    finally:
        page.set_viewport_size({"width": 1440, "height": 900})
        fill(page, {**SETTINGS, "entropy_bound": ""})
    assert sent_messages(page, "Sort: 7 2 9 2") == [{"role": "user", "content": "Sort: 7 2 9 2"}]
    wait_state(page, 0, "done")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["button", "Escape"])
def test_stop_cancels_a_long_request_and_frees_its_slot(server, page, how):
    cancelled = metric(server, "requests_cancelled_total")
    n = page.locator("#log li.assistant").count()
    # With entropy bound 0 a step accepts one position or so: each block runs for thousands of steps.
    fill(page, {"steps": "4096", "entropy_bound": "0", "blocks": "4"})
    ask(page, "Continue: And God said")
    turn(page, n).locator(".canvas .tok").first.wait_for()
    assert metric(server, "slots_busy") == 1
    if how == "button" and os.environ.get("DGEMMA_WEB_SHOTS"):
        screenshots(page, n)
    if how == "button":
        page.get_by_role("button", name="Stop").click()
    else:
        page.keyboard.press("Escape")
    wait_state(page, n, "stopped")
    deadline = time.monotonic() + 10
    while metric(server, "slots_busy") != 0 or metric(server, "requests_cancelled_total") != cancelled + 1:
        assert time.monotonic() < deadline, "the stopped request still holds its slot"
        time.sleep(0.1)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


# Records each canvas the page draws for the running turn with the time it was drawn (seconds), and when the
# turn ended; `window.on_screen(frames, ended)` is then the time each frame stayed on screen.
TIMED = """() => {
  window.drawn = []; window.ended = null;
  new MutationObserver(() => {
    const turn = document.querySelector('#log li.assistant:last-child');
    if (!turn) return;
    const canvas = turn.querySelector('.canvas');
    if (turn.dataset.state !== 'running') { if (window.ended === null) window.ended = performance.now() / 1000; return; }
    if (canvas && canvas.dataset.frame && canvas.dataset.frame !== (window.drawn.at(-1) || [])[0])
      window.drawn.push([canvas.dataset.frame, performance.now() / 1000]);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def recorded_stream(server, prompt: str) -> tuple[str, list[dict], dict]:
    """The SSE body the page gets for `prompt` at SETTINGS (drafts and usage), its drafts and its usage."""
    import json

    body = {"messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_drafts": True, "include_usage": True}, **BODY}
    reply = httpx.post(server.v1 + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                       timeout=60)
    chunks = [json.loads(line[5:]) for line in reply.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    return (reply.text, [c["dgemma_draft"] for c in chunks if "dgemma_draft" in c],
            next(c["usage"] for c in chunks if c.get("usage")))


def fresh(page) -> None:
    """An empty chat at the tests' settings, at desktop width."""
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 1440, "height": 900})
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("#log > li")).to_have_count(0)
    fill(page, {**SETTINGS, "entropy_bound": ""})


@pytest.mark.slow
def test_each_step_stays_on_screen_at_the_default_pace_and_the_pace_turns_off(server, page):
    # The whole stream at once (as a fast server on a slow link sends it): only the page's pace spaces the frames.
    stream, drafts, _ = recorded_stream(server, "Count from 7 to 31.")
    assert len(drafts) >= 4
    fresh(page)
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=stream))
    try:
        assert page.is_checked("#pace")  # on by default
        page.evaluate(TIMED)
        ask(page, "Count from 7 to 31.")
        wait_state(page, 0, "done")
        drawn, ended = page.evaluate("[window.drawn, window.ended]")
        assert [f for f, _ in drawn] == [f"{d['block']}:{d['step']}" for d in drafts]  # every step, in order
        shown = [b - a for (_, a), (_, b) in zip(drawn, drawn[1:] + [(None, ended)])]
        assert min(shown) >= 0.14, shown  # `dgemma watch`'s 0.15 s a step (a timer may fire a ms early)
        assert turn(page, 0).locator(".answer").text_content() == api_answer(
            server, [{"role": "user", "content": "Count from 7 to 31."}])

        page.uncheck("#pace")
        page.evaluate(TIMED)
        ask(page, "Count from 7 to 31.")
        wait_state(page, 1, "done")
        drawn, ended = page.evaluate("[window.drawn, window.ended]")
        assert len(drawn) < len(drafts)  # nothing held back: the stream came at once, so the answer did too
        assert turn(page, 1).locator(".answer").text_content() == turn(page, 0).locator(".answer").text_content()
    finally:
        page.unroute("**/v1/chat/completions")
        page.check("#pace")


@pytest.mark.slow
def test_each_blocks_last_canvas_stays_folded_with_a_replay_and_tokens_per_step(server, page):
    from playwright.sync_api import expect

    _, drafts, usage = recorded_stream(server, "Count from 7 to 31.")
    finals = [d for d in drafts if d["final"]]
    fresh(page)
    ask(page, "Count from 7 to 31.")
    wait_state(page, 0, "done")
    kept = turn(page, 0).locator(".blocks > li")
    expect(kept).to_have_count(len(finals))
    assert len(finals) >= 2 and finals[-1]["step"] >= 2
    for i, d in enumerate(finals):
        canvas = kept.nth(i).locator(".canvas")
        expect(canvas).to_be_hidden()  # folded
        assert canvas.get_attribute("data-frame") == f"{d['block']}:{d['step']}"  # the block's last step
        assert canvas.locator(".tok").count() == len(d["token_ids"])
    # Tokens per step count what the block adds to the answer (to its stop token), not the padding after it.
    per_step = [float(re.search(r"([\d.]+) tokens/step", t).group(1))
                for t in turn(page, 0).locator(".blocks summary").all_text_contents()]
    counted = sum(round(x * d["step"]) for x, d in zip(per_step, finals))
    assert counted == usage["completion_tokens"] + 1, (per_step, usage)  # + the stop token, as tokens_per_forward

    last = kept.nth(len(finals) - 1)
    last.locator("summary").click()
    canvas = last.locator(".canvas")
    expect(canvas).to_be_visible()
    canvas.evaluate("""c => { window.replayed = [];
      new MutationObserver(() => window.replayed.push(c.dataset.frame)).observe(c, {attributes: true}); }""")
    last.get_by_role("button", name=re.compile("Replay")).click()
    block = finals[-1]["block"]
    wanted = [f"{block}:{s}" for s in range(1, finals[-1]["step"] + 1)]
    page.wait_for_function("n => window.replayed.length >= n", arg=len(wanted))
    assert page.evaluate("window.replayed") == wanted


@pytest.mark.slow
def test_the_empty_page_offers_example_prompts(server, page):
    from playwright.sync_api import expect

    fresh(page)
    examples = page.get_by_role("group", name=re.compile("Try one")).get_by_role("button")
    expect(examples).to_have_count(4)
    shapes = examples.all_text_contents()
    assert [s.split()[0] for s in shapes] == ["Reverse:", "Sort:", "Count", "Continue:"]  # the bundled model's
    examples.nth(1).click()
    wait_state(page, 0, "done")
    assert page.locator("#log li.user").text_content() == shapes[1]
    assert turn(page, 0).locator(".answer").text_content() == api_answer(server, [{"role": "user", "content": shapes[1]}])
    expect(examples.first).to_be_hidden()  # only on the empty page
    page.get_by_role("button", name="New chat").click()
    expect(examples.first).to_be_visible()


@pytest.mark.slow
def test_errors_name_the_forms_labels(server, page):
    fresh(page)
    page.fill("#steps", "0")
    try:
        ask(page, "Sort: 3 1 2")
        wait_state(page, 0, "error")
        alert = turn(page, 0).get_by_role("alert").text_content()
        assert "Steps per block" in alert and "max_denoising_steps" not in alert, alert
        assert page.get_attribute("#steps", "aria-invalid") == "true"
    finally:
        page.fill("#steps", SETTINGS["steps"])
    assert page.get_attribute("#steps", "aria-invalid") is None  # editing the field clears its mark


@pytest.mark.slow
def test_output_never_scrolls_away_from_a_reader_who_scrolled_up(server, page):
    """At phone width, mid-request: a reader who scrolls up stays there while steps are drawn (before, every step
    pulled the page back to its end, so a press on New chat could land on something else)."""
    from playwright.sync_api import expect

    fresh(page)
    page.set_viewport_size({"width": 360, "height": 780})
    page.evaluate("document.getElementById('settings').open = true")  # a page taller than the screen
    try:
        fill(page, {"steps": "4096", "entropy_bound": "0", "blocks": "4"})
        ask(page, "Continue: And God said")
        canvas = turn(page, 0).locator(".canvas")
        canvas.locator(".tok").first.wait_for()
        assert page.evaluate("scrollY") > 0  # the page followed the new turn to its end
        page.mouse.wheel(0, -10_000)
        page.wait_for_function("() => scrollY === 0")
        for _ in range(3):  # three more steps drawn
            seen = canvas.get_attribute("data-frame")
            page.wait_for_function("f => document.querySelector('#log .canvas').dataset.frame !== f", arg=seen)
            assert page.evaluate("scrollY") == 0
        # A slow press (down, a pause, up) on New chat is still a press on New chat.
        box = page.get_by_role("button", name="New chat").bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.wait_for_timeout(300)
        page.mouse.up()
        expect(page.locator("#log > li")).to_have_count(0)
    finally:
        page.set_viewport_size({"width": 1440, "height": 900})
        fill(page, {**SETTINGS, "entropy_bound": ""})


def screenshots(page, n: int) -> None:
    """benchmarks/web-1440.png and web-360.png, mid-block: the canvas part noise, part text."""
    page.uncheck("#pace")  # step 150 as soon as the model gets there
    page.wait_for_function("() => +document.querySelector('#log > li:last-child .canvas').dataset.frame.split(':')[1] >= 150")
    page.check("#pace")
    for width in (360, 1440):  # 1440 last: the settings end open, as the other tests need
        page.set_viewport_size({"width": width, "height": 900 if width > 360 else 780})
        # As the page loads on a phone: the settings folded away (they open from 800 px).
        page.evaluate(f"document.getElementById('settings').open = {'true' if width > 360 else 'false'}")
        turn(page, n).scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"web-{width}.png"))
    page.set_viewport_size({"width": 1440, "height": 900})


START = "dgemma serve: tiny on http://0.0.0.0:8123/v1 (cpu, float32; 2 slot(s) of 512 positions)"


def test_open_without_a_display_prints_the_address(monkeypatch):
    monkeypatch.setattr(serve_cli.sys, "platform", "linux")
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    said = []
    serve_cli._opening(said.append)(START)
    assert said == [START, "dgemma serve: --open: no display here (DISPLAY and WAYLAND_DISPLAY are unset); "
                           "open http://127.0.0.1:8123/ in a browser"]


def test_open_with_a_display_opens_the_page_once(monkeypatch):
    import threading
    import webbrowser

    monkeypatch.setattr(serve_cli.sys, "platform", "linux")
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    opened = threading.Event()
    urls = []
    monkeypatch.setattr(webbrowser, "open", lambda url: (urls.append(url), opened.set()))
    said = []
    say = serve_cli._opening(said.append)
    say(START)
    say("dgemma serve: stopped")
    assert opened.wait(5) and urls == ["http://127.0.0.1:8123/"]
    assert said == [START, "dgemma serve: opening http://127.0.0.1:8123/ in your browser", "dgemma serve: stopped"]


def test_the_page_ships_in_the_package_and_loads_nothing_from_elsewhere():
    import tomllib
    from importlib.resources import files
    from pathlib import PurePosixPath

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dgcli"]
    web = files("dgcli") / "data" / "web"
    names = sorted(p.name for p in web.iterdir())
    assert names == ["app.css", "app.js", "index.html"]
    for name in names:
        assert any(PurePosixPath("data/web", name).match(g) for g in globs), f"{name} is not in the package data"
        assert "://" not in (web / name).read_text(encoding="utf-8"), f"{name} names another site (no CDN)"
