"""The figures of the one bench/sweep record: their definitions and how they come from measured passes.

Every figure a row carries has a definition in `DEFINITIONS` (printed next to it); keys reuse `vllm bench serve`'s
names where one exists (PRODUCT.md). Owns: `Pass`, `summarize` (passes -> figures, the FLOP/byte accounting against
the roofline floor included) and the statistics remote.py's rows share. Must not: run anything, print, format
numbers, or import torch (`bench --base-url` runs without it).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dgcli.measure import cost as info
from dgcli.model.config import ModelConfig

if TYPE_CHECKING:  # not at run time: it imports torch, and `bench --base-url` (remote_row.py) uses this module
    from dgcli.runtime.request import Response



def unit(key: str, definitions: dict[str, str] | None = None) -> str:
    """The unit a figure's definition starts with ("[ms] ..." -> "ms"), else ""."""
    m = re.match(r"\[([^\]]+)\]", (DEFINITIONS if definitions is None else definitions).get(key, ""))
    return m.group(1) if m else ""


def quantiles(name: str, what: str, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, str]:
    """Definitions of the percentiles of a time figure: median_NAME_ms, p90_NAME_ms, ..."""
    return {(f"median_{name}_ms" if q == 50 else f"p{q}_{name}_ms"):
            f"[ms] {'median' if q == 50 else f'{q}th percentile of'} {what}" for q in qs}


# Every figure a bench or sweep row carries, with its definition (printed next to it). Units in brackets.
DEFINITIONS: dict[str, str] = {
    "batch_size": "requests denoised together: the engine's slots (--batch-size); every timed pass submits all prompts at once and a finished request's slot takes the next (continuous batching)",
    "completed": "requests measured (prompts x runs; warm-up excluded)",
    "duration": "[s] wall time of the timed passes, summed: each pass from submitting every prompt to the last answer",
    "total_output_tokens": "answer tokens committed, up to (not incl.) the first stop id, summed over requests",
    "output_throughput": "[tok/s] committed tokens/s end to end: a pass's answer tokens / its wall time incl. prefill (mean over passes)",
    "output_throughput_std": "[tok/s] standard deviation of output_throughput over runs",
    "request_throughput": "[req/s] requests / a pass's wall time (mean over passes)",
    "mean_ttft_ms": "[ms] time to first block: from the request taking a slot to its first block's tokens (prefill + the block's denoising; the wait for a slot is mean_queue_ms)",
    **quantiles("ttft", "time to first block"),
    "mean_e2el_ms": "[ms] end-to-end latency per request: from taking a slot (its prefill) to its last block; the wait for a slot is mean_queue_ms (vllm bench serve --max-concurrency N times a request from when it is sent)",
    **quantiles("e2el", "end-to-end latency"),
    "std_e2el_ms": "[ms] standard deviation of end-to-end latency",
    "mean_queue_ms": "[ms] wait for a free slot: from submission to the start of the request's prefill. Every timed pass submits all its prompts at once, so with fewer slots than prompts (batch size 1 included) it is the wait behind the pass's earlier prompts: it grows with --num-prompts and is the workload's backlog, not a fault; 0 when every request fits in the batch",
    "mean_prefill_ms": "[ms] per request, the whole time of the passes that carry its prompt (chunks under the pass budget); such a pass also steps the running canvases and, in its last chunk, the request's own first canvas, so it overlaps the denoising time (a step's share is mean_step_ms)",
    "mean_vision_ms": "[ms] per request, the vision tower's time on the request's --image(s) (each request's images encoded once, none shared between requests); mean_prefill_ms includes it",
    "images_encoded": "images run through the vision tower over the timed passes: each request's distinct images (one given twice runs once, as the engine keeps it)",
    "images_per_prompt": "images in every timed prompt (--image), before its text",
    "image_tokens_per_prompt": "prompt tokens of those images: their soft tokens (the vision tower's output), one prompt position each",
    "diffusion_committed_tokens": "canvas tokens committed: blocks x canvas length (incl. positions after a stop id)",
    "diffusion_committed_throughput": "[tok/s] canvas tokens/s while denoising: committed canvas tokens / denoising time (the batched decoder passes' own time)",
    "diffusion_canvas_positions": "canvas positions evaluated: denoising steps (request rows of the decoder passes) x canvas length",
    "diffusion_canvas_positions_per_s": "[pos/s] canvas positions evaluated per second of denoising",
    "diffusion_denoising_steps": "denoising steps summed over requests (one per request per decoder pass it was in)",
    "batched_decoder_passes": "decoder passes run: each denoises every occupied slot once (= diffusion_denoising_steps at batch size 1)",
    "slot_occupancy": "diffusion_denoising_steps / (batched_decoder_passes x batch_size): share of the slots that held a request",
    "diffusion_steps_per_canvas": "mean denoising steps per block",
    "diffusion_committed_per_step": "canvas tokens committed per denoising step (committed tokens / steps)",
    "tokens_per_forward": "transformers' figure: generated ids up to and incl. the stop id, pads excluded, / decoder passes (mean per request)",
    "mean_step_ms": "[ms] per decoder pass: denoising time / batched_decoder_passes (at batch size 1: per denoising step)",
    "mean_commit_ms": "[ms] per commit as its request sees it: the encoder pass of a finished block, shared by the requests committing together (none when every request is one block)",
    "mean_block_latency_ms": "[ms] per block as its request sees it: (the request's denoising + commit time) / its blocks",
    "output_blocks_per_second": "[blocks/s] blocks / duration",
    "mean_blocks_per_request": "blocks generated per request",
    "p50_steps_per_block": "median denoising steps per block",
    "p90_steps_per_block": "90th percentile of denoising steps per block",
    "p99_steps_per_block": "99th percentile of denoising steps per block",
    "steps_histogram": "blocks per step count {steps: blocks}",
    "cap_hit_rate": "share of blocks that ran every step (hit max_denoising_steps)",
    "cap_hit_rate_first_block": "cap-hit rate of the requests' first blocks only",
    "cap_steps_share": "share of all denoising steps spent in blocks that hit the cap",
    "prefix_cache_hit_rate": "prompt tokens found in the prefix cache / prompt tokens looked up (vLLM's definition; null with --no-prefix-caching)",
    "finish_length_rate": "share of requests that ran out of blocks without a stop id (truncated)",
    "peak_memory_bytes": "[B] peak memory while measuring (method in peak_memory_method)",
    "denoise_flops": "[FLOP] matmul FLOPs of all denoising steps (dgcli.measure.cost conventions)",
    "denoise_bytes": "[B] bytes the denoising steps must move at least: each request's KV, the weights once per batched decoder pass (for the experts its mean rows x canvas tokens touch; dgcli.measure.cost conventions)",
    "achieved_flops_per_s": "[FLOP/s] denoise_flops / denoising time",
    "achieved_bytes_per_s": "[B/s] denoise_bytes / denoising time",
    "peak_flops_per_s": "[FLOP/s] the device's matmul peak in peak_compute (source in peaks_source)",
    "peak_compute": "the matmul dtype of peak_flops_per_s: the fastest the run's kernels use (int8 for GGML weights on the int8 path, float32 for an fp32 model, bfloat16 else; float8 for dynamic FP8 on CUDA), so the floor stays a lower bound",
    "peak_bytes_per_s": "[B/s] the device's memory bandwidth peak (source in peaks_source)",
    "flops_utilization": "achieved_flops_per_s / peak_flops_per_s",
    "bandwidth_utilization": "achieved_bytes_per_s / peak_bytes_per_s",
    "floor_step_ms": "[ms] roofline floor per decoder pass: max(FLOPs/peak FLOP/s, bytes/peak B/s), averaged over the batched passes run",
    "floor_bound": "which peak sets the floor: compute or memory",
    "step_vs_floor": "mean_step_ms / floor_step_ms (1.0 = at the roofline)",
    "quality": "exact_match when the prompts have reference answers, else (sweep) agreement (see quality_metric); null (n/a) when bench's prompts carry no answers",
    "quality_metric": "which figure quality is: exact_match or agreement (null when there is none)",
    "exact_match": "share of answered prompts whose answer text equals the reference after stripping whitespace (over every timed pass)",
    "answered_prompts": "prompts of the set that carry a reference answer",
    "json_valid_rate": "--json-schema / --json: share of answers (every timed pass) that parse as JSON, the schema's name and sha256 in provenance.json_schema (null without one)",
    "spread": "{figure: [min, max]} over the timed passes (runs x seeds; each pass is every prompt once) of the timing figures and quality: how far one pass lands from another",
    "spread_passes": "timed passes the spread is taken over",
    "peak_flops_range": "[FLOP/s] [min, max] of the repeated CPU matmul peak measurement (peak_flops_per_s is their median); null for a datasheet peak",
    "peak_bytes_range": "[B/s] [min, max] of the repeated CPU bandwidth measurement (peak_bytes_per_s is their median); null for a datasheet peak",
    "agreement": "share of token positions equal to the reference setting's output (over the longer of the two)",
}

# The main figures of bench's short human output (dgcli.measure.brief), in order, each with a short meaning
# ({num_prompts} is filled in); every other figure is in --verbose and the machine formats.
SUMMARY: dict[str, str] = {
    "quality": "exact match with the prompt file's answers (n/a where it has none)",
    "output_throughput": "answer tokens / wall time, end to end (prefill included)",
    "diffusion_committed_throughput": "canvas tokens committed / denoising time",
    "diffusion_canvas_positions_per_s": "canvas positions evaluated / denoising time",
    "request_throughput": "requests / wall time",
    "mean_ttft_ms": "time to first block, from taking a slot",
    "median_ttft_ms": "its median (p50) over the requests",
    "p90_ttft_ms": "its 90th percentile",
    "p99_ttft_ms": "its 99th percentile",
    "mean_e2el_ms": "request latency, from taking a slot to its last block",
    "median_e2el_ms": "its median (p50) over the requests",
    "p90_e2el_ms": "its 90th percentile",
    "p99_e2el_ms": "its 99th percentile",
    "mean_queue_ms": ("queue wait: all {num_prompts} prompts of a run are submitted at once, so with fewer slots "
                      "than prompts each waits behind the earlier ones (a backlog, not a fault)"),
    "mean_vision_ms": "vision tower per request, timed apart (its prompt pass, mean_prefill_ms, includes it)",
    "image_tokens_per_prompt": "prompt tokens of the --image(s): their soft tokens",
    "mean_step_ms": "per decoder pass (one denoising step of every occupied slot)",
    "diffusion_committed_per_step": "canvas tokens committed per denoising step",
    "diffusion_steps_per_canvas": "mean denoising steps per block",
    "p90_steps_per_block": "90th percentile of denoising steps per block",
    "cap_hit_rate": "blocks that ran every step (max_denoising_steps)",
    "slot_occupancy": "share of the batch's slots that held a request",
    "peak_memory_bytes": "peak memory while measuring",
    "step_vs_floor": "mean_step_ms / the roofline floor (1x = at the floor)",
}

NOT_IN_CSV = ("runs_detail",)
# The sampler settings every row carries as columns, in order (a remote row: as sent).
SETTINGS = ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold", "confidence_threshold",
            "seed", "blocks")
IMAGE_FIGURES = ("mean_vision_ms", "images_encoded", "images_per_prompt", "image_tokens_per_prompt")  # --image rows only

# The timing figures whose spread over the timed passes every row carries (`spread`).
SPREAD_KEYS = ("output_throughput", "request_throughput", "diffusion_committed_throughput",
               "diffusion_canvas_positions_per_s", "mean_ttft_ms", "mean_e2el_ms", "mean_step_ms",
               "mean_block_latency_ms")


@dataclass
class Pass:
    """One timed pass: every prompt submitted at once to an engine of `batch_size` slots (responses in prompt
    order), its wall time, the engine's counts and per request the wait for a slot and the latencies from then."""

    responses: list[Response]
    wall_s: float
    batch_size: int
    decoder_passes: int
    row_steps: int
    denoise_s: float
    queue_s: list[float]  # submission (the pass's start) to the start of the request's prefill
    ttft_s: list[float]  # start of its prefill to its first block's commit
    e2el_s: list[float]  # start of its prefill to its Done
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (0: caching off)
    prefix_cache_hits: int = 0  # of them, tokens found
    vision_s: float = 0.0  # the vision tower's time on the pass's images
    images_encoded: int = 0  # images the tower ran on in the pass


def stat(values: list[float], how: Any, scale: float = 1e3) -> float | None:
    """The mean, "std" or percentile `how` (numpy's linear interpolation between closest ranks) of values x scale
    (s -> ms by default); None for no values."""
    if not values:
        return None
    if how == "mean":
        return statistics.fmean(values) * scale
    if how == "std":
        return (statistics.stdev(values) if len(values) > 1 else 0.0) * scale
    return float(np.percentile(values, how)) * scale


def latencies(name: str, values: list[float], kinds=("mean", 50, 90, 99)) -> dict:
    """mean_NAME_ms, median_NAME_ms, p90_NAME_ms ... of latencies in seconds."""
    label = {"mean": "mean", 50: "median", 90: "p90", 99: "p99", "std": "std"}
    return {f"{label[k]}_{name}_ms": stat(values, k) for k in kinds}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _cost(passes: list[Pass], cfg: ModelConfig, max_steps: int, weight_bytes: int) -> info.Cost:
    """FLOPs and bytes of the denoising steps: FLOPs and KV bytes per request row, weight bytes once per batched
    decoder pass (its rows' mean, with the experts that the mean rows x canvas tokens touch; at batch size 1
    exactly the per-request sum)."""
    rows = sum(p.row_steps for p in passes)
    batched = sum(p.decoder_passes for p in passes)
    wide = dataclasses.replace(cfg, canvas_length=cfg.canvas_length * rows / batched) if batched else cfg
    cost, weights, cache = info.Cost(), 0.0, {}
    for p in passes:
        for r in p.responses:
            for prefix, s in zip(r.block_prefix, r.done.steps_per_block):
                cost += info.block_cost(cfg, prefix, s, max_steps, weight_bytes=0, kv_bytes=weight_bytes)
                if s not in cache:
                    cache[s] = info.block_cost(wide, 0, s, max_steps, weight_bytes=weight_bytes, kv_bytes=0).bytes
                weights += cache[s]
    return cost + info.Cost(0.0, weights * batched / rows if rows else 0.0)


def summarize(passes: list[Pass], cfg: ModelConfig, max_steps: int, *, weight_bytes: int,
              peaks: info.Peaks | None, peak_memory: tuple[int, str] | None = None, spread: bool = True) -> dict:
    """Every figure of DEFINITIONS (quality aside) from the timed passes; with `spread`, the min and max of each
    SPREAD_KEYS figure over the passes (each summarised alone)."""
    reqs = [r for p in passes for r in p.responses]
    c = cfg.canvas_length
    d = [r.done for r in reqs]
    e2e = [t for p in passes for t in p.e2el_s]
    ttft = [t for p in passes for t in p.ttft_s]
    wall = sum(p.wall_s for p in passes)
    denoise_s = sum(p.denoise_s for p in passes)  # the batched decoder passes' own time, each pass once
    batched = sum(p.decoder_passes for p in passes)
    slots = sum(p.decoder_passes * p.batch_size for p in passes)
    request_denoise_s = sum(x.timings["denoise_s"] for x in d)  # per request: every pass it was in
    commit_s = sum(x.timings["commit_s"] for x in d)
    tokens = sum(len(r.token_ids) for r in reqs)
    blocks = sum(x.blocks for x in d)
    steps = [s for x in d for s in x.steps_per_block]
    row_steps = sum(steps)
    commits = sum(x.blocks - 1 for x in d)
    per_run = [sum(len(r.token_ids) for r in p.responses) / p.wall_s for p in passes]
    per_run_req = [len(p.responses) / p.wall_s for p in passes]
    capped = [s for s in steps if s >= max_steps]
    cost = _cost(passes, cfg, max_steps, weight_bytes)
    row: dict[str, Any] = {
        "batch_size": passes[0].batch_size,
        "completed": len(reqs),
        "duration": wall,
        "total_output_tokens": tokens,
        "output_throughput": stat(per_run, "mean", 1.0), "output_throughput_std": stat(per_run, "std", 1.0),
        "request_throughput": statistics.fmean(per_run_req),
        **latencies("ttft", ttft),
        **latencies("e2el", e2e, ("mean", 50, 90, 99, "std")),
        "mean_queue_ms": statistics.fmean(q for p in passes for q in p.queue_s) * 1e3,
        "mean_prefill_ms": statistics.fmean(x.timings["prefill_s"] for x in d) * 1e3,
        **({"mean_vision_ms": sum(p.vision_s for p in passes) / len(reqs) * 1e3,
            "images_encoded": sum(p.images_encoded for p in passes)} if any(p.images_encoded for p in passes) else {}),
        "diffusion_committed_tokens": blocks * c,
        "diffusion_committed_throughput": _ratio(blocks * c, denoise_s),
        "diffusion_canvas_positions": row_steps * c,
        "diffusion_canvas_positions_per_s": _ratio(row_steps * c, denoise_s),
        "diffusion_denoising_steps": row_steps,
        "batched_decoder_passes": batched,
        "slot_occupancy": _ratio(row_steps, slots),
        "diffusion_steps_per_canvas": row_steps / blocks,
        "diffusion_committed_per_step": blocks * c / row_steps,
        "tokens_per_forward": statistics.fmean(x.tokens_per_forward for x in d),
        "mean_step_ms": denoise_s / batched * 1e3,
        "mean_commit_ms": commit_s / commits * 1e3 if commits else None,
        "mean_block_latency_ms": (request_denoise_s + commit_s) / blocks * 1e3,
        "output_blocks_per_second": _ratio(blocks, wall),
        "mean_blocks_per_request": blocks / len(reqs),
        **steps_figures(steps, max_steps),
        "cap_hit_rate_first_block": sum(x.steps_per_block[0] >= max_steps for x in d) / len(d),
        "cap_steps_share": sum(capped) / row_steps,
        "finish_length_rate": sum(r.finish_reason == "length" for r in reqs) / len(reqs),
        "prefix_cache_hit_rate": _ratio(sum(p.prefix_cache_hits for p in passes),
                                        sum(p.prefix_cache_queries for p in passes)),
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
            "peak_flops_per_s": peaks.flops_per_s, "peak_compute": peaks.compute, "peak_bytes_per_s": peaks.bytes_per_s,
            "peaks_device": peaks.name, "peaks_source": peaks.source,
            "peak_flops_range": list(peaks.flops_range) if peaks.flops_range else None,
            "peak_bytes_range": list(peaks.bytes_range) if peaks.bytes_range else None,
            "flops_utilization": _ratio(row["achieved_flops_per_s"] or 0.0, peaks.flops_per_s),
            "bandwidth_utilization": _ratio(row["achieved_bytes_per_s"] or 0.0, peaks.bytes_per_s),
            "floor_step_ms": floor_s / batched * 1e3, "floor_bound": bound,
            "step_vs_floor": _ratio(denoise_s, floor_s),
        })
    if spread:
        each = [summarize([p], cfg, max_steps, weight_bytes=weight_bytes, peaks=None, spread=False) for p in passes]
        row["spread"] = {k: min_max([e[k] for e in each]) for k in SPREAD_KEYS}
        row["spread_passes"] = len(passes)
    row["runs_detail"] = [{"output_throughput": t, "requests": len(p.responses), "wall_s": p.wall_s,
                           "batched_decoder_passes": p.decoder_passes} for t, p in zip(per_run, passes)]
    return row


def steps_figures(steps: list[int], cap: int | None) -> dict:
    """The figures of the denoising steps per block: percentiles, {step count: blocks} ascending, and the share of
    blocks that ran every step of `cap` (None: the cap is not known)."""
    return {**{f"p{q}_steps_per_block": stat(steps, q, 1.0) for q in (50, 90, 99)},
            "steps_histogram": {str(s): n for s, n in sorted(Counter(steps).items())},
            "cap_hit_rate": (sum(s >= cap for s in steps) / len(steps) if steps else None) if cap else None}


def min_max(values: list[float | None]) -> list[float] | None:
    got = [v for v in values if v is not None]
    return [min(got), max(got)] if got else None
