"""What every model-running command does first: resolve settings, pick device and dtype, and load the model and
its tokenizer, from a checkpoint or as random weights from a config (`--dummy`).

Owns: `Session` and its openers, device/dtype choice, the one thread rule (`thread_rule`), `--compile`,
`--cuda-graphs`, `--low-memory`, the session's kept engine, the memory checks before the weights (`fits`, dummy
models). Torch-free checks are runtime/preflight.py's. Must not: run the sampler, tokenise prompts or print
(but the low-memory note).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dgcli.checkpoint.config import parse_config
from dgcli.errors import UserError
from dgcli.model.config import ModelConfig
from dgcli.runtime.preflight import (BUNDLED, check_low_memory, check_target, check_threads,  # noqa: F401
                                     default_model_path, resolve_for, settings_source, thread_limit)
from dgcli.runtime.settings import Resolved, blocks_for, resolve, stop_ids_from_generation_config


def pick_device(name: str, flag: str = "--device ") -> torch.device:
    """`name` (auto | cpu | cuda[:N]) as a device here; `flag`: how errors name the setting."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"{flag}{name}: no CUDA device is visible to torch here; use {flag}cpu")
    dev = torch.device(name)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"{flag}{name}: only {torch.cuda.device_count()} CUDA device(s) here; pick cuda:0..")
    return dev


@dataclass
class Session:
    path: Path  # the checkpoint (or, for dummy weights, the config it was built from)
    config: ModelConfig
    model: Any
    tokenizer: Any  # ChatTokenizer, or None (dummy weights, a checkpoint without tokenizer.json)
    resolved: Resolved  # run.device/dtype: what ran (`ran_with`), not the request ("auto")
    device: torch.device
    stop_ids: list[int]
    num_blocks: int
    name: str = ""  # what rows and cards call the model
    dummy: bool = False  # random weights (fixed work forced)
    compiled: bool = False  # --compile: decoder and vocabulary tiles through torch.compile
    step_mode: str = "dynamic"  # the engine's step: "graphs" with --cuda-graphs (dgcli.engine.new_engine)
    prefix_caching: bool = True  # batched engines share cached prompt blocks (--no-prefix-caching: off)
    packed_weights: int = 0  # weight matrices prepacked (eager CPU: bf16 for oneDNN, fp32 for the C GEMM; model.packed)
    threads: int = 0  # torch intra-op threads the run uses (`thread_rule`)
    threads_source: str = ""  # why: the --threads flag, OMP_NUM_THREADS, or the rule
    # The session's engine (dgcli.engine.KeptEngine), kept with its KV cache and CUDA graphs between calls
    engines: Any = field(default_factory=lambda: _kept_engine(), repr=False, compare=False)

    @property
    def params(self):
        return self.resolved.params

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer is not None else self.config.pad_token_id

    @property
    def dtype_name(self) -> str:
        return str(self.model.embed_weight.dtype).removeprefix("torch.")


def _kept_engine() -> Any:
    from dgcli.engine import KeptEngine

    return KeptEngine()


# Below this size a CPU model runs on one thread (see `thread_rule`).
SMALL_MODEL_PARAMS = 50_000_000
TORCH_DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice at start-up (the cores), before dgemma's


def thread_rule(parameters: int, device_type: str, flag: int | None = None) -> tuple[int, str]:
    """(threads, source), the rule every command follows: `--threads N`, else OMP_NUM_THREADS, else one thread for
    a CPU model under 50 M parameters and torch's default (one per core) otherwise. A small model's ops are too
    small to split: a second thread gains nothing idle, and when another process holds a core the threads wait on
    each other at every op (the bundled model on 2 cores, one busy: 14-20 ms a step on 1 thread, 19-70 on 2)."""
    if flag is not None:
        if flag < 1:
            raise UserError(f"--threads {flag}: must be >= 1 (leave it out for the rule: 1 thread for a small CPU model, else one per core)")
        check_threads(flag)
        return flag, f"flag: --threads {flag}"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:  # capped (the CLI says so at start): a shell's setting, not this command's
        n = min(int(env), thread_limit())
        return n, f"env: OMP_NUM_THREADS={env}" + (f", capped at {n}" if n < int(env) else "")
    if device_type == "cpu" and parameters < SMALL_MODEL_PARAMS:
        return 1, f"rule: a CPU model under {SMALL_MODEL_PARAMS // 1_000_000} M parameters runs on 1 thread"
    return TORCH_DEFAULT_THREADS, f"rule: torch's default, one per core ({TORCH_DEFAULT_THREADS})"


def set_threads(cfg: ModelConfig, device: torch.device, flag: int | None) -> tuple[int, str]:
    """Apply `thread_rule` for a model of `cfg` on `device` (before loading: loading uses threads too)."""
    from dgcli.measure.cost import param_counts

    n, source = thread_rule(param_counts(cfg)["total"], device.type, flag)
    torch.set_num_threads(n)
    return n, source


def compile_decoder(model: Any) -> None:
    """torch.compile each layer's row-wise work (q/k/v projections, the feed-forward), shapes dynamic; attention
    stays eager (it walks its segments on the host). The session's `compiled` flag also compiles the CPU vocabulary
    pass's per-tile math."""
    for layer in model.layers:
        layer.feed_forward = torch.compile(layer.feed_forward, dynamic=True)
        layer.self_attn.project = torch.compile(layer.self_attn.project, dynamic=True)


def check_cuda_graphs(cuda_graphs: bool | None, device: torch.device, compile: bool = False) -> str:
    """The step mode, "graphs" (CUDA graphs of decode-only passes) or "dynamic". None: graphs where they run (CUDA
    with Triton, no --compile); True: graphs, or one line where they cannot run; False: dynamic."""
    from dgcli.model.attention import backend

    if cuda_graphs is None:
        return "graphs" if not compile and backend(device) == "triton-paged" else "dynamic"
    if not cuda_graphs:
        return "dynamic"
    if compile:
        raise UserError("--cuda-graphs captures the eager step; --compile does not apply to it: drop one of them")
    if device.type != "cuda":
        raise UserError(f"--cuda-graphs needs a CUDA device (this run is on {device.type}): "
                        "drop --cuda-graphs or pass --device cuda")
    if backend(device) != "triton-paged":
        raise UserError("--cuda-graphs needs Triton (the paged attention kernel takes the block tables as graph "
                        "inputs): pip install triton, or drop --cuda-graphs")
    return "graphs"


def _session(path: Path, m: Any, tokenizer: Any, resolved: Resolved, gen: dict | None, device: torch.device, *,
             compile: bool, name: str, threads: tuple[int, str], dummy: bool = False,
             cuda_graphs: bool | None = False) -> Session:
    """What both kinds of session share: --compile, --cuda-graphs, packed CPU weights, stop ids
    (generation_config.json, else the config's, else the tokenizer's), the block count, the settings as they ran."""
    from dgcli.model.fuse import fuse_projections
    from dgcli.model.packed import pack_for_cpu

    step_mode = check_cuda_graphs(cuda_graphs, m.embed_weight.device, compile)
    if compile:
        compile_decoder(m)
    # An eager session's CPU weights prepacked: bf16 for oneDNN (same bits; short GEMMs such as a ragged expert's
    # run up to 1.5x faster), fp32 for the C GEMM (dgcli/model/packed.py). Not under --compile: inductor traces
    # plain weights.
    packed = 0 if compile else pack_for_cpu(m)
    fuse_projections(m)  # CUDA: q/k/v and gate/up as one GEMM each (model/fuse.py)
    cfg = m.config
    stop_ids = stop_ids_from_generation_config(gen) if gen else list(cfg.eos_token_ids)
    if tokenizer is not None and not stop_ids:
        stop_ids = list(tokenizer.stop_ids)
    num_blocks = blocks_for(resolved.params, resolved.run.max_tokens, cfg.canvas_length)
    return Session(path, cfg, m, tokenizer, ran_with(resolved, m), device, stop_ids, num_blocks, name=name,
                   dummy=dummy, compiled=compile, step_mode=step_mode, packed_weights=packed, threads=threads[0],
                   threads_source=threads[1])


def ran_with(resolved: Resolved, model: Any) -> Resolved:
    """The settings with run.device and run.dtype as the loaded model has them, not as asked ("auto")."""
    w = model.embed_weight
    run = dataclasses.replace(resolved.run, device=str(w.device), dtype=str(w.dtype).removeprefix("torch."))
    return dataclasses.replace(resolved, run=run)


Check = Callable[[ModelConfig, Resolved, torch.device], None]  # a check of the run before anything heavy loads


def open_session(model: str | None, preset: str | None, flags: dict, *, need_tokenizer: bool = True,
                 compile: bool = False, threads: int | None = None, cuda_graphs: bool | None = None,
                 chat: bool = False, check: Check | None = None, low_memory: bool | None = None) -> Session:
    """A checkpoint (directory or GGUF file) with its tokenizer and resolved settings. Before the weights: `chat`
    refuses a checkpoint without a usable chat template, `check` (e.g. `fits`) sees the config."""
    from dgcli.checkpoint.directory import resolve_dtype
    from dgcli.checkpoint.load import load_model, load_tokenizer

    path, cfg, gen, resolved = resolve_for(model, preset, flags)
    device = pick_device(resolved.run.device)
    check_cuda_graphs(cuda_graphs, device, compile)  # before anything heavy is loaded
    if check is not None:
        check(cfg, resolved, device)
    dtype = resolve_dtype(resolved.run.dtype)  # auto: the checkpoint's own dtype
    if device.type == "cpu" and low_memory is not False:
        check_low_memory(path, cfg, resolved)  # before the load
    n_threads = set_threads(cfg, device, threads)
    tokenizer = load_tokenizer(path, need_tokenizer)
    if chat and tokenizer is not None:
        tokenizer.check_template()  # from the files' text alone (a GGUF's metadata), not after the weights
    m = load_model(path, device=device, dtype=dtype)
    s = _session(path, m, tokenizer, resolved, gen, device, compile=compile, name=path.name, threads=n_threads,
                 cuda_graphs=cuda_graphs)
    if device.type == "cpu" and not compile:
        low_memory_mode(m, resolved, low_memory)
    return s


def low_memory_mode(m: Any, resolved: Resolved, force: bool | None) -> tuple[int, int] | None:
    """The low-memory mode (checkpoint/mapped.py's `stream_layers`) over weights used from a file's map (GGUF):
    forced or refused by `force`, else on where they do not fit beside one request's working set. The layers that
    fit stay resident, the rest are read from disk each step (a note on stderr). (layers streamed, layers) where on."""
    import sys

    from dgcli.checkpoint.mapped import mapped_spans, stream_layers
    from dgcli.runtime.preflight import _beyond_weights, available_ram, memory_cap

    if force is False:
        return None
    layers = list(m.layers)
    weights = sum(n for spans in mapped_spans(layers) for _, n, _, _ in spans)
    others = sum(n for _, n, _, _ in mapped_spans([m])[0]) - weights  # the embedding: read every step, stays
    free = available_ram()
    if not weights or (force is None and (free is None or free >= 2 * weights)):  # the common case: cheap
        return None
    cfg = m.config
    ab = m.embed_weight.element_size()
    work = _beyond_weights(cfg, 1, cfg.canvas_length * blocks_for(resolved.params, resolved.run.max_tokens,
                                                                   cfg.canvas_length),
                           ab, True, resolved.params.stability_threshold)
    room = max(0, int(0.9 * (free or 0)) - work - others - (1 << 29)) if force is None or memory_cap() else 0
    if force is None and weights <= room:
        return None
    keep = stream_layers(layers, lambda layer: layer.input_layernorm, room)
    gib = 2**30
    print(f"dgemma: note: low-memory mode: {len(layers) - keep} of {len(layers)} layers read from disk each step "
          f"({weights / gib:.1f} GiB of weights used from the file, {room / gib:.1f} GiB left for them)",
          file=sys.stderr)
    return len(layers) - keep, len(layers)


def open_dummy_session(spec: str, layers: int | None, preset: str | None, flags: dict, *,
                       warn: Callable[[str], None], compile: bool = False, threads: int | None = None,
                       weights: str = "bf16", cuda_graphs: bool | None = False, check: Check | None = None) -> Session:
    """Random weights for a config (`--dummy`), built on the device; fixed work is forced (they never converge).
    `weights`: "bf16", "fp8"/"nvfp4" (as such a checkpoint has them), or GGML blocks ("q4_k", "q8_0")."""
    from dgcli.checkpoint.config import real_config_path
    from dgcli.checkpoint.directory import resolve_dtype
    from dgcli.checkpoint.random_weights import GGML_WEIGHTS, dummy_config, ggml_dummy_bytes, random_ggml_model, random_model, with_fp8

    raw, gen, name = dummy_config(spec, layers)
    if weights in ("fp8", "nvfp4"):
        raw, name = with_fp8(raw, nvfp4=weights == "nvfp4"), f"{name} {weights.upper()}"
    if flags.get("confidence_threshold") not in (None, 0, 0.0):
        warn(f"dgemma: note: --confidence-threshold {flags['confidence_threshold']} ignored: dummy weights run fixed-work (0)")
    resolved = resolve(gen, preset, dict(flags, confidence_threshold=0.0))
    device = pick_device(resolved.run.device)
    check_cuda_graphs(cuda_graphs, device, compile)  # before the weights are drawn
    cfg = parse_config(raw)
    if check is not None:
        check(cfg, resolved, device)
    dt = resolved.run.dtype if resolved.run.dtype != "auto" else str(raw.get("dtype") or "bfloat16")
    dtype = resolve_dtype(dt if dt in ("bfloat16", "float32", "float16") else "bfloat16")
    n_threads = set_threads(cfg, device, threads)
    quantized = weights in GGML_WEIGHTS
    preflight(cfg, torch.tensor([], dtype=dtype).element_size(), device, spec=spec,  # (bf16-sized: FP8 needs less)
              total_bytes=ggml_dummy_bytes(raw, weights, dtype) if quantized else None)
    if quantized:
        m = random_ggml_model(raw, weights, seed=resolved.params.seed, dtype=dtype, device=device)
        name = f"{name} {weights.upper()}"
    else:
        m = random_model(raw, seed=resolved.params.seed, dtype=dtype, device=device)
    source = Path(spec) if Path(spec).exists() else real_config_path()
    name = name if name.lower().startswith("dummy") else f"dummy {name}"
    return _session(source, m, None, resolved, gen, device, compile=compile, name=name, threads=n_threads, dummy=True,
                    cuda_graphs=cuda_graphs)


def open_any(model: str | None, dummy: str | None, layers: int | None, preset: str | None, flags: dict, *,
             warn: Callable[[str], None], compile: bool = False, threads: int | None = None,
             weights: str = "bf16", cuda_graphs: bool | None = False, check: Check | None = None,
             low_memory: bool | None = None) -> Session:
    """bench and sweep: a checkpoint (tokenizer optional) or `--dummy` weights, never both."""
    check_target(model, dummy, layers)
    if dummy is None:
        return open_session(model, preset, flags, need_tokenizer=False, compile=compile, threads=threads,
                            cuda_graphs=cuda_graphs, check=check, low_memory=low_memory)
    return open_dummy_session(dummy, layers, preset, flags, warn=warn, compile=compile, threads=threads, weights=weights,
                              cuda_graphs=cuda_graphs, check=check)


def fits(slots: int | Callable[[Resolved], int], flag: str, *, context: int | None = None,
         context_flag: str | None = None, idle_slots: bool = False) -> Check:
    """A `check` refusing `slots` slots (or those the settings give) that cannot fit the device (`check_memory`), of
    `context` cached positions, else the least a request of the run's blocks caches."""
    from dgcli.runtime.preflight import available_ram, check_memory

    def check(cfg: ModelConfig, resolved: Resolved, device: torch.device) -> None:
        n = slots(resolved) if callable(slots) else slots
        blocks = blocks_for(resolved.params, resolved.run.max_tokens, cfg.canvas_length)
        ctx = context if context is not None else 1 + (blocks - 1) * cfg.canvas_length
        cpu = device.type != "cuda"
        free = available_ram() if cpu else torch.cuda.mem_get_info(device)[0]
        check_memory(cfg, resolved, slots=n, context=ctx, free=free, cpu=cpu, flag=flag, context_flag=context_flag,
                     idle_slots=idle_slots)

    return check


def preflight(cfg: ModelConfig, weight_bytes: int, device: Any, *, spec: str, total_bytes: int | None = None) -> None:
    """Refuse a dummy model that cannot fit before allocating it, saying how many layers would. `total_bytes`: the
    weights' bytes when not params x weight_bytes (GGML blocks)."""
    from dgcli.measure import cost

    free = free_bytes(device)
    if free is None:
        return  # no way to know here: try
    counts = cost.param_counts(cfg)
    weights = counts["total"] * weight_bytes if total_bytes is None else total_bytes
    path = "cuda" if torch.device(device).type == "cuda" else "cpu"  # + one request of 4,096 tokens' passes
    need = weights + cost.one_request(cfg, 4096, ab=4 if weight_bytes == 4 else 2)[path]
    if need <= 0.9 * free:
        return
    per_layer = (weights - counts["embedding"] * weight_bytes) / cfg.num_hidden_layers
    fits = int((0.9 * free - counts["embedding"] * weight_bytes) // per_layer)
    hint = f"shrink it with --layers {fits}" if fits >= 1 else "it does not fit even with --layers 1"
    raise UserError(f"--dummy {spec} needs ~{need / 2**30:.1f} GiB on {device} but only {free / 2**30:.1f} GiB "
                    f"is free; {hint}")


def free_bytes(device: Any) -> int | None:
    """Memory free for new tensors on `device` (CUDA: the driver's count; CPU: MemAvailable), None if unknown."""
    from dgcli.runtime.preflight import meminfo

    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else meminfo().get("MemAvailable")
