"""A stream whose engine goes quiet for longer than a client's read timeout stays alive: the server sends an
SSE comment (`: keep-alive`) every `State.keepalive` seconds of silence, and the clients that read our
streams (the openai client, `dgemma bench --base-url`) skip it and get the whole answer. Here the interval is
0.2 s and the engine's first pass is held for 1.5 s, past the clients' 1 s read timeout; the real case is a
26B model on a CPU, minutes a block, against the 15 s default."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from dgcli.measure import remote
from dgcli.runtime.session import open_session
from server_proc import in_process

MESSAGES = [{"role": "user", "content": "Reverse: c a t"}]
HOLD_S, READ_TIMEOUT_S = 1.5, 1.0


@pytest.fixture(scope="module")
def live():
    def quick(state):
        state.keepalive = 0.2

    with in_process(open_session(None, None, {}), slots=2, prepare=quick) as (url, state):
        yield url, state


@pytest.fixture
def held(live):
    """The engine's next pass starts `HOLD_S` late (once): a block that takes long to decode."""
    _, state = live
    worker, once = state.worker, threading.Event()
    real_pass = worker._pass

    def late_pass():
        if not once.is_set():
            once.set()
            threading.Event().wait(HOLD_S)
        real_pass()

    worker._pass = late_pass
    yield
    del worker._pass


def test_a_quiet_stream_sends_comments_and_the_raw_stream_still_parses(live, held):
    base, _ = live
    body = {"model": "tiny", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=READ_TIMEOUT_S) as r:
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    comments = [e for e in events if e.startswith(":")]
    assert len(comments) >= 3 and set(comments) == {": keep-alive"}, events
    assert all(e.startswith("data: ") for e in events[:-1] if not e.startswith(":"))


def test_the_openai_client_reads_past_the_comments(live, held):
    base, _ = live
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                           timeout=openai.Timeout(30, read=READ_TIMEOUT_S))
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "t a c"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bench_base_url_reads_past_the_comments(live, held):
    base, _ = live
    target = remote.connect(base + "/v1")

    async def one():
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=READ_TIMEOUT_S)) as client:
            return await remote._request(client, target, {"model": "tiny", "messages": MESSAGES, "stream": True})

    res = asyncio.run(one())
    assert res.error is None and res.text == "t a c" and res.finish == "stop", res
    assert res.ttft_s >= HOLD_S  # the comments are no content: the first token still waited for the engine
