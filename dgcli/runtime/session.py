"""What every model-running command does first: resolve settings, pick device and dtype, and load the
model and its tokenizer — from a checkpoint, or as random weights from a config (`--dummy`).

Owns: `Session` and `open_session` / `open_dummy_session`, device/dtype choice (and the settings saying
which ran), the bundled-model default, thread count for small CPU models, `--compile`, and the memory
preflight of dummy models. Must not: run
the sampler, tokenise prompts (runtime/request.py does) or print.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dgcli.errors import UserError
from dgcli.model.config import ModelConfig, load_config, load_generation_config, parse_config
from dgcli.runtime.settings import Resolved, blocks_for, resolve, stop_ids_from_generation_config

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "tiny"


def default_model_path() -> Path:
    if not (BUNDLED / "config.json").exists():
        raise UserError(f"the bundled model is missing from {BUNDLED}; pass --model DIR")
    return BUNDLED


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is visible to torch here; use --device cpu")
    dev = torch.device(name)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here; pick cuda:0..")
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

    @property
    def params(self):
        return self.resolved.params

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer is not None else self.config.pad_token_id

    @property
    def dtype_name(self) -> str:
        return str(self.model.embed_weight.dtype).removeprefix("torch.")


# Below this size a CPU model runs on one thread (see `fit_threads`).
SMALL_MODEL_PARAMS = 50_000_000


def fit_threads(model: Any, device: torch.device) -> None:
    """Small models on CPU run on one thread: their ops are too small to split, and when other cores
    are busy, intra-op threads wait on each other (measured on this 2-core machine with one core busy:
    the bundled 3.7 M-parameter model took 8.6 ms per denoising step on 1 thread, 1375 ms on 2).
    An explicit OMP_NUM_THREADS is respected."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
            torch.set_num_threads(1)


def compile_decoder(model: Any) -> None:
    """torch.compile the decoder pass (the model half of a denoising step); the session's `compiled`
    flag also sends the CPU vocabulary pass's per-tile elementwise math through torch.compile (its GEMMs,
    running statistics and random draws stay eager). The first compile takes tens of seconds (a C++
    toolchain is needed on CPU) and inductor caches it between runs."""
    model.decode = torch.compile(model.decode)


def resolve_for(model: str | None, preset: str | None, flags: dict) -> tuple[Path, ModelConfig, dict | None, Resolved]:
    """Settings without loading weights (for --show-config and plans)."""
    path = Path(model) if model else default_model_path()
    cfg = load_config(path)
    gen = load_generation_config(path)
    return path, cfg, gen, resolve(gen, preset, flags)


def _session(path: Path, m: Any, tokenizer: Any, resolved: Resolved, gen: dict | None, device: torch.device, *,
             compile: bool, name: str, dummy: bool = False) -> Session:
    """The part both kinds of session share: threads, --compile, stop ids (generation_config.json, else the
    config's, else the tokenizer's), the block count, and the settings as they ran."""
    fit_threads(m, device)
    if compile:
        compile_decoder(m)
    cfg = m.config
    stop_ids = stop_ids_from_generation_config(gen) if gen else list(cfg.eos_token_ids)
    if tokenizer is not None and not stop_ids:
        stop_ids = list(tokenizer.stop_ids)
    num_blocks = blocks_for(resolved.params, resolved.run.max_tokens, cfg.canvas_length)
    return Session(path, cfg, m, tokenizer, ran_with(resolved, m), device, stop_ids, num_blocks, name=name,
                   dummy=dummy, compiled=compile)


def ran_with(resolved: Resolved, model: Any) -> Resolved:
    """The settings with run.device and run.dtype as the loaded model has them ("cpu", "cuda:0", "float32"),
    not as asked ("auto"): results and traces say what ran. `sources` still says where the request came from;
    `--show-config` (no model loaded) shows the request itself."""
    w = model.embed_weight
    run = dataclasses.replace(resolved.run, device=str(w.device), dtype=str(w.dtype).removeprefix("torch."))
    return dataclasses.replace(resolved, run=run)


def open_session(model: str | None, preset: str | None, flags: dict, *, need_tokenizer: bool = True,
                 compile: bool = False) -> Session:
    from dgcli.model.loader import load_model, resolve_dtype
    from dgcli.text.tokenizer import load_tokenizer

    path, cfg, gen, resolved = resolve_for(model, preset, flags)
    device = pick_device(resolved.run.device)
    dtype = resolve_dtype(resolved.run.dtype)  # auto: the checkpoint's own dtype
    tokenizer = None
    if need_tokenizer or (path / "tokenizer.json").exists():
        tokenizer = load_tokenizer(path)
    m = load_model(path, device=device, dtype=dtype)
    return _session(path, m, tokenizer, resolved, gen, device, compile=compile, name=path.name)


def open_dummy_session(spec: str, layers: int | None, preset: str | None, flags: dict, *,
                       warn: Callable[[str], None], compile: bool = False) -> Session:
    """Random weights for a config (`--dummy`), built directly on the device (nothing read but the config).
    Random weights never converge, so fixed-work mode is forced (confidence_threshold 0), and said."""
    from dgcli.model.config import real_config_path
    from dgcli.model.loader import resolve_dtype
    from dgcli.model.random_weights import dummy_config, random_model

    raw, gen, name = dummy_config(spec, layers)
    if flags.get("confidence_threshold") not in (None, 0, 0.0):
        warn(f"dgemma: note: --confidence-threshold {flags['confidence_threshold']} ignored: dummy weights run fixed-work (0)")
    resolved = resolve(gen, preset, dict(flags, confidence_threshold=0.0))
    device = pick_device(resolved.run.device)
    dt = resolved.run.dtype if resolved.run.dtype != "auto" else str(raw.get("dtype") or "bfloat16")
    dtype = resolve_dtype(dt if dt in ("bfloat16", "float32", "float16") else "bfloat16")
    preflight(parse_config(raw), torch.tensor([], dtype=dtype).element_size(), device, spec=spec)
    m = random_model(raw, seed=resolved.params.seed, dtype=dtype, device=device)
    source = Path(spec) if Path(spec).exists() else real_config_path()
    name = name if name.lower().startswith("dummy") else f"dummy {name}"
    return _session(source, m, None, resolved, gen, device, compile=compile, name=name, dummy=True)


def open_any(model: str | None, dummy: str | None, layers: int | None, preset: str | None, flags: dict, *,
             warn: Callable[[str], None], compile: bool = False) -> Session:
    """bench and sweep: a checkpoint (tokenizer optional) or `--dummy` weights, never both."""
    if dummy is None:
        if layers is not None:
            raise UserError("--layers shrinks a --dummy config; it does not apply to a checkpoint")
        return open_session(model, preset, flags, need_tokenizer=False, compile=compile)
    if model is not None:
        raise UserError("give either --model (a checkpoint) or --dummy CONFIG (random weights), not both")
    return open_dummy_session(dummy, layers, preset, flags, warn=warn, compile=compile)


def preflight(cfg: ModelConfig, weight_bytes: int, device: Any, *, spec: str) -> None:
    """Refuse a dummy model that cannot fit, before allocating it (an OOM half-way is worse), and say
    how many layers would."""
    from dgcli.measure import card

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            meminfo = Path("/proc/meminfo").read_text().splitlines()
            free = next(int(ln.split()[1]) * 1024 for ln in meminfo if ln.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return  # no way to know here: try
    counts = card.param_counts(cfg)
    need = counts["total"] * weight_bytes + card.working_set_bytes(cfg, 4096, weight_bytes)["total"]
    if need <= 0.9 * free:
        return
    per_layer = (counts["total"] - counts["embedding"]) / cfg.num_hidden_layers * weight_bytes
    fits = int((0.9 * free - counts["embedding"] * weight_bytes) // per_layer)
    hint = f"shrink it with --layers {fits}" if fits >= 1 else "it does not fit even with --layers 1"
    raise UserError(f"--dummy {spec} needs ~{need / 2**30:.1f} GiB on {device} but only {free / 2**30:.1f} GiB "
                    f"is free; {hint}")
