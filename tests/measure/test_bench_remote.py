"""`dgemma bench --base-url`: against a small fake OpenAI-compatible server (known sleeps, with and without
usage, an HTTP 400 for the sampler fields, an error inside the stream), against the real `dgemma serve`
(its rows carry the diffusion figures and the quality of in-process bench), and the flags' errors."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import pytest
import uvicorn
from cli_run import run
from server_proc import free_port, serve
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from dgcli.measure import remote
from dgcli.measure.remote_row import SERVER_SIDE

TTFT_S, GAP_S = 0.15, 0.1  # the fake's sleeps: before the first content chunk, between the two
KEY = "k"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(content=None, finish=None, role=False) -> dict:
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake-1",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def fake_app(usage: str) -> Starlette:
    """usage: "plain" (OpenAI's usage; the sampler fields are refused as unknown, as OpenAI does), "none" (no
    usage chunk at all) or "diffusion" (dgemma serve's usage; needs the API key)."""

    def refused(request) -> bool:
        return usage == "diffusion" and request.headers.get("authorization") != f"Bearer {KEY}"

    async def models(request):
        if refused(request):
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": "fake-1"}, {"id": "fake-2"}]})

    async def chat(request):
        body = await request.json()
        if refused(request):
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        if usage == "plain" and "max_denoising_steps" in body:
            return JSONResponse({"error": {"message": "Unrecognized request argument supplied: max_denoising_steps",
                                           "type": "invalid_request_error", "param": None, "code": None}},
                                status_code=400)
        prompt = body["messages"][0]["content"]

        async def stream():
            yield _sse(_chunk("", role=True))  # a role-only chunk at once: not the first content
            if prompt == "boom":
                yield _sse({"error": {"message": "boom exploded", "type": "server_error"}})
                return
            await asyncio.sleep(TTFT_S)
            yield _sse(_chunk("a"))
            yield _sse({"id": "x", "choices": [], "dgemma_draft": {"text": "not content"}})
            await asyncio.sleep(GAP_S)
            yield _sse(_chunk(" b"))
            yield _sse(_chunk(finish="length" if prompt == "long" else "stop"))
            use = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
            if usage == "diffusion":
                use.update(blocks=2, denoising_steps=7, steps_per_block=[4, 3])
            if usage != "none":
                yield _sse({"id": "x", "choices": [], "usage": use})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@contextmanager
def fake_server(usage: str):
    server = uvicorn.Server(uvicorn.Config(fake_app(usage), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "one", "answer": "a b"}, {"prompt": "two", "answer": "a b"},
                                                        {"prompt": "long", "answer": "a b"}, {"prompt": "three", "answer": "x"}]))
    return str(f)


def bench(capsys, *args):
    return run(["bench", *args], capsys)


def test_openai_usage_without_diffusion_fields(capsys, prompts):
    with fake_server("plain") as url:
        code, out, err = bench(capsys, "--base-url", url, "--prompts", prompts, "--concurrency", "1,2", "--runs", "2",
                               "--warmup", "1", "--format", "json", "--label", "fake", "--metadata", "k=v")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["card"]["model"] == "fake-1" and doc["card"]["models"] == ["fake-1", "fake-2"]
    assert doc["card"]["api_root"] == url + "/v1" and "roofline" in doc["card"]
    rows = doc["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["completed"] == 8 and r["failed"] == 0 and "first_error" not in r and r["runs"] == 2
        assert r["model"] == "fake-1" and r["request_rate"] == "inf" and r["label"] == "fake"
        # Timed on the client: the role-only chunk does not count, the draft chunk is no content.
        assert TTFT_S * 1e3 <= r["mean_ttft_ms"] < (TTFT_S + GAP_S) * 1e3 and r["p99_ttft_ms"] >= TTFT_S * 1e3
        assert GAP_S * 1e3 <= r["median_chunk_interval_ms"] < 2 * GAP_S * 1e3
        assert r["mean_e2el_ms"] >= (TTFT_S + GAP_S) * 1e3 and r["mean_chunks_per_request"] == 2
        assert r["total_output_tokens"] == 16 and r["mean_input_len"] == 5
        passes = r["runs_detail"]
        assert r["output_throughput"] == pytest.approx(statistics.fmean(8 / p["wall_s"] for p in passes))
        assert r["request_throughput"] == pytest.approx(statistics.fmean(4 / p["wall_s"] for p in passes))
        assert r["duration"] == pytest.approx(sum(p["wall_s"] for p in passes))
        assert r["quality"] == 0.75 and r["quality_metric"] == "exact_match" and r["finish_length_rate"] == 0.25
        assert r["diffusion_denoising_steps"] is None and r["steps_histogram"] is None
        assert any(n.startswith("diffusion_denoising_steps") and "no diffusion usage" in n for n in r["not_measured"])
        assert not any(n.startswith("total_output_tokens") for n in r["not_measured"])
        prov = r["provenance"]
        assert prov["device"] == f"remote: {url}/v1" and prov["metadata"] == {"k": "v"} and prov["model"] == "fake-1"
        assert prov["server"] == "uvicorn" and prov["prompt_set_hash"] and prov["timestamp"]
    # One request at a time: a pass takes every request's latency in turn; two at a time about half of it.
    assert rows[0]["duration"] >= 2 * 4 * (TTFT_S + GAP_S)
    assert rows[1]["duration"] < rows[0]["duration"]
    keys = {k for r in rows for k in r} - {"label", "kind", "target", "prompt_source", "num_prompts", "runs",
                                           "warmups", "provenance", "runs_detail"}
    assert keys <= set(doc["definitions"]), keys - set(doc["definitions"])


def test_no_usage_at_all(capsys, prompts):
    with fake_server("none") as url:
        code, out, err = bench(capsys, "--base-url", url + "/v1/", "--prompts", prompts, "--runs", "1", "--warmup", "0",
                               "--format", "jsonl")
    assert code == 0, err
    row = json.loads(out)
    assert row["concurrency"] == 1 and row["completed"] == 4
    assert row["total_output_tokens"] is None and row["output_throughput"] is None and row["mean_input_len"] is None
    assert row["request_throughput"] > 0 and row["mean_ttft_ms"] >= TTFT_S * 1e3 and row["quality"] == 0.75
    gaps = "\n".join(row["not_measured"])
    assert "output_throughput" in gaps and "no usage.completion_tokens" in gaps and "no diffusion usage" in gaps


def test_sampler_fields_refused_by_a_plain_server(capsys, prompts):
    with fake_server("plain") as url:
        code, out, err = bench(capsys, "--base-url", url, "--prompts", prompts, "--runs", "1", "--warmup", "0",
                               "--diffusion-steps", "8", "--format", "jsonl")
    assert code == 1  # nothing could be measured: the row is printed, the run fails
    row = json.loads(out)
    assert row["completed"] == 0 and row["failed"] == 4 and row["max_denoising_steps"] == 8
    assert row["first_error"].startswith("HTTP 400: Unrecognized request argument supplied: max_denoising_steps")
    assert "max_denoising_steps as extra body fields" in row["first_error"]
    assert row["mean_ttft_ms"] is None and row["output_throughput"] is None and row["quality"] is None
    assert "4 of 4 requests failed at concurrency 1: HTTP 400" in err and "every request" in err


def test_diffusion_usage_api_key_and_an_error_in_the_stream(capsys, prompts, tmp_path):
    more = tmp_path / "more.jsonl"
    more.write_text(Path(prompts).read_text() + json.dumps({"prompt": "boom", "answer": "a b"}) + "\n")
    with fake_server("diffusion") as url:
        code, _, err = bench(capsys, "--base-url", url, "--prompts", str(more))
        assert code == 2 and "HTTP 401" in err and "--api-key" in err and len(err.strip().splitlines()) == 1
        code, out, err = bench(capsys, "--base-url", url, "--api-key", KEY, "--prompts", str(more), "--runs", "2",
                               "--warmup", "0", "--diffusion-steps", "4", "--concurrency", "4", "--request-rate", "50",
                               "--seed", "1", "--format", "md", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert code == 0, err
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["completed"] == 8 and row["failed"] == 2 and row["first_error"] == "error in the stream: boom exploded"
    assert row["request_rate"] == 50 and row["concurrency"] == 4 and row["seed"] == 1
    assert row["diffusion_denoising_steps"] == 8 * 7 and row["mean_blocks_per_request"] == 2
    assert row["diffusion_steps_per_canvas"] == 3.5 and row["steps_histogram"] == {"3": 8, "4": 8}
    assert row["cap_hit_rate"] == 0.5 and row["p50_steps_per_block"] == 3.5
    assert row["quality"] == 0.75  # the failed prompt is left out, not scored wrong
    assert "2 of 10 requests failed at concurrency 4: error in the stream" in err
    assert row["not_measured"] == [SERVER_SIDE]  # everything else was measured
    assert "## fake-1 at " in out and "| concurrency 4 |" in out and "### Not measured" in out
    assert json.loads(out.strip().splitlines()[-1])["concurrency"] == 4  # one JSON line last


def test_ctrl_c_keeps_the_finished_runs(capsys, prompts, monkeypatch):
    real, calls = remote._timed_pass, {"n": 0}

    async def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # warm-up and run 1 done, run 2 cut
            raise KeyboardInterrupt
        return await real(*a, **k)

    monkeypatch.setattr(remote, "_timed_pass", flaky)
    with fake_server("none") as url:
        code, out, err = bench(capsys, "--base-url", url, "--prompts", prompts, "--runs", "3", "--concurrency", "4,8",
                               "--format", "jsonl")
    assert code == 130
    row = json.loads(out)
    assert row["runs"] == 1 and row["completed"] == 4 and "1 of 3" in row["interrupted"]
    assert "concurrency 8 not measured" in err


@pytest.mark.parametrize("args, words", [
    (["--base-url", "http://127.0.0.1:9", "--model", "x"], "--model does not apply with --base-url"),
    (["--base-url", "http://127.0.0.1:9", "--batch-size", "2"], "--batch-size does not apply with --base-url: use --concurrency"),
    (["--base-url", "http://127.0.0.1:9", "--device", "cpu"], "--device does not apply"),
    (["--base-url", "http://127.0.0.1:9", "--no-measure-peaks"], "--no-measure-peaks does not apply"),
    (["--base-url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency '0': 0 is not a concurrency"),
    (["--base-url", "http://127.0.0.1:9", "--concurrency", "1,,2"], "--concurrency '1,,2'"),
    (["--base-url", "http://127.0.0.1:9", "--request-rate", "0"], "--request-rate 0.0: must be > 0"),
    (["--base-url", "ftp://host"], "--base-url ftp://host: use http://HOST:PORT"),
    (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
    (["--concurrency", "4"], "--concurrency applies only with --base-url"),
    (["--api-key", "k"], "--api-key applies only with --base-url"),
])
def test_flags_that_do_not_go_together_are_one_line(capsys, args, words):
    code, out, err = bench(capsys, *args)
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err


def test_url_forms_and_arrivals():
    assert remote.api_root("http://h:8000") == remote.api_root("http://h:8000/v1/") == "http://h:8000/v1"
    assert remote.api_root("http://h:8000/v1/chat/completions") == "http://h:8000/v1"
    assert remote.api_root("https://h/openai/v2") == "https://h/openai/v2"  # another root is taken as given
    assert remote.arrivals(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    due = remote.arrivals(2000, 10.0, 7)
    assert due == remote.arrivals(2000, 10.0, 7) and due[0] == 0 and due == sorted(due)
    assert statistics.fmean(b - a for a, b in pairwise(due)) == pytest.approx(0.1, rel=0.1)


# ---- against the real server ---------------------------------------------------------------------------


@pytest.mark.slow
def test_against_dgemma_serve_matches_in_process_bench(capsys, tmp_path):
    """The server is batch invariant and runs the same settings and seed: at every concurrency its answers,
    step counts and tokens are in-process bench's."""
    from dgcli.measure.workload import default_prompt_file

    mixed = tmp_path / "mixed.jsonl"  # every third prompt of the bundled set: every family, one to four blocks
    mixed.write_text("".join(default_prompt_file().read_text().splitlines(keepends=True)[::3]))
    common = ["--prompts", str(mixed), "--runs", "1", "--warmup", "0", "--format", "json"]
    code, out, err = bench(capsys, *common, "--no-measure-peaks")
    assert code == 0, err
    local = json.loads(out)["rows"][0]
    with serve("--max-batch-size", "4", tmp_path=tmp_path) as server:
        code, out, err = bench(capsys, "--base-url", server.v1, "--concurrency", "1,4", *common)
        log = server.log()
    assert code == 0, err
    assert "Traceback" not in log, log
    doc = json.loads(out)
    assert doc["card"]["model"] == "tiny"
    for row in doc["rows"]:
        assert row["completed"] == 32 and row["failed"] == 0
        assert row["quality"] == local["quality"] and row["answered_prompts"] == local["answered_prompts"]
        assert row["diffusion_denoising_steps"] == local["diffusion_denoising_steps"]
        assert row["steps_histogram"] == local["steps_histogram"]
        assert row["diffusion_steps_per_canvas"] == pytest.approx(local["diffusion_steps_per_canvas"])
        assert row["mean_blocks_per_request"] == pytest.approx(local["mean_blocks_per_request"])
        assert row["total_output_tokens"] == local["total_output_tokens"]
        assert row["mean_input_len"] == pytest.approx(local["mean_input_len"])
        assert row["output_throughput"] > 0 and 0 < row["mean_ttft_ms"] <= row["mean_e2el_ms"]
        assert row["mean_chunks_per_request"] > 1 and row["mean_chunk_interval_ms"] > 0  # one chunk per block
        assert row["not_measured"] == [SERVER_SIDE, row["not_measured"][1]]
        assert row["not_measured"][1].startswith("cap_hit_rate: the server's max_denoising_steps is not known")


def test_the_remote_row_imports_no_torch():
    """`bench --base-url` measures a server from the client: its figures (remote_row.py, and the statistics it
    shares with metrics.py) load without torch."""
    import subprocess
    import sys

    code = "import sys, dgcli.measure.remote_row; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
