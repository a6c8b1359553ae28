"""One request must never wedge `dgemma serve` (issue 33 item 1): a field that would size unbounded work (a
step count, a stability history, a token budget, a conversation, a stop string, a token-id prompt) is
refused with a 400 error object at once, and the server answers the next request as before."""

from __future__ import annotations

import time

import httpx
import pytest

from dgcli.sampling.params import LIMITS
from server_proc import serve

USER = [{"role": "user", "content": "Reverse: c a t"}]
CASES = {  # name -> (path, body, param the error names, text the message holds)
    "steps": ("chat", {"messages": USER, "max_denoising_steps": 10**9}, "max_denoising_steps", "at most 4096 steps"),
    "stability": ("chat", {"messages": USER, "stability_threshold": 10**9}, "stability_threshold", "at most 256"),
    "max_tokens": ("chat", {"messages": USER, "max_tokens": 10**12}, "max_tokens", "at most 1048576 tokens"),
    "max_completion_tokens": ("chat", {"messages": USER, "max_completion_tokens": 10**12}, "max_completion_tokens",
                              "at most 1048576 tokens"),
    "max_blocks": ("chat", {"messages": USER, "max_blocks": 10**12}, "max_blocks", "at most 65536 blocks"),
    "messages": ("chat", {"messages": USER * 10_000}, "messages", "10000 messages: at most 2048"),
    "stop": ("chat", {"messages": USER, "stop": "x" * 100_000}, "stop", "at most 1024 characters"),
    # Ids outside the vocabulary: the length is checked against the context before the ids one by one.
    "token_ids": ("completions", {"prompt": [5000] * 10**6}, "prompt", "this server's context is"),
    "n": ("chat", {"messages": USER, "n": 10**9}, "n", "one choice per request"),  # bounded before; a guard
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path=tmp_path_factory.mktemp("serve")) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log


def post(server, path, body, timeout=30.0):
    return httpx.post(f"{server.v1}/{path}", json=body, timeout=timeout)


@pytest.mark.parametrize("case", list(CASES))
def test_out_of_bounds_request_is_refused_at_once(server, case):
    path, body, param, text = CASES[case]
    t0 = time.perf_counter()
    r = post(server, "chat/completions" if path == "chat" else path, body)
    took = time.perf_counter() - t0
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert text in err["message"] and "\n" not in err["message"], err
    assert took < 2.0, f"{case}: refused after {took:.2f} s"
    ok = post(server, "chat/completions", {"messages": USER, "max_blocks": 1})  # the queue still moves
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length"), ok.text[:300]


def test_the_bounds_themselves_are_accepted(server):
    body = {"messages": USER, "max_blocks": 1, "stop": ["y" * LIMITS["stop_chars"].bound],
            "stability_threshold": LIMITS["stability_threshold"].bound, "max_denoising_steps": 2}
    r = post(server, "chat/completions", body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["steps_per_block"] == [2]  # the history of 256 canvases never agrees in 2 steps
