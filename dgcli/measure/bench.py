"""Benchmark measurement: the workload (prompt file or random ids), the target (checkpoint or dummy
weights), the timed runs fed by the one sampler event stream, and the ONE record type every bench and
sweep row is: a flat dict whose keys reuse `vllm bench serve`'s names where one exists (PRODUCT.md) and
whose every figure has a definition in `DEFINITIONS`.

Owns: prompt loading and hashing, dummy-config building (`--dummy`, `--layers`), `measure` (warm-up,
repeats, peak memory), `summarize` (events -> figures, incl. the per-request FLOP/byte accounting against
the roofline floor). Must not: print, write files, contain a denoising loop (it consumes
`dgcli.sampling.loop.generate_events`), or format numbers (report.py does).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dgcli.model.config import ModelConfig, parse_config, read_json, real_config_path
from dgcli.errors import UserError
from dgcli.text.prompts import read_prompt_file
from dgcli.sampling.events import BlockStart, Done
from dgcli.measure import card as info
BUNDLED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"
RANDOM_PROMPT_WARNING = (
    "WARNING: prompts are random token ids. Early stopping does not fire on random text the way it does "
    "on real text (one vendor under-reported throughput 3x this way): treat these numbers as fixed-work "
    "measurements only, and use --prompts FILE for real workloads.")

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
    "quality": "exact_match when the prompts have reference answers, else agreement (see quality_metric)",
    "exact_match": "share of answered prompts whose answer text equals the reference after stripping whitespace",
    "agreement": "share of token positions equal to the reference setting's output (over the longer of the two)",
}

NOT_IN_CSV = ("runs_detail",)


# ---- the workload --------------------------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # None for random token ids
    answer: str | None = None
    family: str | None = None


def default_prompt_file() -> Path | None:
    """The bundled held-out prompt set (dgcli/data/prompts/*.jsonl), once it exists."""
    files = sorted(BUNDLED_PROMPTS.glob("*.jsonl")) if BUNDLED_PROMPTS.is_dir() else []
    return files[0] if files else None


def random_prompts(vocab: int, n: int, length: int, seed: int, avoid: set[int] = frozenset()) -> list[Prompt]:
    """n prompts of `length` uniform token ids (stop ids avoided), reproducible from `seed`."""
    import torch

    if n < 1 or length < 1:
        raise UserError("--num-prompts and --random-input-len must be >= 1")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(Prompt([i if i not in avoid else (i + 1) % vocab for i in ids]))
    return out


def prompt_set_hash(prompts: list[Prompt]) -> str:
    """sha256 of the token ids (the model sees ids, so two tokenizers of one file hash differently)."""
    h = hashlib.sha256(json.dumps([p.ids for p in prompts], separators=(",", ":")).encode())
    return h.hexdigest()[:16]


# ---- the target: a checkpoint, or dummy weights ----------------------------------------------------------


def dummy_config(spec: str, layers: int | None = None) -> tuple[dict, dict | None, str]:
    """(config.json dict, generation_config dict or None, name) for --dummy: a config.json path, a
    directory holding one, or the word 26B-A4B (the shipped config). `layers` keeps the first N layer
    types and forces the last to full attention, as the reference does."""
    if spec.strip().upper() in ("26B-A4B", "26B", "DIFFUSIONGEMMA-26B-A4B"):
        path = real_config_path()
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"--dummy {spec}: no such config.json; pass a config path or the word 26B-A4B")
    raw = read_json(path)
    parse_config(raw, source=str(path))  # validate before anything else
    gen_path = path.parent / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else None
    name = path.parent.name if path.name == "config.json" else path.stem
    if layers is not None:
        raw = shrink_layers(raw, layers)
        name += f" (first {layers} layers)"
    return raw, gen, name


def shrink_layers(raw: dict, n: int) -> dict:
    text = raw["text_config"]
    total = int(text["num_hidden_layers"])
    if not 1 <= n <= total:
        raise UserError(f"--layers {n}: the config has {total} layers; pick 1..{total}")
    types = list(text.get("layer_types") or [])
    types = types[:n] if types else None
    if types:
        types[-1] = "full_attention"
    return {**raw, "text_config": {**text, "num_hidden_layers": n, "layer_types": types}}


@dataclass
class Target:
    session: Any  # runtime.Session
    dummy: bool  # random weights from a config (fixed-work forced)
    name: str  # what rows call the model


def open_target(model: str | None, dummy: str | None, layers: int | None, preset: str | None,
                flags: dict, *, warn: Callable[[str], None], compile: bool = False) -> Target:
    """A checkpoint's session, or one over dummy weights built directly on the device (no file read;
    fixed-work mode forced: confidence_threshold 0)."""
    import torch

    from dgcli.model.random_weights import random_model
    from dgcli.model.loader import resolve_dtype
    from dgcli.runtime.session import Session, compile_decoder, fit_threads, open_session, pick_device
    from dgcli.runtime.settings import blocks_for, resolve, stop_ids_from_generation_config

    if dummy is None:
        if layers is not None:
            raise UserError("--layers shrinks a --dummy config; it does not apply to a checkpoint")
        session = open_session(model, preset, flags, need_tokenizer=False, compile=compile)
        return Target(session, False, session.path.name)
    if model is not None:
        raise UserError("give either --model (a checkpoint) or --dummy CONFIG (random weights), not both")
    raw, gen, name = dummy_config(dummy, layers)
    if flags.get("confidence_threshold") not in (None, 0, 0.0):
        warn(f"dgemma: note: --confidence-threshold {flags['confidence_threshold']} ignored: dummy weights run fixed-work (0)")
    flags = dict(flags, confidence_threshold=0.0)
    resolved = resolve(gen, preset, flags)
    device = pick_device(resolved.run.device)
    dt = resolved.run.dtype if resolved.run.dtype != "auto" else str(raw.get("dtype") or "bfloat16")
    dtype = resolve_dtype(dt if dt in ("bfloat16", "float32", "float16") else "bfloat16")
    preflight(parse_config(raw), torch.tensor([], dtype=dtype).element_size(), device, spec=dummy)
    m = random_model(raw, seed=resolved.params.seed, dtype=dtype, device=device)
    fit_threads(m, device)
    if compile:
        compile_decoder(m)
    cfg = m.config
    stop_ids = stop_ids_from_generation_config(gen) if gen else list(cfg.eos_token_ids)
    num_blocks = blocks_for(resolved.params, resolved.run.max_tokens, cfg.canvas_length)
    source = Path(dummy) if Path(dummy).exists() else real_config_path()
    name = name if name.lower().startswith("dummy") else f"dummy {name}"
    return Target(Session(source, cfg, m, None, resolved, device, stop_ids, num_blocks), True, name)


def preflight(cfg: ModelConfig, weight_bytes: int, device: Any, *, spec: str) -> None:
    """Refuse a dummy model that cannot fit, before allocating it (an OOM half-way is worse), and say
    how many layers would."""
    import torch

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            meminfo = Path("/proc/meminfo").read_text().splitlines()
            free = next(int(ln.split()[1]) * 1024 for ln in meminfo if ln.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return  # no way to know here: try
    counts = info.param_counts(cfg)
    need = counts["total"] * weight_bytes + info.working_set_bytes(cfg, 4096, weight_bytes)["total"]
    if need <= 0.9 * free:
        return
    per_layer = (counts["total"] - counts["embedding"]) / cfg.num_hidden_layers * weight_bytes
    fits = int((0.9 * free - counts["embedding"] * weight_bytes) // per_layer)
    hint = f"shrink it with --layers {fits}" if fits >= 1 else "it does not fit even with --layers 1"
    raise UserError(f"--dummy {spec} needs ~{need / 2**30:.1f} GiB on {device} but only {free / 2**30:.1f} GiB "
                    f"is free; {hint}")


def model_dtype(session: Any) -> str:
    return str(session.model.embed_weight.dtype).removeprefix("torch.")


def weight_bytes(session: Any) -> int:
    return info.DTYPE_BYTES[model_dtype(session)]


def build_prompts(session: Any, *, prompts_file: str | None, random_ids: bool, num_prompts: int | None,
                  input_len: int, seed: int, warn: Callable[[str], None]) -> tuple[list[Prompt], str]:
    """The workload and its description ('file:PATH' or 'random-token-ids'); warns loudly on random ids."""
    from dgcli.runtime.session import check_context, encode_prompt

    cfg = session.config
    path = None if random_ids else (prompts_file or session.resolved.run.prompt_set or
                                    (default_prompt_file() if session.tokenizer is not None else None))
    if path is not None:
        if session.tokenizer is None:
            raise UserError(f"--prompts {path}: the model has no tokenizer.json to encode text prompts; "
                            "use --random-prompts (dummy weights and tokenizer-less checkpoints)")
        rows = read_prompt_file(path)[: num_prompts or None]
        out = [Prompt(encode_prompt(session, r["prompt"]), r["prompt"], r.get("answer"), r.get("family")) for r in rows]
        return out, f"file:{path}"
    warn(RANDOM_PROMPT_WARNING)
    out = random_prompts(cfg.vocab_size, num_prompts or 4, input_len, seed, set(session.stop_ids))
    check_context(session, input_len)
    return out, "random-token-ids"


# ---- measuring -------------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt_len: int
    done: Done
    block_prefix: list[int] = field(default_factory=list)  # cache length when each block started


def run_request(session: Any, prompt: Prompt, params: Any, *, ignore_eos: bool) -> Request:
    """One prompt through the sampler's event stream (the only loop), keeping what the figures need."""
    from dgcli.sampling.loop import generate_events

    starts: list[int] = []
    done = None
    pad = session.tokenizer.pad_id if session.tokenizer is not None else session.config.pad_token_id
    for ev in generate_events(session.model, prompt.ids, params=params, num_blocks=session.num_blocks,
                              stop_ids=() if ignore_eos else session.stop_ids, pad_id=pad):
        if isinstance(ev, BlockStart):
            starts.append(ev.prefix_len)
        elif isinstance(ev, Done):
            done = ev
    return Request(len(prompt.ids), done, starts)


class PeakMemory:
    """CUDA: torch.cuda.max_memory_allocated since `start()`; CPU: growth of the process' ru_maxrss
    (high-water resident set) since the baseline taken before the model was built."""

    def __init__(self, device: Any, cpu_baseline: int | None = None):
        self.device = device
        self.baseline = cpu_baseline if cpu_baseline is not None else self.maxrss()

    @staticmethod
    def maxrss() -> int:
        import resource
        import sys

        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024  # Linux reports KiB

    def start(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> tuple[int, str]:
        if self.device.type == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated(self.device)), "cuda max_memory_allocated (weights + KV + activations)"
        return self.maxrss() - self.baseline, "cpu ru_maxrss growth since before the model was built (weights + working set)"


def measure(session: Any, prompts: list[Prompt], params: Any, *, runs: int, warmup: int, ignore_eos: bool,
            memory: PeakMemory | None = None, progress: Callable[[str], None] | None = None,
            out: list | None = None) -> list[list[Request]]:
    """`warmup` untimed requests (cycling the prompts), then `runs` passes over every prompt. Finished
    runs are appended to `out` as they complete, so a caller interrupted by Ctrl-C still has them."""
    if runs < 1 or warmup < 0:
        raise UserError("--runs must be >= 1 and --warmup >= 0")
    out = [] if out is None else out
    for i in range(warmup):
        if progress:
            progress(f"warm-up {i + 1}/{warmup} (untimed; the first run is cold)")
        run_request(session, prompts[i % len(prompts)], params, ignore_eos=ignore_eos)
    if memory is not None:
        memory.start()
    for r in range(runs):
        reqs = []
        for j, p in enumerate(prompts):
            if progress:
                progress(f"run {r + 1}/{runs}  prompt {j + 1}/{len(prompts)}")
            reqs.append(run_request(session, p, params, ignore_eos=ignore_eos))
        out.append(reqs)
    return out


# ---- figures -----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(runs: list[list[Request]], cfg: ModelConfig, max_steps: int, *, weight_bytes: int,
              peaks: info.Peaks | None, peak_memory: tuple[int, str] | None = None) -> dict:
    """Every figure of DEFINITIONS (quality aside) from the measured requests."""
    reqs = [r for run in runs for r in run]
    c = cfg.canvas_length
    d = [r.done for r in reqs]
    e2e = [x.timings["total_s"] for x in d]
    ttft = [x.timings["first_block_s"] for x in d]
    denoise_s = sum(x.timings["denoise_s"] for x in d)
    commit_s = sum(x.timings["commit_s"] for x in d)
    tokens = sum(len(x.token_ids) for x in d)
    blocks = sum(x.blocks for x in d)
    steps = [s for x in d for s in x.steps_per_block]
    passes = sum(steps)
    commits = sum(x.blocks - 1 for x in d)
    per_run = [sum(len(r.done.token_ids) for r in run) / sum(r.done.timings["total_s"] for r in run) for run in runs]
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
        "finish_length_rate": sum(x.finish_reason == "length" for x in d) / len(d),
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
            "flops_utilization": _ratio(row["achieved_flops_per_s"] or 0.0, peaks.flops_per_s),
            "bandwidth_utilization": _ratio(row["achieved_bytes_per_s"] or 0.0, peaks.bytes_per_s),
            "floor_step_ms": floor_s / passes * 1e3, "floor_bound": bound,
            "step_vs_floor": _ratio(denoise_s, floor_s),
        })
    row["runs_detail"] = [{"output_throughput": t, "requests": len(run)} for t, run in zip(per_run, runs)]
    return row


def device_peaks(device: Any, *, measure_cpu: bool = True) -> info.Peaks | None:
    """The roofline peaks of the run's device: measured on CPU, the table on H100/H200, else None."""
    if device.type == "cuda":
        import torch

        return info.gpu_peaks(torch.cuda.get_device_name(device))
    return info.measure_cpu_peaks() if measure_cpu else None


def workload_mode(params: Any, dummy: bool) -> str:
    if dummy:
        return "fixed-work (dummy random weights: never converge, confidence_threshold forced to 0)"
    return "fixed-work (confidence_threshold 0)" if params.confidence_threshold == 0 else "adaptive"


def settings_columns(params: Any, num_blocks: int) -> dict:
    return {"max_denoising_steps": params.max_denoising_steps, "t_min": params.t_min, "t_max": params.t_max,
            "entropy_bound": params.entropy_bound, "stability_threshold": params.stability_threshold,
            "confidence_threshold": params.confidence_threshold, "seed": params.seed, "blocks": num_blocks}



def make_row(target: Target, *, prompts: list[Prompt], prompt_source: str, params: Any, runs_done: int,
             runs_asked: int, warmup: int, ignore_eos: bool, summary: dict, label: str | None,
             metadata: dict, kind: str = "bench") -> dict:
    """The record: label, settings, workload, figures, provenance (in that order)."""
    from dgcli.measure.printers import provenance

    s = target.session
    counts = info.param_counts(s.config)
    settings = settings_columns(params, s.num_blocks)
    row = {"label": label, "kind": kind, **settings, "mode": workload_mode(params, target.dummy),
           "dummy_weights": target.dummy, "prompt_source": prompt_source, "num_prompts": len(prompts),
           "mean_input_len": statistics.fmean(len(p.ids) for p in prompts), "runs": runs_done,
           "warmups": warmup, "ignore_eos": ignore_eos}
    if prompt_source == "random-token-ids":
        row["workload_warning"] = RANDOM_PROMPT_WARNING
    if runs_done < runs_asked:
        row["interrupted"] = f"Ctrl-C after {runs_done} of {runs_asked} runs"
    row.update(summary)
    row["provenance"] = provenance(
        device=s.device, dtype=model_dtype(s), model=str(s.path), model_name=target.name,
        parameters=counts["total"], active=counts["active_per_token"], settings=settings, seed=params.seed,
        prompt_hash=prompt_set_hash(prompts), label=label, metadata=metadata, dummy=target.dummy,
        compiled=getattr(s.model, "compiled", False))
    return row


def peaks_for_card(local: info.Peaks | None) -> list[info.Peaks]:
    """The run's device first (measured CPU or tabled GPU), then the H100 and H200 table rows."""
    out = [local] if local is not None else []
    return out + [p for p in info.DEVICE_TABLE.values() if local is None or p.name != local.name]


def target_card(target: Target, *, prompt_len: int, context: int, peaks: list[info.Peaks]) -> dict:
    s = target.session
    inventory = None if target.dummy else info.safetensors_inventory(s.path)
    source = (f"dummy weights from {s.path} (random, built on {s.device}; nothing read but the config)"
              if target.dummy else f"checkpoint {s.path}")
    return info.card(s.config, name=target.name, source=source, dtype=model_dtype(s), context=context,
                     prompt_len=prompt_len, peaks=peaks, inventory=inventory)
