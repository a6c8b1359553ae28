"""Benchmark runs: warm-up and timed passes of requests through the request API (the one loop), peak memory, the
row record (label, settings, workload, figures, provenance), the card of the target and the device's peaks.

`--batch-size N`: every timed pass submits all prompts at once to an engine with N slots (continuous batching).
Throughput is aggregate; latencies are per request from when it takes a slot, as `vllm bench serve
--max-concurrency N` times a request from when it is sent (the wait before: `mean_queue_ms`). On CPU
`peak_memory_bytes` is the process' high-water mark, so a later row shows the largest so far. Must not: print,
write files, contain a denoising loop, define figures (metrics.py) or format numbers (printers.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from dgcli.errors import UserError
from dgcli.measure import cost as info
from dgcli.measure.metrics import SETTINGS, Pass
from dgcli.measure import peaks as pk
from dgcli.measure.workload import RANDOM_PROMPT_WARNING, Prompt, prompt_set_hash
from dgcli.runtime import request
from dgcli.runtime.request import Response
from dgcli.sampling.events import BlockStart, Commit, Done


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


def warm_up(session: Any, prompts: list[Prompt], params: Any, n: int, *, batch_size: int, ignore_eos: bool,
            progress: Callable[[str], None] | None = None, json_schema: dict | None = None) -> None:
    """`n` untimed requests (cycling the prompts) on the timed passes' path; with captured steps (CUDA graphs) at
    least every prompt once, so the timed passes replay graphs and capture none."""
    if n < 1:
        return
    if getattr(session, "step_mode", "dynamic") != "dynamic":  # captured steps: meet every shape a timed pass meets
        n = max(n, len(prompts))
    if progress:
        progress(f"warm-up: {n} request(s), batch size {batch_size} (untimed; the first run is cold)")
    chosen = [prompts[i % len(prompts)] for i in range(n)]
    for _ in request.run_batch(session, [p.ids for p in chosen], batch_size=batch_size, params=params,
                               ignore_eos=ignore_eos, images=_images(chosen), json_schemas=_schemas(json_schema, n)):
        pass


def _images(prompts: list[Prompt]) -> list | None:
    """run_batch's `images` for `prompts` (None for text-only prompts: the engine's text path)."""
    got = [getattr(p, "images", None) or [] for p in prompts]
    return got if any(got) else None


def _schemas(json_schema: dict | None, n: int) -> list | None:
    """run_batch's `json_schemas`: every prompt's answer under `json_schema` (None: free text)."""
    return None if json_schema is None else [json_schema] * n


def timed_pass(session: Any, prompts: list[Prompt], params: Any, *, batch_size: int, ignore_eos: bool,
               progress: Callable[[str], None] | None = None, advance: Callable[[], None] | None = None,
               json_schema: dict | None = None) -> Pass:
    """Every prompt submitted at once to the batched engine with `batch_size` slots, timed (a request took its slot
    at its first block's start less its prefill)."""
    stats: dict = {}
    began: dict[int, float] = {}
    first: dict[int, float] = {}
    ended: dict[int, float] = {}
    out: list[Response | None] = [None] * len(prompts)
    t0 = time.perf_counter()

    def seen(event: Any) -> None:
        if getattr(event, "block", None) == 0 and isinstance(event, (BlockStart, Commit)):
            (began if isinstance(event, BlockStart) else first)[event.row] = time.perf_counter()
        elif isinstance(event, Done):
            ended[event.row] = time.perf_counter()

    for n, (i, resp) in enumerate(request.run_batch(session, [p.ids for p in prompts], batch_size=batch_size,
                                                    params=params, ignore_eos=ignore_eos, stats=stats,
                                                    on_event=seen, images=_images(prompts),
                                                    json_schemas=_schemas(json_schema, len(prompts))), 1):
        out[i] = resp
        if progress:
            progress(f"{n}/{len(prompts)} requests done")
        if advance:
            advance()
    wall = time.perf_counter() - t0
    slot = [began[i] - r.done.timings["prefill_s"] for i, r in enumerate(out)]  # when each took its slot
    return Pass(out, wall, batch_size, stats["decoder_passes"], stats["row_steps"], stats["denoise_s"],
                queue_s=[max(0.0, t - t0) for t in slot], ttft_s=[first[i] - t for i, t in enumerate(slot)],
                e2el_s=[ended[i] - t for i, t in enumerate(slot)],
                prefix_cache_queries=stats.get("prefix_cache_queries", 0),
                prefix_cache_hits=stats.get("prefix_cache_hits", 0), vision_s=stats.get("vision_s", 0.0),
                images_encoded=stats.get("images_encoded", 0))


def measure(session: Any, prompts: list[Prompt], params: Any, *, runs: int, warmup: int, ignore_eos: bool,
            batch_size: int = 1, memory: PeakMemory | None = None, progress: Callable[[str], None] | None = None,
            out: list | None = None, advance: Callable[[], None] | None = None,
            json_schema: dict | None = None) -> list[Pass]:
    """`warmup` untimed requests, then `runs` timed passes appended to `out` as they finish (Ctrl-C keeps them);
    `progress` hears what runs, `advance` once per timed request done; `json_schema`: every answer drawn under it.
    The counts are the commands' (checked before the model: workload.check_counts)."""
    out = [] if out is None else out
    warm_up(session, prompts, params, warmup, batch_size=batch_size, ignore_eos=ignore_eos, progress=progress,
            json_schema=json_schema)
    if memory is not None:
        memory.start()
    for r in range(runs):
        tell = (lambda t, r=r: progress(f"batch size {batch_size}  run {r + 1}/{runs}: {t}")) if progress else None
        out.append(timed_pass(session, prompts, params, batch_size=batch_size, ignore_eos=ignore_eos, progress=tell,
                              advance=advance, json_schema=json_schema))
    return out


def device_peaks(device: Any, *, measure_cpu: bool = True, compute: str = "bfloat16") -> info.Peaks | None:
    """The roofline peaks of the run's device for `compute` matmuls: measured on CPU (bf16 for float8, which a CPU
    runs in bf16), the table on H100/H200, else None."""
    if device.type == "cuda":
        import torch

        return info.gpu_peaks(torch.cuda.get_device_name(device), compute)
    return info.measure_cpu_peaks(compute="bfloat16" if compute == "float8" else compute) if measure_cpu else None


def local_peaks(device: Any, compute: str, threads: int | None, *, measure_cpu: bool,
                pinned: str | None) -> info.Peaks | None:
    """The peaks of a local run: the CPU peaks saved in `--peaks FILE`, checked against this CPU at `threads` and
    matmul dtype, else `device_peaks`."""
    if pinned is None:
        return device_peaks(device, measure_cpu=measure_cpu, compute=compute)
    import torch

    if device.type == "cuda":
        raise UserError(f"--peaks {pinned}: pins a CPU's measured peaks; {torch.cuda.get_device_name(device)} uses its "
                        "datasheet's: drop --peaks")
    return pk.load_peaks(pinned, name=pk.cpu_label(threads or torch.get_num_threads()),
                         compute="bfloat16" if compute == "float8" else compute)


def session_peaks(s: Any, *, measure_cpu: bool, pinned: str | None) -> info.Peaks | None:
    """`local_peaks` at a session's device, matmul dtype and threads."""
    return local_peaks(s.device, compute_dtype(s), getattr(s, "threads", 0) or None, measure_cpu=measure_cpu,
                       pinned=pinned)


def load_note(s: Any) -> str | None:
    """`peaks.load_note` for a CPU session (its thread count); None on CUDA, whose timings other CPU work moves less."""
    if s.device.type == "cuda":
        return None
    import torch

    return pk.load_note(getattr(s, "threads", 0) or torch.get_num_threads())


def keep_peaks(save: str | None, peaks: info.Peaks | None) -> str | None:
    """`--save-peaks FILE`: write the measured peaks; returns the note to print (None without the flag)."""
    if save is None:
        return None
    if peaks is None or not peaks.flops_range:
        raise UserError(f"--save-peaks {save}: this device's peaks are a datasheet's, not measured: nothing to pin")
    from pathlib import Path

    from dgcli.measure.printers import write_atomic

    try:
        write_atomic(Path(save), pk.peaks_json(peaks))
    except OSError as e:
        raise UserError(f"--save-peaks {save}: cannot write ({e.strerror}); pick a writable path") from None
    return f"dgemma: peaks saved to {save}; pin them in later runs with --peaks {save}"


def compute_dtype(s: Any) -> str:
    """`matmul_dtype` of a session."""
    model = getattr(s, "model", None)
    fp8_dynamic = False
    if s.device.type == "cuda" and hasattr(model, "named_modules"):
        from dgcli.kernels.dispatch import fp8_semantics
        from dgcli.model.fp8 import is_fp8

        fp8_dynamic = is_fp8(model) and fp8_semantics() == "dynamic"
    return matmul_dtype(s.dtype_name, ggml_activations(s), fp8_dynamic)


def matmul_dtype(run_dtype: str, ggml: str | None = None, fp8_dynamic: bool = False) -> str:
    """The fastest matmul a run's kernels use, whose peak keeps the roofline floor a lower bound: int8 for GGML
    weights on the int8 path, float8 for dynamic FP8 on CUDA, float32 for an fp32 model, else bfloat16."""
    if ggml == "int8":
        return "int8"
    if fp8_dynamic:
        return "float8"
    return "float32" if run_dtype == "float32" else "bfloat16"


def workload_mode(params: Any, dummy: bool) -> str:
    if dummy:
        return "fixed-work (dummy random weights: never converge, confidence_threshold forced to 0)"
    return "fixed-work (confidence_threshold 0)" if params.confidence_threshold == 0 else "adaptive"


def make_row(s: Any, *, prompts: list[Prompt], prompt_source: str, params: Any, runs_done: int,
             runs_asked: int, warmup: int, ignore_eos: bool, summary: dict, label: str | None,
             metadata: dict, kind: str = "bench", images: list | None = None, schema: dict | None = None) -> dict:
    """The record: label, settings, workload, figures, provenance (in that order). `images`: `bench --image`'s
    (text/images.py's Image, with the names given), in every prompt; `schema`: the answers' (`--json-schema`:
    {"name", "sha256"} of the schema)."""
    import platform

    import torch

    from dgcli import __version__
    from dgcli.measure.printers import device_name, git_commit, kernel_choices, package_version

    counts = info.param_counts(s.config)
    settings = {**{k: getattr(params, k) for k in SETTINGS if k != "blocks"}, "blocks": s.num_blocks}
    row = {"label": label, "kind": kind, **settings, "batch_size": summary.get("batch_size", 1),
           "mode": workload_mode(params, s.dummy),
           "dummy_weights": s.dummy, "prompt_source": prompt_source, "num_prompts": len(prompts),
           "mean_input_len": statistics.fmean(len(p.ids) for p in prompts), "runs": runs_done,
           "warmups": warmup, "ignore_eos": ignore_eos}
    if images:
        row.update(images_per_prompt=len(images), image_tokens_per_prompt=sum(x.soft_tokens for x, _ in images))
    if prompt_source == "random-token-ids":
        row["workload_warning"] = RANDOM_PROMPT_WARNING
    if runs_done < runs_asked:
        row["interrupted"] = f"Ctrl-C after {runs_done} of {runs_asked} runs"
    row.update(summary)
    row["provenance"] = {  # what ran; `torch_threads`: the session's (a Ray worker's, not this driver's)
        "device": str(s.device), "device_name": device_name(s.device), "dtype": s.dtype_name,
        "torch": torch.__version__, "triton": package_version("triton"), "cuda": torch.version.cuda,
        "torch_threads": getattr(s, "threads", 0) or torch.get_num_threads(),
        "threads_source": getattr(s, "threads_source", None), "dgemma": __version__, "git_commit": git_commit(),
        "model": str(s.path), "model_name": s.name, "model_parameters": counts["total"],
        "model_active_parameters": counts["active_per_token"], "dummy_weights": s.dummy, "settings": settings,
        "seed": params.seed, "prompt_set_hash": prompt_set_hash(prompts), "label": label, "metadata": metadata,
        "kernels": kernel_choices(s.device, getattr(s, "packed_weights", 0), ggml_activations(s), s.dtype_name),
        "compiled_decoder": s.compiled, "step_mode": getattr(s, "step_mode", "dynamic"),
        "prefix_caching": getattr(s, "prefix_caching", True),
        "host": platform.node(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if schema:
        row["provenance"]["json_schema"] = schema
    if images:  # what the tower saw: each image's file, soft tokens and pixels' hash
        row["provenance"]["images"] = [{"file": name, "soft_tokens": x.soft_tokens, "sha256": x.digest}
                                       for x, name in images]
    return row


def ggml_activations(s: Any) -> str | None:
    """The GGML weights' activation path of a local session (dgcli/model/ggml.py), "nvfp4" for NVFP4 weights; None
    without either or a local model (a --ray or --base-url row)."""
    model = getattr(s, "model", None)
    if model is None:
        return None
    import torch

    from dgcli.model.ggml import activation_path
    from dgcli.model.nvfp4 import is_nvfp4

    return "nvfp4" if isinstance(model, torch.nn.Module) and is_nvfp4(model) else activation_path(model)


def weight_bytes(s: Any) -> int:
    return info.DTYPE_BYTES[s.dtype_name]


def card_peaks(s: Any, local: info.Peaks | None) -> list[info.Peaks]:
    """`peaks_for_card` for session s: at the local peak's matmul dtype, else (no local peak) at s's own."""
    return peaks_for_card(local, None if local is not None else compute_dtype(s))


def peaks_for_card(local: info.Peaks | None, compute: str | None = None) -> list[info.Peaks]:
    """The run's device first (measured CPU or tabled GPU), then the H100 and H200 table rows at the same matmul
    dtype (`compute`, else the local peak's; bf16 without either)."""
    compute = compute or (local.compute if local is not None else "bfloat16")
    out = [local] if local is not None else []
    table = [p for p in info.DEVICE_TABLE.values() if local is None or p.name != local.name]
    return out + [pk.table_peaks(p, compute) for p in table]


def target_card(s: Any, *, prompt_len: int, context: int, peaks: list[info.Peaks]) -> dict:
    from dgcli.model import ggml

    gguf = not s.dummy and s.path.is_file()
    inventory = None if s.dummy or gguf else info.safetensors_inventory(s.path)
    source = (f"dummy weights from {s.path} (random, built on {s.device}; nothing read but the config)"
              if s.dummy else f"{'GGUF file' if gguf else 'checkpoint'} {s.path}")
    threads = (s.threads, s.threads_source) if getattr(s, "threads", 0) else None
    # GGML weights (a GGUF file, --weights q4_k): the bytes the model holds, not the config's at the run dtype
    model = s.model if hasattr(s.model, "named_modules") else None  # a --ray driver's stand-in holds no weights
    held = held_bytes(model) if model is not None and (gguf or ggml.quantized_names(model)) else None
    return info.card(s.config, name=s.name, source=source, dtype=s.dtype_name, context=context,
                     prompt_len=prompt_len, peaks=peaks, inventory=inventory, threads=threads, held=held)


def held_bytes(model: Any) -> dict[str, int]:
    """Bytes of a loaded model's own tensors by dtype (a tensor shared by two names counted once)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
