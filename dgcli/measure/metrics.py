"""The figures of the one bench/sweep record: their definitions and how they come from measured requests.

Every figure a row carries has a definition in `DEFINITIONS` (printed next to it) and keys reuse
`vllm bench serve`'s names where one exists (PRODUCT.md). Owns: `summarize` (responses -> figures, incl.
the per-request FLOP/byte accounting against the roofline floor). Must not: run anything, print, or
format numbers (printers.py does).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from dgcli.measure import card as info
from dgcli.model.config import ModelConfig
from dgcli.runtime.request import Response

# Every figure a bench or sweep row carries, with its definition (printed next to it). Units in brackets.
DEFINITIONS: dict[str, str] = {
    "completed": "requests measured (prompts x runs; warm-up excluded)",
    "duration": "[s] sum of the requests' end-to-end times (requests run one after another)",
    "total_output_tokens": "answer tokens committed, up to (not incl.) the first stop id, summed over requests",
    "output_throughput": "[tok/s] committed tokens/s end to end: answer tokens / end-to-end time incl. prefill (mean over runs)",
    "output_throughput_std": "[tok/s] standard deviation of output_throughput over runs",
    "mean_ttft_ms": "[ms] time to first block: start of the request to the first block's tokens (prefill + its denoising)",
    "median_ttft_ms": "[ms] median time to first block",
    "p99_ttft_ms": "[ms] 99th percentile of time to first block",
    "mean_e2el_ms": "[ms] end-to-end latency per request (the sampler's own time)",
    "median_e2el_ms": "[ms] median end-to-end latency",
    "p99_e2el_ms": "[ms] 99th percentile end-to-end latency",
    "std_e2el_ms": "[ms] standard deviation of end-to-end latency",
    "mean_prefill_ms": "[ms] prompt encoder pass per request",
    "diffusion_committed_tokens": "canvas tokens committed: blocks x canvas length (incl. positions after a stop id)",
    "diffusion_committed_throughput": "[tok/s] canvas tokens/s while denoising: committed canvas tokens / denoising time",
    "diffusion_canvas_positions": "canvas positions evaluated: decoder passes x canvas length",
    "diffusion_canvas_positions_per_s": "[pos/s] canvas positions evaluated per second of denoising",
    "diffusion_denoising_steps": "decoder passes (denoising steps), summed over requests",
    "diffusion_steps_per_canvas": "mean denoising steps per block",
    "diffusion_committed_per_step": "canvas tokens committed per denoising step (committed tokens / steps)",
    "tokens_per_forward": "transformers' figure: generated ids up to and incl. the stop id, pads excluded, / decoder passes (mean per request)",
    "mean_step_ms": "[ms] per denoising step: denoising time / decoder passes",
    "mean_commit_ms": "[ms] per commit: encoder pass of a finished block (none when every request is one block)",
    "mean_block_latency_ms": "[ms] per block: (denoising + commit time) / blocks",
    "output_blocks_per_second": "[blocks/s] blocks / end-to-end time",
    "mean_blocks_per_request": "blocks generated per request",
    "p50_steps_per_block": "median denoising steps per block",
    "p90_steps_per_block": "90th percentile of denoising steps per block",
    "p99_steps_per_block": "99th percentile of denoising steps per block",
    "steps_histogram": "blocks per step count {steps: blocks}",
    "cap_hit_rate": "share of blocks that ran every step (hit max_denoising_steps)",
    "cap_hit_rate_first_block": "cap-hit rate of the requests' first blocks only",
    "cap_steps_share": "share of all denoising steps spent in blocks that hit the cap",
    "finish_length_rate": "share of requests that ran out of blocks without a stop id (truncated)",
    "peak_memory_bytes": "[B] peak memory while measuring (method in peak_memory_method)",
    "denoise_flops": "[FLOP] matmul FLOPs of all denoising steps (dgcli.measure.card conventions)",
    "denoise_bytes": "[B] weight + KV bytes the denoising steps must move at least (dgcli.measure.card conventions)",
    "achieved_flops_per_s": "[FLOP/s] denoise_flops / denoising time",
    "achieved_bytes_per_s": "[B/s] denoise_bytes / denoising time",
    "peak_flops_per_s": "[FLOP/s] the device's bf16 matmul peak (source in peaks_source)",
    "peak_bytes_per_s": "[B/s] the device's memory bandwidth peak (source in peaks_source)",
    "flops_utilization": "achieved_flops_per_s / peak_flops_per_s",
    "bandwidth_utilization": "achieved_bytes_per_s / peak_bytes_per_s",
    "floor_step_ms": "[ms] roofline floor per denoising step: max(FLOPs/peak FLOP/s, bytes/peak B/s), averaged over the steps run",
    "floor_bound": "which peak sets the floor: compute or memory",
    "step_vs_floor": "mean_step_ms / floor_step_ms (1.0 = at the roofline)",
    "quality": "exact_match when the prompts have reference answers, else (sweep) agreement (see quality_metric); null (n/a) when bench's prompts carry no answers",
    "quality_metric": "which figure quality is: exact_match or agreement (null when there is none)",
    "exact_match": "share of answered prompts whose answer text equals the reference after stripping whitespace (over every timed pass)",
    "answered_prompts": "prompts of the set that carry a reference answer",
    "spread": "{figure: [min, max]} over the timed passes (runs x seeds; each pass is every prompt once) of the timing figures and quality: how far one pass lands from another",
    "spread_passes": "timed passes the spread is taken over",
    "peak_flops_range": "[FLOP/s] [min, max] of the repeated CPU matmul peak measurement (peak_flops_per_s is their median); null for a datasheet peak",
    "peak_bytes_range": "[B/s] [min, max] of the repeated CPU bandwidth measurement (peak_bytes_per_s is their median); null for a datasheet peak",
    "agreement": "share of token positions equal to the reference setting's output (over the longer of the two)",
}

NOT_IN_CSV = ("runs_detail",)

# The timing figures whose spread over the timed passes every row carries (`spread`).
SPREAD_KEYS = ("output_throughput", "diffusion_committed_throughput", "diffusion_canvas_positions_per_s",
               "mean_ttft_ms", "mean_e2el_ms", "mean_step_ms", "mean_block_latency_ms")


def percentile(values: list[float], q: float) -> float:
    """numpy's linear interpolation between closest ranks; nan for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(runs: list[list[Response]], cfg: ModelConfig, max_steps: int, *, weight_bytes: int,
              peaks: info.Peaks | None, peak_memory: tuple[int, str] | None = None, spread: bool = True) -> dict:
    """Every figure of DEFINITIONS (quality aside) from the measured responses (answer ids after the
    max_tokens cut, as every command counts them); with `spread`, the min and max of each SPREAD_KEYS
    figure over the passes (each pass summarised alone)."""
    reqs = [r for run in runs for r in run]
    c = cfg.canvas_length
    d = [r.done for r in reqs]
    e2e = [x.timings["total_s"] for x in d]
    ttft = [x.timings["first_block_s"] for x in d]
    denoise_s = sum(x.timings["denoise_s"] for x in d)
    commit_s = sum(x.timings["commit_s"] for x in d)
    tokens = sum(len(r.token_ids) for r in reqs)
    blocks = sum(x.blocks for x in d)
    steps = [s for x in d for s in x.steps_per_block]
    passes = sum(steps)
    commits = sum(x.blocks - 1 for x in d)
    per_run = [sum(len(r.token_ids) for r in run) / sum(r.done.timings["total_s"] for r in run) for run in runs]
    hist: dict[str, int] = {}
    for s in sorted(steps):
        hist[str(s)] = hist.get(str(s), 0) + 1
    capped = [s for s in steps if s >= max_steps]

    cost = info.Cost()
    for r in reqs:
        for prefix, s in zip(r.block_prefix, r.done.steps_per_block):
            cost += info.block_cost(cfg, prefix, s, max_steps, weight_bytes=weight_bytes)
    row: dict[str, Any] = {
        "completed": len(reqs),
        "duration": sum(e2e),
        "total_output_tokens": tokens,
        "output_throughput": statistics.fmean(per_run),
        "output_throughput_std": statistics.stdev(per_run) if len(per_run) > 1 else 0.0,
        "mean_ttft_ms": statistics.fmean(ttft) * 1e3,
        "median_ttft_ms": percentile(ttft, 50) * 1e3,
        "p99_ttft_ms": percentile(ttft, 99) * 1e3,
        "mean_e2el_ms": statistics.fmean(e2e) * 1e3,
        "median_e2el_ms": percentile(e2e, 50) * 1e3,
        "p99_e2el_ms": percentile(e2e, 99) * 1e3,
        "std_e2el_ms": (statistics.stdev(e2e) if len(e2e) > 1 else 0.0) * 1e3,
        "mean_prefill_ms": statistics.fmean(x.timings["prefill_s"] for x in d) * 1e3,
        "diffusion_committed_tokens": blocks * c,
        "diffusion_committed_throughput": _ratio(blocks * c, denoise_s),
        "diffusion_canvas_positions": passes * c,
        "diffusion_canvas_positions_per_s": _ratio(passes * c, denoise_s),
        "diffusion_denoising_steps": passes,
        "diffusion_steps_per_canvas": passes / blocks,
        "diffusion_committed_per_step": blocks * c / passes,
        "tokens_per_forward": statistics.fmean(x.tokens_per_forward for x in d),
        "mean_step_ms": denoise_s / passes * 1e3,
        "mean_commit_ms": commit_s / commits * 1e3 if commits else None,
        "mean_block_latency_ms": (denoise_s + commit_s) / blocks * 1e3,
        "output_blocks_per_second": _ratio(blocks, sum(e2e)),
        "mean_blocks_per_request": blocks / len(reqs),
        "p50_steps_per_block": percentile(steps, 50),
        "p90_steps_per_block": percentile(steps, 90),
        "p99_steps_per_block": percentile(steps, 99),
        "steps_histogram": hist,
        "cap_hit_rate": len(capped) / len(steps),
        "cap_hit_rate_first_block": sum(x.steps_per_block[0] >= max_steps for x in d) / len(d),
        "cap_steps_share": sum(capped) / passes,
        "finish_length_rate": sum(r.finish_reason == "length" for r in reqs) / len(reqs),
        "peak_memory_bytes": peak_memory[0] if peak_memory else None,
        "peak_memory_method": peak_memory[1] if peak_memory else None,
        "denoise_flops": cost.flops,
        "denoise_bytes": cost.bytes,
        "achieved_flops_per_s": _ratio(cost.flops, denoise_s),
        "achieved_bytes_per_s": _ratio(cost.bytes, denoise_s),
    }
    if peaks is not None:
        floor_s, bound = info.floor_seconds(cost, peaks)
        row.update({
            "peak_flops_per_s": peaks.flops_per_s, "peak_bytes_per_s": peaks.bytes_per_s,
            "peaks_device": peaks.name, "peaks_source": peaks.source,
            "peak_flops_range": list(peaks.flops_range) if peaks.flops_range else None,
            "peak_bytes_range": list(peaks.bytes_range) if peaks.bytes_range else None,
            "flops_utilization": _ratio(row["achieved_flops_per_s"] or 0.0, peaks.flops_per_s),
            "bandwidth_utilization": _ratio(row["achieved_bytes_per_s"] or 0.0, peaks.bytes_per_s),
            "floor_step_ms": floor_s / passes * 1e3, "floor_bound": bound,
            "step_vs_floor": _ratio(denoise_s, floor_s),
        })
    if spread:
        passes = [summarize([run], cfg, max_steps, weight_bytes=weight_bytes, peaks=None, spread=False) for run in runs]
        row["spread"] = {k: _min_max([p[k] for p in passes]) for k in SPREAD_KEYS}
        row["spread_passes"] = len(runs)
    row["runs_detail"] = [{"output_throughput": t, "requests": len(run)} for t, run in zip(per_run, runs)]
    return row


def _min_max(values: list[float | None]) -> list[float] | None:
    got = [v for v in values if v is not None]
    return [min(got), max(got)] if got else None
