"""One request must never wedge `dgemma serve`: a huge prompt is refused without holding the event loop,
a slow one runs in a thread under a time limit, a body over the limit is refused unread, a stalled engine
shows on /health and /metrics, SIGTERM ends the process within the shutdown timeout whatever the engine
is doing, and --port is checked before the model loads.

Most tests share one in-process server (the real app, worker and uvicorn, as test_server_scripted.py
runs them) whose tokenizer can be told to be slow and whose engine can be held mid-pass; the signal test
needs a process of its own."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dgcli.runtime.session import open_session
from dgcli.engine import Output
from dgcli.serve.protocol import Spec
from dgcli.serve.worker import Job
from server_proc import Server, free_port, in_process

CAT = {"messages": [{"role": "user", "content": "Reverse: c a t"}]}


class SlowTokenizer:
    """The real tokenizer, except that a chat whose last message starts with "SLOW <s>" takes s seconds more
    to encode (sleeping, as the real tokenizer now runs: without the GIL)."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def chat_text(self, messages, **kw):
        m = re.match(r"SLOW ([\d.]+)", messages[-1]["content"])
        if m:
            time.sleep(float(m.group(1)))
        return self.real.chat_text(messages, **kw)


@pytest.fixture(scope="module")
def live():
    def slow(state):
        state.ctx.tokenizer = SlowTokenizer(state.ctx.tokenizer)

    with in_process(open_session(None, None, {}), slots=2, prepare=slow) as (url, state):
        yield url, state


def _post_in_thread(url, body, out):
    def run():
        t0 = time.monotonic()
        r = httpx.post(url, json=body, timeout=60)
        out.append((r, time.monotonic() - t0))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _worst_health(base, busy: threading.Thread) -> float:
    """The slowest /health answer while `busy` runs (at least one probe)."""
    worst = 0.0
    while True:
        t0 = time.monotonic()
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        if not busy.is_alive():
            return worst
        time.sleep(0.02)


def test_health_answers_while_a_slow_prompt_is_tokenized(live):
    base, _ = live
    out = []
    busy = _post_in_thread(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW 2 c a t"}]}, out)
    time.sleep(0.2)  # the request is being tokenized
    assert _worst_health(base, busy) < 0.5
    (r, _), = out
    assert r.status_code == 200


def test_a_4_mb_prompt_is_refused_at_once_and_the_loop_keeps_serving(live):
    base, _ = live
    out = []
    huge = {"messages": [{"role": "user", "content": "hello world " * 350_000}]}  # 4.2 MB
    busy = _post_in_thread(base + "/v1/chat/completions", huge, out)
    assert _worst_health(base, busy) < 0.5
    (r, seconds), = out
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert seconds < 3, seconds


def test_the_character_limit_counts_what_the_template_renders(live):
    """An earlier thought of the model's is dropped by the chat template: a long one must not count against the
    prompt (the limit measured the raw messages, and refused this conversation that fits)."""
    base, state = live
    thought = "<|channel>thought\n" + "x" * (8 * state.ctx.max_chars) + "<channel|>ok"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": thought},
                         {"role": "user", "content": "Reverse: c a t"}], "max_tokens": 16}
    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text[:300]
    chat["messages"][-1]["content"] = "y" * (state.ctx.max_chars + 1)  # what is rendered still counts
    r = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


def test_preparing_a_prompt_past_the_time_limit_is_503(live):
    base, state = live
    state.parse_timeout = 0.3
    try:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "SLOW 1.5 hi"}]},
                       timeout=30)
    finally:
        state.parse_timeout = 10.0
    assert r.status_code == 503 and "preparing the prompt took more than 0.3 s" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"


def _raw(port: int, head: bytes, body_parts=(), wait: float = 10.0) -> bytes:
    """Send `head` then `body_parts` on a raw socket (not ending the body); what the server answers in `wait` s."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        answer = b""
        try:
            while not re.search(rb"\r\n\r\n", answer) or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
                    re.search(rb"content-length: (\d+)", answer, re.I).group(1)):
                part = s.recv(65536)
                if not part:
                    break
                answer += part
        except socket.timeout:
            pass
        return answer


def test_a_body_over_the_limit_is_refused_unread(live):
    base, _ = live
    port = int(base.rsplit(":", 1)[1])
    # Declared 50 MB, sent a few bytes: the 413 comes from the header, no waiting for the rest.
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n")
    t0 = time.monotonic()
    answer = _raw(port, head, [b'{"messages": ['])
    assert answer.startswith(b"HTTP/1.1 413") and b"52428800 bytes; the limit is 8388608" in answer, answer[:300]
    assert time.monotonic() - t0 < 5
    # Chunked, never ended: refused once 8 MiB have come, not at the end of the body.
    chunk = b"%x\r\n%s\r\n" % (2**20, b" " * 2**20)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer = _raw(port, head, [chunk] * 9)
    assert answer.startswith(b"HTTP/1.1 413") and b"more than 8388608 bytes" in answer, answer[:300]
    # Nothing was left behind: no request in the engine, and the next one is answered at once.
    text = httpx.get(base + "/metrics").text
    assert "dgemma_queue_depth 0" in text and "dgemma_slots_busy 0" in text
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/chat/completions", json=CAT, timeout=30)
    assert r.json()["choices"][0]["message"]["content"] == "t a c" and time.monotonic() - t0 < 5


def _count(base: str, status: int) -> float:
    found = re.search(rf'^dgemma_requests_total\{{status="{status}"\}} (\S+)$', httpx.get(base + "/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_client_gone_while_sending_its_body_is_a_quiet_499(live):
    """Before, starlette's ClientDisconnect reached the 500 handler: a traceback per slowloris client."""
    base, _ = live
    port = int(base.rsplit(":", 1)[1])
    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append
    loggers = [logging.getLogger(name) for name in ("dgemma.serve", "uvicorn.error")]
    before = {status: _count(base, status) for status in (499, 500)}
    for logger in loggers:
        logger.addHandler(catch)
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"messages"')
                time.sleep(0.3)
        deadline = time.monotonic() + 10
        while _count(base, 499) < before[499] + 3:
            assert time.monotonic() < deadline, httpx.get(base + "/metrics").text
            time.sleep(0.05)
    finally:
        for logger in loggers:
            logger.removeHandler(catch)
    assert _count(base, 500) == before[500]
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    r = httpx.post(base + "/v1/chat/completions", json=CAT, timeout=30)
    assert r.json()["choices"][0]["message"]["content"] == "t a c"


def _progress(text: str) -> float:
    return float(re.search(r"^dgemma_engine_last_progress_seconds (\S+)$", text, re.M).group(1))


def test_a_stalled_engine_makes_health_503_and_the_metric_grow(live):
    base, state = live
    worker, release = state.worker, threading.Event()
    real_pass = worker._pass

    def held_pass():  # the engine thread stuck in a pass until the test lets it go
        release.wait(30)
        real_pass()

    assert _progress(httpx.get(base + "/metrics").text) == 0  # idle: waiting for work is no stall
    worker._pass, state.stall_timeout = held_pass, 0.5
    out = []
    try:
        busy = _post_in_thread(base + "/v1/chat/completions", CAT, out)
        deadline = time.monotonic() + 10
        while (r := httpx.get(base + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "the engine never showed as stalled"
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "engine stalled", r.text
        assert r.json()["last_progress_seconds"] >= 0.5 and r.json()["stall_timeout_seconds"] == 0.5
        first = _progress(httpx.get(base + "/metrics").text)
        time.sleep(0.3)
        assert _progress(httpx.get(base + "/metrics").text) >= first + 0.25 > 0.75
    finally:
        release.set()
        busy.join(30)
        del worker._pass
        state.stall_timeout = 60.0
    (r, _), = out
    assert r.json()["choices"][0]["message"]["content"] == "t a c"  # the pass went on: nothing was lost
    assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_the_tokenizer_leaves_the_gil_to_other_threads():
    from dgcli.text.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(os.path.dirname(__import__("dgcli").__file__), "data", "tiny"))
    text = "hello world " * 100_000
    done, ticks = threading.Event(), []
    spent = []

    def encode():
        t0 = time.monotonic()
        tok.encode_text(text)
        spent.append(time.monotonic() - t0)
        done.set()

    worker = threading.Thread(target=encode)
    ticks.append(time.monotonic())
    worker.start()
    while not done.is_set():
        time.sleep(0.002)
        ticks.append(time.monotonic())
    worker.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])] or [0.0]
    assert max(gaps) < max(0.1, spent[0] / 2), (max(gaps), spent)  # held, one gap would be the whole encode


# ---- a process of its own: signals and --port -------------------------------------------------------------

STUCK = """
import sys, time
from dgcli.serve import worker
worker.Worker._pass = lambda self: time.sleep(3600)  # the engine thread never comes back from its pass
from dgcli.cli import main
sys.argv = ["dgemma", "serve", *sys.argv[1:]]
main()
"""


def _start(args, tmp_path, code=None):
    log = str(tmp_path / "serve.log")
    cmd = [sys.executable, "-m", "dgcli.cli", "serve", *args] if code is None else [sys.executable, "-c", code, *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Server(proc, 0, log)


def _ready(server: Server, timeout: float = 120) -> int:
    """Wait for the startup line; the port it names."""
    deadline = time.monotonic() + timeout
    while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)/v1", server.log())):
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    return int(m.group(1))


def test_sigterm_during_an_endless_engine_pass_exits_within_the_shutdown_timeout(tmp_path):
    port = free_port()
    s = _start(["--port", str(port), "--shutdown-timeout", "2", "--stall-timeout", "1"], tmp_path, code=STUCK)
    try:
        _ready(s)
        out = []
        busy = _post_in_thread(f"http://127.0.0.1:{port}/v1/chat/completions", CAT, out)
        deadline = time.monotonic() + 30
        while (r := httpx.get(f"http://127.0.0.1:{port}/health")).status_code == 200:  # in its pass, then stalled
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.json()["status"] == "engine stalled"
        t0 = time.monotonic()
        code = s.stop(signal.SIGTERM, timeout=30)
        elapsed = time.monotonic() - t0
        busy.join(10)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    log = s.log()
    assert code == 1 and elapsed < 2 + 2, (code, elapsed, log)  # the timeout, the engine's grace, slack
    (r, _), = out
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert "Traceback" not in log and "left behind (exit code 1)" in log, log


def test_port_0_binds_a_free_port_and_says_which(tmp_path):
    s = _start(["--port", "0"], tmp_path)
    try:
        port = _ready(s)
        assert port != 0 and httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
        assert s.stop() == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


@pytest.mark.parametrize("port", ["99999", "-1", "70000"])
def test_a_port_out_of_range_is_one_line_before_the_model_loads(port, capsys, monkeypatch):
    import dgcli.runtime.session as session_module
    from cli_run import forbid, run

    forbid(monkeypatch, [(session_module, "open_session")], "the model loaded before --port was checked")
    code, _, err = run(["serve", "--port", port], capsys)
    assert code == 2 and err.strip() == f"dgemma: error: --port {port}: a TCP port is 0..65535 (0: any free port)"


def test_no_token_covers_more_than_max_token_chars():
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    from dgcli.text.tokenizer import ChatTokenizer, load_tokenizer

    tok = load_tokenizer(os.path.join(os.path.dirname(__import__("dgcli").__file__), "data", "tiny"))
    per_token = tok.max_token_chars
    assert per_token == max(map(len, tok.tokenizer.get_vocab())) == 16
    longest = max(tok.tokenizer.get_vocab(), key=len)
    for text in (" " * 5000, "\n" * 5000, "a" * 5000, longest * 300, "<bos>" * 500, "日本語🙂" * 500,
                 "Reverse: c a t " * 300, "\x00\x01" * 500, " \n" * 2000):
        assert len(tok.encode_text(text)) * per_token >= len(text), text[:20]
    # Where text can shrink before it is matched, there is no bound to give.
    for attr, part in (("pre_tokenizer", pre_tokenizers.WhitespaceSplit()), ("normalizer", normalizers.NFKC()),
                       ("normalizer", normalizers.Strip())):
        other = Tokenizer.from_str(tok.tokenizer.to_str())
        setattr(other, attr, part)
        assert ChatTokenizer(other, None).max_token_chars is None, attr


def test_a_request_the_engine_thread_cannot_build_fails_alone(live):
    """Whatever fails while the engine thread takes a request in fails that request (a 500), not the thread:
    before, an error outside the engine's own `submit` ended the thread and every later request hung."""
    base, state = live
    loop = asyncio.new_event_loop()
    try:
        spec = Spec(True, ["not a token id"], state.ctx.params, 1, None)
        job = Job(spec, Output(state.ctx.tokenizer, stop_strings=[], max_tokens=None), loop, asyncio.Queue())
        state.worker.submit(job)
        kind, error = loop.run_until_complete(asyncio.wait_for(job.queue.get(), 10))
    finally:
        loop.close()
    assert kind == "error" and error.status == 500
    assert state.worker.thread.is_alive()
    r = httpx.post(base + "/v1/chat/completions", json=CAT, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == "t a c"


def test_an_empty_answer_is_explained_in_the_server_log(live, caplog):
    """/v1/completions sends the prompt raw; the bundled (chat-trained) model answers it with padding: the
    client gets "", and the log says why and what to use instead."""
    base, _ = live
    with caplog.at_level(logging.WARNING, logger="dgemma.serve"):
        r = httpx.post(base + "/v1/completions", json={"prompt": "Reverse: c a t"}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
        r = httpx.post(base + "/v1/chat/completions", json=CAT, timeout=60)
        assert r.json()["choices"][0]["message"]["content"] == "t a c"
    said = [rec.getMessage() for rec in caplog.records if "the answer is empty" in rec.getMessage()]
    assert len(said) == 1 and "use /v1/chat/completions" in said[0], said
