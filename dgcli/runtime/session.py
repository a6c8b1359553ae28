"""What every model-running command does first: resolve settings, pick device and dtype, load the
model and its tokenizer, and tokenise prompts within the context limit.

Owns: `Session` and `open_session`, device/dtype choice, the bundled-model default, prompt encoding
checks. Must not: run the sampler or print (commands and renderers do that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dgcli.model.config import ModelConfig, load_config, load_generation_config
from dgcli.errors import UserError
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
    path: Path
    config: ModelConfig
    model: Any
    tokenizer: Any  # ChatTokenizer, or None for a checkpoint without tokenizer.json
    resolved: Resolved
    device: torch.device
    stop_ids: list[int]
    num_blocks: int

    @property
    def params(self):
        return self.resolved.params


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
    """torch.compile the decoder pass (the model half of a denoising step) and, through
    `model.compiled`, the CPU vocabulary pass's per-tile elementwise math (its GEMMs, running statistics
    and random draws stay eager). The first compile takes tens of seconds (a C++ toolchain is needed on
    CPU) and inductor caches it between runs."""
    model.decode = torch.compile(model.decode)
    model.compiled = True  # recorded in benchmark provenance


def resolve_for(model: str | None, preset: str | None, flags: dict) -> tuple[Path, ModelConfig, dict | None, Resolved]:
    """Settings without loading weights (for --show-config and plans)."""
    path = Path(model) if model else default_model_path()
    cfg = load_config(path)
    gen = load_generation_config(path)
    return path, cfg, gen, resolve(gen, preset, flags)


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
    stop_ids = stop_ids_from_generation_config(gen) if gen else list(cfg.eos_token_ids)
    if tokenizer is not None and not stop_ids:
        stop_ids = list(tokenizer.stop_ids)
    max_tokens = resolved.run.max_tokens
    num_blocks = blocks_for(resolved.params, max_tokens, cfg.canvas_length)
    m = load_model(path, device=device, dtype=dtype)
    fit_threads(m, device)
    if compile:
        compile_decoder(m)
    return Session(path, cfg, m, tokenizer, resolved, device, stop_ids, num_blocks)


def encode_prompt(session: Session, text: str, *, raw: bool = False, thinking: bool = False) -> list[int]:
    if not text.strip():
        raise UserError("the prompt is empty; pass text as an argument or on stdin")
    ids = session.tokenizer.encode_prompt(text, raw=raw, thinking=thinking)
    check_context(session, len(ids))
    return ids


def check_context(session: Session, prompt_len: int) -> None:
    cfg = session.config
    need = prompt_len + session.num_blocks * cfg.canvas_length
    if need > cfg.max_position_embeddings:
        raise UserError(f"the prompt ({prompt_len} tokens) plus {session.num_blocks} block(s) of {cfg.canvas_length} "
                        f"exceed the model's context of {cfg.max_position_embeddings}; shorten the prompt or lower --blocks")
