"""`dgemma bench --base-url`: any OpenAI-compatible server (dgemma serve, vLLM...) measured from the client over
HTTP, with the same prompt files and printers as in-process bench.

* The URL: `http://HOST:PORT` and `.../v1` are the same target; any other path is the API root as given (a pasted
  `.../chat/completions` is cut back to it). The model is the first id of `GET {root}/models`.
* One request per prompt: `POST {root}/chat/completions`, one user message, streamed with
  `stream_options.include_usage`; `max_tokens`, `seed` and the sampler fields only when their flags were given.
* Arrivals: at most --concurrency in flight; --request-rate R sends them as a seeded Poisson process, inf at once.
* Timed on the client from when a request is sent (after the concurrency gate, as `vllm bench serve
  --max-concurrency`): TTFT at the first chunk with non-empty `delta.content`, e2el at the stream's end; the
  intervals between content chunks are not vLLM's `itl` (a chunk here is a block of tokens).
* A failed request (HTTP error, an error in the stream, a broken connection, a timeout) is a `Result` with its
  message, never an exception.
Must not: define figures (remote_row.py), print, or import torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from dgcli.errors import UserError
from dgcli.measure.workload import Prompt, default_prompt_file, read_prompts

SAMPLER_FIELDS = ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
                  "confidence_threshold", "max_blocks")
READ_TIMEOUT_S = 600.0  # the longest wait for the next bytes of a reply (a queued request waits too)
# bench's flags that mean nothing for a server someone else runs (parameter name -> why).
NOT_WITH_BASE_URL = {
    **dict.fromkeys(("model", "dummy", "layers", "weights"), "the server has loaded its own model"),
    **dict.fromkeys(("dtype", "compile", "cuda_graphs", "threads"), "the server decides how it runs"),
    **dict.fromkeys(("measure_peaks", "peaks_file", "save_peaks"), "a remote target has no roofline"),
    **dict.fromkeys(("random_prompts", "random_input_len"), "text prompts only: use --prompts FILE"),
    "preset": "send settings with their flags (--diffusion-steps ...)", "device": "the server decides where it runs",
    "no_prefix_caching": "the server decides (dgemma serve --no-prefix-caching)",
    "batch_size": "use --concurrency (requests in flight)", "ignore_eos": "the server decides where answers stop",
    "fp8_activations": "the server decides how it runs (DGEMMA_FP8 in the server's environment)"}


# ---- the target ------------------------------------------------------------------------------------------


def api_root(url: str) -> str:
    u = url.strip().rstrip("/")
    for tail in ("/chat/completions", "/completions", "/models"):
        u = u.removesuffix(tail)
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--base-url {url}: use http://HOST:PORT or http://HOST:PORT/v1")
    return u + "/v1" if not parts.path else u


@dataclass
class Target:
    url: str  # as given
    root: str  # the API root requests go to
    headers: dict
    model: str
    models: list[str]
    server: str | None  # the `Server` header of GET /models


def connect(url: str, api_key: str | None = None) -> Target:
    """The API root, and the model ids of `GET {root}/models`: one clear error if it does not answer."""
    import httpx

    root = api_root(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(root + "/models", headers=headers, timeout=30.0)
    except httpx.HTTPError as e:
        raise UserError(f"--base-url {url}: cannot reach {root}/models ({_oneline(e)}); is a server running there?") from None
    if r.status_code in (401, 403):
        raise UserError(f"--base-url {url}: {root}/models answered HTTP {r.status_code} ({_message(r.content)}); "
                        "pass the server's key with --api-key")
    if r.status_code >= 400:
        raise UserError(f"--base-url {url}: {root}/models answered HTTP {r.status_code} ({_message(r.content)}); "
                        "give the API root of an OpenAI-compatible server, e.g. http://HOST:PORT/v1")
    try:
        ids = [str(m["id"]) for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"--base-url {url}: {root}/models did not answer a model list "
                        "({\"data\": [{\"id\": ...}]}); is it an OpenAI-compatible server?") from None
    if not ids:
        raise UserError(f"--base-url {url}: {root}/models lists no model")
    return Target(url, root, headers, ids[0], ids, r.headers.get("server"))


def _oneline(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _message(raw: Any) -> str:
    """The message of an error reply (OpenAI's error object, FastAPI's detail) or its text, on one line."""
    try:
        obj = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj))
        if isinstance(err, dict):
            err = err.get("message") or err.get("detail") or err
        text = err if isinstance(err, str) else json.dumps(err)
    else:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return " ".join(text.split())[:300] or "(empty body)"


# ---- the workload ---------------------------------------------------------------------------------------


def parse_concurrency(spec: str) -> list[int]:
    from dgcli.measure.grid import parse_counts

    return parse_counts(spec, "--concurrency", "a concurrency", "requests in flight", "1,4,16")


def check_rate(rate: float | None) -> float:
    if rate is None:
        return math.inf
    if not rate > 0:  # also nan
        raise UserError(f"--request-rate {rate}: must be > 0 requests/s (inf: all at once, the default)")
    return rate


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """When each of n requests is due, in seconds from a pass's start: a Poisson process of `rate` per second
    (the first at 0); all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def load_prompts(path: str | None, num_prompts: int | None) -> tuple[list[Prompt], str]:
    """The prompt file's rows as text prompts (the bundled set by default): the server tokenises."""
    path = path or default_prompt_file()
    if path is None:
        raise UserError("no prompt set: pass --prompts FILE")
    return read_prompts(path, num_prompts), f"file:{path}"


def request_fields(*, steps=None, t_min=None, t_max=None, entropy_bound=None, stability=None, confidence=None,
                   blocks=None, seed=None, max_tokens=None) -> dict:
    """The body fields the flags ask for (preset key names, OpenAI's seed and max_tokens); given ones only."""
    named = {"max_denoising_steps": steps, "t_min": t_min, "t_max": t_max, "entropy_bound": entropy_bound,
             "stability_threshold": stability, "confidence_threshold": confidence, "max_blocks": blocks,
             "seed": seed, "max_tokens": max_tokens}
    return {k: v for k, v in named.items() if v is not None}


# ---- one request, one pass ---------------------------------------------------------------------------


@dataclass
class Result:
    text: str | None = None  # the reply's content; None when the request failed
    error: str | None = None
    ttft_s: float | None = None  # None: no content arrived
    e2el_s: float = 0.0
    intervals: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict | None = None
    finish: str | None = None
    streamed: bool = True

    def use(self, key: str, kind: type = int) -> Any:
        """A usage field when it is a whole number (kind list: a list of them), else None."""
        v = (self.usage or {}).get(key)
        whole = [isinstance(x, int) and not isinstance(x, bool) for x in (v if isinstance(v, list) else [v])]
        return v if all(whole) and isinstance(v, list) == (kind is list) else None


@dataclass
class Pass:
    results: list[Result]  # in prompt order
    wall_s: float
    prefix_cache: tuple[int, int] | None = None  # (tokens looked up, found) over the pass: the server's /metrics


PREFIX_COUNTERS = ("dgemma_prefix_cache_queries_total", "dgemma_prefix_cache_hits_total")


async def prefix_cache_counts(client: Any, target: Target) -> tuple[int, int] | None:
    """(tokens looked up, found): the server's prefix-cache counters (`GET /metrics`: dgemma serve's), or None."""
    u = urlsplit(target.root)
    try:
        r = await client.get(f"{u.scheme}://{u.netloc}/metrics", headers=target.headers)
    except Exception:  # noqa: BLE001 - a figure we may not get, never a failed run
        return None
    if r.status_code != 200:
        return None
    got = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in PREFIX_COUNTERS:
            try:
                got[name] = int(float(value))
            except ValueError:
                return None
    return (got[PREFIX_COUNTERS[0]], got[PREFIX_COUNTERS[1]]) if len(got) == 2 else None


async def _request(client: Any, target: Target, body: dict) -> Result:
    import httpx

    res, parts = Result(), []
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", target.root + "/chat/completions", json=body, headers=target.headers) as resp:
            if resp.status_code >= 400:
                res.error = f"HTTP {resp.status_code}: {_message(await resp.aread())}"
            elif "text/event-stream" not in resp.headers.get("content-type", ""):  # answered whole
                obj = json.loads(await resp.aread())
                res.streamed, res.usage, res.ttft_s, res.chunks = False, obj.get("usage"), time.perf_counter() - t0, 1
                choice = (obj.get("choices") or [{}])[0]
                parts.append((choice.get("message") or {}).get("content") or "")
                res.finish = choice.get("finish_reason")
            else:
                async for line in resp.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else None
                    if data == "[DONE]":
                        break
                    obj = json.loads(data) if data else None
                    if not isinstance(obj, dict) or "dgemma_draft" in obj:
                        continue
                    if "error" in obj and not obj.get("choices"):
                        res.error = f"error in the stream: {_message(obj)}"
                        break
                    if isinstance(obj.get("usage"), dict):
                        res.usage = obj["usage"]
                    choice = (obj.get("choices") or [None])[0]
                    if not isinstance(choice, dict):
                        continue
                    res.finish = choice.get("finish_reason") or res.finish
                    content = (choice.get("delta") or {}).get("content")
                    if isinstance(content, str) and content:
                        now = time.perf_counter()
                        if res.ttft_s is None:
                            res.ttft_s = now - t0
                        else:
                            res.intervals.append(now - last)
                        last = now
                        parts.append(content)
                        res.chunks += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {_oneline(e)}"
    except (ValueError, AttributeError) as e:
        res.error = f"not an OpenAI reply: {_oneline(e)}"
    res.e2el_s = time.perf_counter() - t0
    if res.error is None:
        res.text = "".join(parts)
    return res


async def _timed_pass(client: Any, target: Target, bodies: list[dict], concurrency: int, rate: float, seed: int,
                      progress: Callable[[str], None] | None = None) -> Pass:
    """Every body sent once at its arrival time, at most `concurrency` in flight; the prefix-cache counters read
    before and after (not timed)."""
    gate, due, done = asyncio.Semaphore(concurrency), arrivals(len(bodies), rate, seed), [0]

    async def one(i: int) -> Result:
        wait = t0 + due[i] - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        async with gate:
            r = await _request(client, target, bodies[i])
        done[0] += 1
        if progress:
            progress(f"{done[0]}/{len(bodies)} requests done")
        return r

    before = await prefix_cache_counts(client, target)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    wall = time.perf_counter() - t0
    after = await prefix_cache_counts(client, target) if before is not None else None
    counts = None if after is None else (after[0] - before[0], after[1] - before[1])
    return Pass(list(results), wall, counts)


def measure(target: Target, prompts: list[Prompt], fields: dict, *, runs: int, warmup: int, concurrency: int,
            rate: float, seed: int, progress: Callable[[str], None] | None = None,
            out: list | None = None) -> tuple[int, str | None]:
    """`warmup` untimed requests, then `runs` timed passes appended to `out` as they finish (Ctrl-C keeps them).
    Returns the warm-up's failures and the first one's message."""
    out = [] if out is None else out
    return asyncio.run(_measure(target, prompts, fields, runs, warmup, concurrency, rate, seed, progress, out))


async def _measure(target, prompts, fields, runs, warmup, concurrency, rate, seed, progress, out):
    import httpx

    bodies = [{"model": target.model, "messages": [{"role": "user", "content": p.text}], "stream": True,
               "stream_options": {"include_usage": True}, **fields} for p in prompts]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=30.0), limits=limits) as client:
        warm = Pass([], 0.0)
        if warmup:
            if progress:
                progress(f"warm-up: {warmup} request(s), concurrency {concurrency} (untimed)")
            warm = await _timed_pass(client, target, [bodies[i % len(bodies)] for i in range(warmup)],
                                     concurrency, math.inf, seed)
        for r in range(runs):
            tell = (lambda t, r=r: progress(f"concurrency {concurrency}  run {r + 1}/{runs}: {t}")) if progress else None
            out.append(await _timed_pass(client, target, bodies, concurrency, rate, seed, tell))
    bad = [x.error for x in warm.results if x.error]
    return len(bad), (bad[0] if bad else None)
