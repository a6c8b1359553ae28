"""Checks before the load: what a run can be refused for from its flags, its config and its files' headers,
answered before torch is imported and before a weight is read (a refusal after a 15 GB load costs minutes).

Owns: the settings a run will use from the config files alone (`settings_source`, `resolve_for`), the thread bound
(`thread_limit`), the memory preflight (`check_memory`: slots and context, weights aside; `check_low_memory`: a
GGUF model's floor), and the character bound of a prompt (`check_prompt_chars`). Must not: import torch, read
tensors or print.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dgcli.checkpoint.config import parse_config
from dgcli.checkpoint.load import load_config, load_generation_config
from dgcli.engine import over_context
from dgcli.errors import UserError
from dgcli.model.config import ModelConfig
from dgcli.runtime.settings import Resolved, blocks_for, resolve

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "tiny"
# More torch threads than this many per core only slow a run (they wait on each other at every op); far more (1e5)
# crash torch's OpenMP pool. The flag is refused beyond it; OMP_NUM_THREADS, often set for a whole shell, is capped.
THREADS_PER_CORE = 4


def default_model_path() -> Path:
    if not (BUNDLED / "config.json").exists():
        raise UserError(f"the bundled model is missing from {BUNDLED}; pass --model DIR")
    return BUNDLED


def check_target(model: str | None, dummy: str | None, layers: int | None) -> None:
    """A checkpoint or `--dummy` weights, never both; --layers only with --dummy."""
    if dummy is not None and model is not None:
        raise UserError("give either --model (a checkpoint) or --dummy CONFIG (random weights), not both")
    if dummy is None and layers is not None:
        raise UserError("--layers shrinks a --dummy config; it does not apply to a checkpoint")


def settings_source(model: str | None, dummy: str | None = None,
                    layers: int | None = None) -> tuple[Path | str, ModelConfig, dict | None, dict]:
    """Without loading weights: the checkpoint's path (or a `--dummy` config's name), its config, its generation
    config and the flags a run of it forces (dummy weights: fixed work)."""
    check_target(model, dummy, layers)
    if dummy is not None:
        from dgcli.checkpoint.random_weights import dummy_config

        raw, gen, name = dummy_config(dummy, layers)
        return (name if name.lower().startswith("dummy") else f"dummy {name}"), parse_config(raw), gen, \
            {"confidence_threshold": 0.0}
    path = Path(model) if model else default_model_path()
    return path, load_config(path, flag="--model" if model else None, file_ok=False), load_generation_config(path), {}


def resolve_for(model: str | None, preset: str | None, flags: dict, dummy: str | None = None,
                layers: int | None = None) -> tuple[Path | str, ModelConfig, dict | None, Resolved]:
    """Settings without loading weights (for --show-config and plans): `settings_source`'s, resolved."""
    path, cfg, gen, forced = settings_source(model, dummy, layers)
    return path, cfg, gen, resolve(gen, preset, {**flags, **forced})


def cores() -> int:
    """The cores this process may run on (its affinity: a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_limit() -> int:
    return THREADS_PER_CORE * cores()


def check_threads(flag: int) -> None:
    """`--threads N` beyond `thread_limit`: one line naming the limit."""
    if flag > thread_limit():
        raise UserError(f"--threads {flag}: more than {thread_limit()} ({THREADS_PER_CORE} per core, {cores()} "
                        f"core(s) here) only slows a run and can crash torch's thread pool; use at most "
                        f"{thread_limit()}, or leave it out (1 thread for a small CPU model, else one per core)")


def meminfo() -> dict[str, int]:
    """MemAvailable and SwapFree from /proc/meminfo, in bytes ({} where it cannot be read)."""
    try:
        return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith(("MemAvailable:", "SwapFree:"))}
    except (OSError, ValueError, IndexError):
        return {}


def available_ram() -> int | None:
    """What a CPU run can still take: MemAvailable and free swap (the kernel ends a process only when both are
    spent: a refusal must be sure), or less under a memory cap (`memory_cap`); None where unknown."""
    info = meminfo()
    free = info["MemAvailable"] + info.get("SwapFree", 0) if "MemAvailable" in info else None
    cap = memory_cap()
    return cap[0] if cap is not None and (free is None or cap[0] < free) else free


def memory_cap() -> tuple[int, int] | None:
    """(bytes left, limit) under the tightest memory limit of this process's cgroups and their ancestors (v2
    `memory.max`, v1 `memory.limit_in_bytes`), None where none is set. Left = limit - usage + file cache (the kernel
    reclaims that first)."""
    best = None
    for folder in _cgroup_folders():
        v2 = (folder / "memory.max").exists()
        try:
            raw = (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:  # no limit (v1 writes a huge number)
                continue
            limit = int(raw)
            used = int((folder / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
            stat = dict(ln.split() for ln in (folder / "memory.stat").read_text().splitlines() if ln.count(" ") == 1)
            cache = int(stat.get("file" if v2 else "total_cache", stat.get("cache", 0)))
        except (OSError, ValueError):
            continue
        left = max(0, limit - used + cache)
        if best is None or left < best[0]:
            best = (left, limit)
    return best


def _cgroup_folders() -> list[Path]:
    """This process's memory cgroup and its ancestors under /sys/fs/cgroup (v2, or v1's memory controller), leaf
    first; [] where they cannot be found."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    root = Path("/sys/fs/cgroup")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = root / "memory"
            break
    else:  # v2 only: the unified hierarchy (mounted at the root, or at unified/ beside v1's)
        path = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
        if path is None:
            return []
        base = root if (root / "cgroup.controllers").exists() else root / "unified"
    folder = base / path.lstrip("/")
    if not folder.is_dir():  # a container sees its own cgroup as the root of the mount
        folder = base
    out = []
    while True:
        out.append(folder)
        if folder == base:
            return out
        folder = folder.parent


def check_low_memory(path: Path, cfg: ModelConfig, resolved: Resolved) -> None:
    """Refuse, before the load, a GGUF model that cannot run even in low-memory mode in the memory this process may
    take: its KV cache and working set, the resident weights and two layers must fit (else it thrashes or meets
    the OOM killer without a word)."""
    from dgcli.checkpoint.load import GGUF, format_of
    from dgcli.measure.cost.gguf import gguf_fit, gguf_inventory

    free = available_ram()
    if free is None or format_of(path, file_ok=False) != GGUF:
        return
    dtype = resolved.run.dtype if resolved.run.dtype != "auto" else cfg.dtype
    ctx = cfg.canvas_length * blocks_for(resolved.params, resolved.run.max_tokens, cfg.canvas_length)
    need = gguf_fit(gguf_inventory(path), cfg, dtype, ctx, 0, None)["need_low_memory"]
    if need > free:
        cap, gib = memory_cap(), 2**30
        where = f"under this process's memory cap of {cap[1] / gib:.2f} GiB" if cap and cap[0] <= free else "in RAM"
        raise UserError(f"{path}: needs at least {need / gib:.2f} GiB even in low-memory mode (KV cache, working "
                        f"memory, the embedding and two layers' weights; the rest is read from disk each step), more "
                        f"than the {free / gib:.2f} GiB free {where}; raise the memory cap (or free memory)")


def _beyond_weights(cfg: ModelConfig, b: int, context: int, ab: int, cpu: bool, stability: int) -> int:
    """The cost model's peak of b slots at `context` positions, less the weights: KV cache, sampler state, a step's
    or a prompt pass's temporaries (prompts of one token, the least a request has; no prefix cache)."""
    from dgcli.measure import cost

    fmt = "fp32" if ab == 4 else "bf16"
    peak = cost.peak_bytes(cfg, b, context=context, prompt_len=1, fmt=fmt, ab=ab, cpu=cpu, stability=stability)
    return peak["total"] - peak["weights"]


def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with fits(n) (fits grows false with n), 0 when none."""
    return max(0, bisect.bisect_left(range(hi + 1), True, key=lambda n: not fits(n)) - 1)


def check_memory(cfg: ModelConfig, resolved: Resolved, *, slots: int, context: int, free: int | None, cpu: bool,
                 flag: str, context_flag: str | None = None, idle_slots: bool = False) -> None:
    """Refuse, before the load, `slots` slots of `context` cached positions that cannot fit the device's `free`
    bytes. Sure refusals only: weights left out (they may stream from disk), prompts of one token, and with
    `idle_slots` (a server) only the KV cache allocated at start; the figure suggested is the full load's with 10 %
    headroom. `flag` and `context_flag` name what the line says to lower."""
    if free is None or slots < 1:
        return
    dtype = resolved.run.dtype if resolved.run.dtype != "auto" else cfg.dtype
    ab, stability = 4 if dtype == "float32" else 2, resolved.params.stability_threshold
    if idle_slots:
        from dgcli.measure import cost

        need = min(cost.cache_bytes(cfg, slots, context, ab, pc) for pc in (False, True))  # prefix caching or not
    else:
        need = _beyond_weights(cfg, slots, context, ab, cpu, stability)
    if need <= free:
        return
    capped = cpu and (cap := memory_cap()) is not None and cap[0] <= free
    where = (f"under this process's memory cap of {cap[1] / 2**30:.1f} GiB (a cgroup's limit)" if capped
             else "in RAM and swap" if cpu else "on the GPU")
    usable, gib = 0.9 * free, 2**30
    most = _largest(lambda b: _beyond_weights(cfg, b, context, ab, cpu, stability) <= usable, slots - 1)
    held = "their KV cache alone" if idle_slots else "KV cache and working memory, weights aside"
    what = f"{slots:,} slot(s) of {context:,} positions need ~{need / gib:.1f} GiB ({held}), more than the " \
           f"{free / gib:.1f} GiB free {where}"
    fix = (f"at most {most:,} fit with every slot busy: {flag} {most}" if most
           else f"not one slot fits at {context:,} positions")
    if context_flag:
        longest = _largest(lambda c: _beyond_weights(cfg, slots, c, ab, cpu, stability) <= usable, context - 1)
        fix += f" (or {context_flag} {longest} for {slots:,} slots)" if longest >= 2 * cfg.canvas_length else ""
    raise UserError(f"{flag} {slots}: {what}; {fix}")


def prompt_count(resolved: Resolved, *, prompts_file: str | None, random_ids: bool, num_prompts: int | None) -> int:
    """At most how many prompts bench and sweep will run (their engine has no more slots than prompts): never more
    than the run has, so a refusal stays sure."""
    if random_ids:
        return num_prompts or 4
    path = prompts_file or resolved.run.prompt_set
    if path is None or path == "-":  # (stdin is read once, by the run)
        return min(num_prompts or 4, 4 if path is None else 1)
    from dgcli.text.prompts import read_prompt_file

    n = len(read_prompt_file(path))
    return min(n, num_prompts) if num_prompts else n


def check_blocks(cfg: ModelConfig, resolved: Resolved) -> int:
    """The block count, refused before the load when even a one-token prompt and its canvases exceed the context."""
    blocks = blocks_for(resolved.params, resolved.run.max_tokens, cfg.canvas_length)
    if over_context(1, blocks, cfg.canvas_length, cfg.max_position_embeddings) is not None:  # the engine's rule
        raise UserError(f"{blocks} block(s) of {cfg.canvas_length} exceed the model's context of "
                        f"{cfg.max_position_embeddings} with any prompt; lower --blocks (or --max-tokens, which sets "
                        "the block count when --blocks is not given)")
    return blocks


def prompt_room(cfg: ModelConfig, blocks: int) -> int:
    """Positions left for a prompt beside `blocks` canvases."""
    return cfg.max_position_embeddings - blocks * cfg.canvas_length


def check_prompt_chars(text: str, tokenizer: Any, room: int, context: int) -> None:
    """Refuse a prompt that cannot fit before it is tokenized: no token covers more than the tokenizer's
    `max_token_chars` (L) characters, so n characters need at least n / L tokens (a template only adds text)."""
    most = getattr(tokenizer, "max_token_chars", None)
    if most is None or len(text) <= room * most:
        return
    raise UserError(f"the prompt has {len(text):,} characters, more than the {room:,} positions the model's context "
                    f"of {context:,} leaves beside its blocks can hold (at most {room * most:,}); shorten the prompt")
