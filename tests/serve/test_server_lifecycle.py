"""`dgemma serve` under pressure and at its end: a full queue answers 429 at once, SIGTERM / SIGINT with
requests in flight finish (or cancel) them within the timeout and exit 0 without a traceback."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from server_proc import serve

# Fixed work (every block runs all its steps) over many blocks, past the bundled budget of 64 tokens: a
# request that stays in flight for seconds.
LONG = {"messages": [{"role": "user", "content": "Count from 7 to 31."}], "max_denoising_steps": 48,
        "confidence_threshold": 0, "max_blocks": 6, "ignore_eos": True, "max_tokens": 4000, "stream": True}


def _stream(url, body, out, started):
    """Stream `body`, recording each data line; `started` is set at the first content chunk."""
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    if '"content":"' in line and '"content":""' not in line:
                        started.set()
    except httpx.HTTPError as e:
        out.append(e)


def _start(url, body, n):
    runs = []
    for _ in range(n):
        out, started = [], threading.Event()
        t = threading.Thread(target=_stream, args=(url, body, out, started), daemon=True)
        t.start()
        runs.append((t, out, started))
    return runs


def test_full_queue_answers_429_and_the_server_keeps_serving(tmp_path):
    with serve("--max-batch-size", "1", "--max-queue", "1", tmp_path=tmp_path) as s:
        url = s.v1 + "/chat/completions"
        runs = _start(url, LONG, 1)
        assert runs[0][2].wait(60)  # running in the only slot
        runs += _start(url, LONG, 1)  # waits in the queue
        deadline = time.monotonic() + 30
        while "dgemma_queue_depth 1" not in httpx.get(s.base_url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "Reverse: c a t"}]}, timeout=30)
        assert r.status_code == 429 and time.monotonic() - t0 < 5  # at once, not after the others
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full" and "queue is full" in r.json()["error"]["message"]
        for t, out, _ in runs:
            t.join(120)
            assert out[0] == 200 and out[-1] == "[DONE]" and '"finish_reason":"length"' in "".join(out[1:-1])
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "Reverse: c a t"}]}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "t a c"


# SIGINT (Ctrl-C) takes the same shutdown path as SIGTERM: ~6 s more, so only in the full run.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_with_requests_in_flight_finishes_them_and_exits_0(tmp_path, sig):
    with serve("--max-batch-size", "2", tmp_path=tmp_path) as s:
        runs = _start(s.v1 + "/chat/completions", LONG, 3)  # two run, one waits
        assert all(started.wait(60) for _, _, started in runs[:1])
        t0 = time.monotonic()
        code = s.stop(sig, timeout=60)
        assert code == 0, s.log()
        for t, out, _ in runs:
            t.join(30)
            assert out[-1] == "[DONE]" and '"finish_reason":"length"' in "".join(map(str, out[1:-1])), out[-3:]
        log = s.log()
    assert "Traceback" not in log and "dgemma serve: stopped" in log, log
    assert time.monotonic() - t0 < 40
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base_url + "/health", timeout=2)


def test_sigterm_past_the_timeout_cancels_what_is_left_and_exits_0(tmp_path):
    endless = {**LONG, "max_blocks": 200}  # far longer than the 1 s the server gives it
    with serve("--max-batch-size", "2", "--shutdown-timeout", "1", tmp_path=tmp_path) as s:
        runs = _start(s.v1 + "/chat/completions", endless, 2)
        assert all(started.wait(60) for _, _, started in runs)
        t0 = time.monotonic()
        assert s.stop(signal.SIGTERM, timeout=30) == 0, s.log()
        elapsed = time.monotonic() - t0
        for t, out, _ in runs:
            t.join(10)
            assert not t.is_alive()
            assert out[-1] == "[DONE]" and "shutting down" in out[-2]  # cut off, and told why
            assert "finish_reason\":\"length" not in "".join(out[1:-1])
        log = s.log()
    assert elapsed < 15, elapsed
    assert "Traceback" not in log and "dgemma serve: stopped" in log, log


def test_a_second_sigint_with_requests_in_flight_answers_them_503_without_a_traceback(tmp_path):
    """Ctrl-C twice: uvicorn stops at once and cancels what runs; before, a traceback per request and a
    text/plain 500 for a non-streamed one."""
    endless = {**LONG, "max_blocks": 200}
    with serve("--max-batch-size", "2", tmp_path=tmp_path) as s:
        whole = []
        waiting = threading.Thread(target=lambda: whole.append(httpx.post(
            s.v1 + "/chat/completions", json={**endless, "stream": False}, timeout=60)), daemon=True)
        waiting.start()
        (t, out, started), = _start(s.v1 + "/chat/completions", endless, 1)
        assert started.wait(60)
        deadline = time.monotonic() + 30
        while "dgemma_slots_busy 2" not in httpx.get(s.base_url + "/metrics").text:  # both in the engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.7)
        assert s.stop(signal.SIGINT, timeout=30) == 0, s.log()
        waiting.join(10)
        t.join(10)
        log = s.log()
    (r,) = whole
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    assert out[-1] == "[DONE]" and "shutting down" in out[-2], out[-3:]
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert log.strip().splitlines()[-1] == "dgemma serve: stopped", log


def test_a_client_gone_from_a_non_streamed_request_frees_its_slot(tmp_path):
    endless = {**LONG, "max_blocks": 200, "stream": False}
    with serve("--max-batch-size", "1", tmp_path=tmp_path) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.v1 + "/chat/completions", json=endless, timeout=1.5)  # gives up, closes the connection
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(s.base_url + "/metrics").text
            if "dgemma_slots_busy 0" in text and "dgemma_requests_cancelled_total 1" in text:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        assert 'dgemma_requests_total{status="499"} 1' in text
        r = httpx.post(s.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "Reverse: c a t"}]})
        assert r.json()["choices"][0]["message"]["content"] == "t a c"


def test_bad_serve_flags_are_one_line_errors(capsys):
    import socket

    from cli_run import run

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run(["serve", "--port", str(port)], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == \
        f"dgemma: error: cannot listen on 127.0.0.1:{port}: Address already in use; pick another --port or --host"
    for argv, words in ((["--max-model-len", "99999"], "beyond the model's context of 4096"),
                        (["--max-batch-size", "0"], "--max-batch-size 0: must be >= 1"),
                        (["--max-queue", "-1"], "--max-queue -1: must be >= 0")):
        code, _, err = run(["serve", "--port", "1", *argv], capsys)
        assert code == 2 and words in err and "Traceback" not in err, err
    for argv, words in ((["--max-queue", "-1"], "--max-queue -1: must be >= 0"),  # before the model is looked for
                        (["--stall-timeout", "nan"], "--stall-timeout nan: must be >= 0 seconds")):
        code, _, err = run(["serve", "--model", "no-such-dir", *argv], capsys)
        assert code == 2 and err.count("\n") == 1 and words in err, err


NOTE = "dgemma serve: note: listening on 0.0.0.0 without --api-key: anyone who can reach the port can use it"


@pytest.mark.parametrize("host,env,noted", [("0.0.0.0", {}, True), ("0.0.0.0", {"DGEMMA_API_KEY": "k"}, False),
                                            ("127.0.0.1", {}, False)], ids=["open", "with a key", "loopback"])
def test_a_non_loopback_host_without_a_key_is_served_with_a_note(capsys, monkeypatch, host, env, noted):
    from cli_run import run
    from dgcli.serve import run as serve_run

    monkeypatch.delenv("DGEMMA_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # Bound, never listening: the startup lines are written, then the server "stops" at once.
    monkeypatch.setattr(serve_run._Server, "run", lambda self, sockets=None: None)
    code, _, err = run(["serve", "--host", host, "--port", "0"], capsys)
    lines = err.strip().splitlines()
    assert code == 0 and lines[-1] == "dgemma serve: stopped", err
    assert (NOTE in lines) == noted and (not noted or lines[lines.index(NOTE) - 1].startswith("dgemma serve: tiny on"))


def test_which_hosts_are_loopback():
    from dgcli.serve.run import loopback

    assert all(map(loopback, ["127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST.", "app.localhost"]))
    assert not any(map(loopback, ["0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.com", "fe80::1"]))
