"""The row and the card of `dgemma bench --base-url` (remote.py measures): the figures from the client's timings
and the replies' `usage`, their definitions, the provenance of a remote target, the rows through bench's printers.

A figure that needs what the server did not report is null for the whole row and `not_measured` says why;
server-side figures are never measured from a client; failed requests are counted and left out of every other
figure. Must not: send requests, print, import torch.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from typing import Any

from dgcli.measure.metrics import NOT_IN_CSV, SETTINGS, latencies, min_max, quantiles, stat, steps_figures
from dgcli.measure.quality import bench_quality
from dgcli.measure.remote import SAMPLER_FIELDS, Pass, Result, Target
from dgcli.measure.workload import Prompt, prompt_set_hash

HEADLINE = ["concurrency", "request_rate", "quality", "completed", "failed", "output_throughput",
            "request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "p99_e2el_ms",
            "mean_chunk_interval_ms", "diffusion_steps_per_canvas"]
SERVER_SIDE = ("server-side figures (mean_step_ms, diffusion_committed_throughput, diffusion_canvas_positions, "
               "batched_decoder_passes, mean_queue_ms, peak_memory_bytes, the roofline): not visible from the client")

_M = "over completed requests"
DEFINITIONS: dict[str, str] = {
    "base_url": "the API root measured (--base-url)",
    "model": "the model id measured: the first of GET /models",
    "concurrency": "most requests in flight at once (--concurrency; vllm bench serve --max-concurrency)",
    "request_rate": "[req/s] mean rate of request arrivals (Poisson, seeded by --seed); inf: every prompt of a pass sent at once, up to the concurrency",
    "completed": "requests that finished without an error (prompts x runs; warm-up excluded)",
    "failed": "requests that failed: an HTTP error status, an error object in the stream, a broken connection or a timeout",
    "first_error": "the message of the first failed request",
    "duration": "[s] wall time of the timed passes, summed: each pass from its first request sent to its last reply's end",
    "total_output_tokens": f"usage.completion_tokens summed {_M} (the server's count)",
    "output_throughput": "[tok/s] a pass's usage.completion_tokens / its wall time (mean over passes)",
    "output_throughput_std": "[tok/s] standard deviation of output_throughput over runs",
    "request_throughput": "[req/s] completed requests / a pass's wall time (mean over passes)",
    "mean_ttft_ms": "[ms] time to first content: from sending the request to the first chunk with non-empty delta.content (the server's queue, prefill and first block included; a role-only chunk does not count)",
    **quantiles("ttft", "time to first content"),
    "mean_e2el_ms": "[ms] end-to-end latency: from sending the request to the end of its stream ([DONE])",
    **quantiles("e2el", "end-to-end latency"), "std_e2el_ms": "[ms] standard deviation of end-to-end latency",
    "mean_chunk_interval_ms": "[ms] time between consecutive content chunks of a reply (dgemma serve sends one per committed block: the block latency the client sees); vllm bench serve's itl is the interval between any chunks of a token stream",
    **quantiles("chunk_interval", "interval between content chunks", (50, 99)),
    "mean_chunks_per_request": f"content chunks per request, {_M}",
    "finish_length_rate": "share of completed requests whose finish_reason is length (cut at the token budget)",
    "mean_input_len": f"usage.prompt_tokens per request {_M} (the server's count, chat template included)",
    "diffusion_denoising_steps": f"usage.denoising_steps summed {_M} (dgemma serve's diffusion usage)",
    "mean_blocks_per_request": f"usage.blocks per request, {_M}",
    "diffusion_steps_per_canvas": "mean denoising steps per block: usage.denoising_steps / usage.blocks, summed over requests",
    "p50_steps_per_block": "median of usage.steps_per_block", "p90_steps_per_block": "90th percentile of usage.steps_per_block",
    "p99_steps_per_block": "99th percentile of usage.steps_per_block", "steps_histogram": "blocks per step count {steps: blocks}",
    "cap_hit_rate": "share of blocks that ran every step of --diffusion-steps (known only when that flag set the cap)",
    "prefix_cache_hit_rate": "prompt tokens the server found in its prefix cache / tokens it looked up over the timed passes (dgemma serve's /metrics counters; vLLM's definition); null when the server has no such counters or looked nothing up",
    "quality": "exact_match when the prompts have reference answers; null (n/a) when they carry none",
    "quality_metric": "which figure quality is: exact_match (null when there is none)",
    "exact_match": f"share of answered prompts whose content equals the reference after stripping whitespace ({_M} of every pass)",
    "answered_prompts": "prompts of the set that carry a reference answer",
    "spread": "{figure: [min, max]} over the timed passes (each pass is every prompt once)",
    "spread_passes": "timed passes the spread is taken over",
    "not_measured": "what this server or any client cannot give, each as 'figures: why'",
    **dict.fromkeys((*SETTINGS, "max_tokens"),
                    "sent with every request (blocks as max_blocks); null: not sent, the server's own setting"),
}
SPREAD_KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "mean_e2el_ms")


# ---- the figures, the row, the card --------------------------------------------------------------------


def _pass_figures(p: Pass, tokens: bool) -> dict:
    ok = [r for r in p.results if r.error is None]
    return {"output_throughput": sum(r.use("completion_tokens") for r in ok) / p.wall_s if tokens else None,
            "request_throughput": len(ok) / p.wall_s,
            "mean_ttft_ms": stat([r.ttft_s for r in ok if r.ttft_s is not None], "mean"),
            "mean_e2el_ms": stat([r.e2el_s for r in ok], "mean")}


def summarize(passes: list[Pass], prompts: list[Prompt], fields: dict) -> dict:
    """The figures of one concurrency level's timed passes, and what could not be measured, with why."""
    every = [r for p in passes for r in p.results]
    ok, bad = [r for r in every if r.error is None], [r for r in every if r.error is not None]
    missing = [SERVER_SIDE]
    row: dict[str, Any] = {"completed": len(ok), "failed": len(bad)}
    if bad:
        sent = [k for k in fields if k in SAMPLER_FIELDS]
        hint = (f" (the requests carried {', '.join(sent)} as extra body fields; a server other than dgemma serve "
                "may reject them: leave out the flags that set them)") if sent and bad[0].error.startswith("HTTP 4") else ""
        row["first_error"] = bad[0].error + hint
    tokens = bool(ok) and all(r.use("completion_tokens") is not None for r in ok)
    if ok and not tokens:
        n = sum(r.use("completion_tokens") is None for r in ok)
        missing.append(f"total_output_tokens, output_throughput, mean_input_len: {n} of {len(ok)} replies carried "
                       "no usage.completion_tokens (the server ignored stream_options.include_usage)")
    each = [_pass_figures(p, tokens) for p in passes]
    per_run = [e["output_throughput"] for e in each] if tokens else []
    row.update({"duration": sum(p.wall_s for p in passes),
                "total_output_tokens": sum(r.use("completion_tokens") for r in ok) if tokens else None,
                "output_throughput": stat(per_run, "mean", 1.0), "output_throughput_std": stat(per_run, "std", 1.0),
                "request_throughput": statistics.fmean(e["request_throughput"] for e in each)})
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    if len(ttft) < len(ok):
        missing.append(f"ttft: {len(ok) - len(ttft)} of {len(ok)} replies had no content (left out of the TTFT figures)")
    row.update(latencies("ttft", ttft))
    row.update(latencies("e2el", [r.e2el_s for r in ok], ("mean", 50, 90, 99, "std")))
    gaps = [g for r in ok for g in r.intervals]
    if ok and not gaps:
        missing.append("chunk intervals: every reply came in one content chunk")
    if any(not r.streamed for r in ok):
        missing.append(f"ttft, chunk intervals: {sum(not r.streamed for r in ok)} replies were not streamed (ttft = e2el)")
    row.update(latencies("chunk_interval", gaps, ("mean", 50, 99)))
    row["mean_chunks_per_request"] = statistics.fmean(r.chunks for r in ok) if ok else None
    row["finish_length_rate"] = sum(r.finish == "length" for r in ok) / len(ok) if ok else None
    prompt_tokens = [r.use("prompt_tokens") for r in ok]
    row["mean_input_len"] = statistics.fmean(prompt_tokens) if ok and None not in prompt_tokens else None
    row.update(_diffusion(ok, fields, missing))
    counts = [p.prefix_cache for p in passes]  # null (not listed as missing) for a server without the counters
    row["prefix_cache_hit_rate"] = (sum(h for _, h in counts) / sum(q for q, _ in counts)
                                    if passes and None not in counts and sum(q for q, _ in counts) else None)
    row.update(bench_quality(prompts, [p.results for p in passes]))
    row["spread"] = {k: min_max([e[k] for e in each]) for k in SPREAD_KEYS}
    row["spread_passes"] = len(passes)
    row["not_measured"] = missing
    row["runs_detail"] = [{**e, "requests": len(p.results), "failed": sum(r.error is not None for r in p.results),
                           "wall_s": p.wall_s} for e, p in zip(each, passes)]
    return row


def _diffusion(ok: list[Result], fields: dict, missing: list[str]) -> dict:
    keys = ("diffusion_denoising_steps", "mean_blocks_per_request", "diffusion_steps_per_canvas",
            "p50_steps_per_block", "p90_steps_per_block", "p99_steps_per_block", "steps_histogram", "cap_hit_rate")
    if not ok or any(r.use("steps_per_block", list) is None for r in ok):
        if ok:
            missing.append("diffusion_denoising_steps, steps per block, blocks: the server reported no diffusion usage "
                           "(usage.blocks, denoising_steps, steps_per_block, as dgemma serve does)")
        return dict.fromkeys(keys)
    steps = [s for r in ok for s in r.use("steps_per_block", list)]
    total = sum(r.use("denoising_steps") or sum(r.use("steps_per_block", list)) for r in ok)
    blocks = sum(r.use("blocks") or len(r.use("steps_per_block", list)) for r in ok)
    cap = fields.get("max_denoising_steps")
    if cap is None:
        missing.append("cap_hit_rate: the server's max_denoising_steps is not known to the client (give --diffusion-steps)")
    return {"diffusion_denoising_steps": total, "mean_blocks_per_request": blocks / len(ok),
            "diffusion_steps_per_canvas": total / blocks if blocks else None,
            **steps_figures(steps, cap)}


def make_row(target: Target, *, prompts: list[Prompt], prompt_source: str, fields: dict, concurrency: int,
             rate: float, runs_done: int, runs_asked: int, warmup: int, summary: dict, label: str | None,
             metadata: dict) -> dict:
    """The record: label, target, settings, workload, figures, provenance (in that order)."""
    import httpx

    from dgcli import __version__
    from dgcli.measure.printers import git_commit

    row = {"label": label, "kind": "bench", "target": "remote", "base_url": target.root, "model": target.model,
           **{k: fields.get(k) for k in SETTINGS if k != "blocks"},  # as sent; null: the server's own setting
           "blocks": fields.get("max_blocks"), "max_tokens": fields.get("max_tokens"), "concurrency": concurrency,
           "request_rate": "inf" if math.isinf(rate) else rate,  # as vllm bench serve writes it
           "prompt_source": prompt_source, "num_prompts": len(prompts), "runs": runs_done, "warmups": warmup}
    if runs_done < runs_asked:
        row["interrupted"] = f"Ctrl-C after {runs_done} of {runs_asked} runs"
    row.update(summary)
    unknown = ("device_name", "dtype", "torch", "triton", "cuda", "torch_threads", "threads_source",
               "model_parameters", "model_active_parameters", "dummy_weights", "kernels", "compiled_decoder",
               "step_mode")
    row["provenance"] = {
        "device": f"remote: {target.root}", **dict.fromkeys(unknown), "dgemma": __version__,
        "git_commit": git_commit(), "model": target.model, "model_name": target.model, "settings": fields,
        "seed": fields.get("seed"), "prompt_set_hash": prompt_set_hash(prompts, "text"), "label": label,
        "metadata": metadata, "server": target.server, "client": f"httpx {httpx.__version__}",
        "host": platform.node(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return row


def card(target: Target, *, prompts: list[Prompt], prompt_source: str, fields: dict) -> dict:
    return {"target": "remote", "base_url": target.url, "api_root": target.root, "model": target.model,
            "models": target.models, "server": target.server,
            "measured": f"from the client over HTTP: POST {target.root}/chat/completions, streamed (SSE) with "
                        "stream_options.include_usage, one user message per prompt",
            "request_fields": fields, "prompt_set": prompt_source, "prompts": len(prompts),
            "roofline": "none: the client cannot see the server's device, dtype, canvas or decoder passes "
                        "(run in-process dgemma bench on the server's machine for it)"}


def card_markdown(c: dict) -> str:
    sent = ", ".join(f"{k}={v}" for k, v in c["request_fields"].items()) or "none (the server's own settings)"
    lines = [f"## {c['model']} at {c['api_root']}", "",
             f"source: a remote server ({c['server'] or 'it sends no Server header'}), measured {c['measured']}", "",
             f"- model: {c['model']} (the first of GET /models: {', '.join(c['models'])})",
             f"- prompts: {c['prompts']} from {c['prompt_set']}", f"- request fields: {sent}",
             f"- roofline: {c['roofline']}"]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
    """The rows' md, through bench's printers: columns named by concurrency, then what was not measured (the other
    formats are every bench's: `cli.console.emit`)."""
    from dgcli.measure import printers as report

    shown = [dict(r, label=f"{r.get('label') or ''} concurrency {r['concurrency']}".strip()) for r in rows]
    md = report.to_markdown(shown, headline=HEADLINE, definitions=DEFINITIONS, title="Results", skip=NOT_IN_CSV)
    where: dict[str, list[str]] = {}
    for r in shown:
        for why in r["not_measured"]:
            where.setdefault(why, []).append(r["label"])
    gaps = [f"- {why}" + ("" if len(names) == len(rows) else f" ({', '.join(names)})") for why, names in where.items()]
    return md + "\n### Not measured\n\n" + "\n".join(gaps) + "\n\n" + report.headline_json(rows, ["label"] + HEADLINE) + "\n"
