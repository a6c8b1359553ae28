"""The web page at `/` end to end, in a real headless Chromium (Debian's `chromium`, driven by Playwright; no
browser download): `dgemma serve --api-key` on the bundled model, a wrong key shows the server's error, the
canvas is drawn live from draft events (at least two distinct frames before the answer), the final text is the
API's answer for the same messages, settings and seed (two turns), a failed request (400, 401) gives its
prompt back, New chat (keyboard, 360 px, mid-request) empties the history and the transcript, and Stop cancels
a long request and frees its slot (Stop button and Escape). With DGEMMA_WEB_SHOTS=1 it also writes benchmarks/web-360.png and
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
    stats = turn(page, 0).locator(".blocks li").all_text_contents()
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
    if status == 400:
        assert "seed" in turn(page, n).get_by_role("alert").text_content()
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


def screenshots(page, n: int) -> None:
    """benchmarks/web-1440.png and web-360.png, mid-block: the canvas part noise, part text."""
    page.wait_for_function("() => +document.querySelector('.canvas').dataset.frame.split(':')[1] >= 150")
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
