"""`dgemma info [MODEL | -m MODEL]`: the checkpoint card (dgcli.measure.cost), without reading weights: sizes,
memory to run, per-step FLOPs, bytes and roofline floor, and the largest batch that fits each memory budget.

Owns: the command's flags, the budgets and the output choice. Must not: load weights or do the arithmetic.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

import dgcli.cli.options as o
from dgcli.errors import UserError


EXAMPLES = ["dgemma info", "dgemma info -m ~/diffusiongemma-26B-A4B-it", "dgemma info -m ~/diffusiongemma-Q4_K_M.gguf",
            "dgemma info --dummy 26B-A4B --context 1024 --memory 40"]


def info(
    model_arg: Annotated[Optional[str], typer.Argument(metavar="MODEL", help=o.dflt("Checkpoint directory, config.json or GGUF file, as -m/--model.", "the bundled tiny model"))] = None,
    model_opt: o.Model = None, dummy: o.Dummy = None, layers: o.Layers = None, device: o.Device = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPE", help="Run dtype for memory and bytes: auto (the checkpoint's) | bfloat16 | float32")] = None,
    context: Annotated[int, typer.Option("--context", metavar="N", help="Cached tokens the KV-cache figure is sized for.")] = 4096,
    prompt_len: Annotated[int, typer.Option("--prompt-len", metavar="N", help="Cached tokens a denoising step attends to, for per-step costs.")] = 256,
    memory: Annotated[Optional[float], typer.Option("--memory", metavar="GB", help=o.dflt("Another memory budget (GiB) to size the largest batch for, on this device's path.", "the H100, the H200 and this machine"))] = None,
    read_rate: Annotated[Optional[float], typer.Option("--read-rate", metavar="MB/S", help=o.dflt("A GGUF file: the disk's read rate for the step time under a memory cap (--memory, or this process's cgroup cap).", "measured: 256 MiB of the file read past the page cache"))] = None,
    headroom: Annotated[float, typer.Option("--headroom", metavar="PCT", help="Percent of each budget left free (CUDA context, allocator fragmentation).")] = 10.0,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="FORMAT", help="md | json")] = "md",
    measure_peaks: o.MeasurePeaks = True, threads: o.Threads = None,
    peaks_file: o.PeaksFile = None, save_peaks: o.SavePeaks = None,
) -> None:
    """Show a checkpoint's card: sizes, memory, per-step costs.

    Parameters, bytes by dtype, memory to run, per-step FLOPs and bytes, and the roofline floor.
    """
    if fmt not in ("md", "json"):
        raise UserError(f"--format {fmt}: use md or json")
    if context < 1 or prompt_len < 0:
        raise UserError("--context must be >= 1 and --prompt-len >= 0")
    if memory is not None and not memory > 0:
        raise UserError(f"--memory {memory}: give the budget in GiB, e.g. --memory 40")
    if not 0 <= headroom < 100:
        raise UserError(f"--headroom {headroom}: a percent in [0, 100)")
    # The positional form came first; -m/--model is what every other command takes.
    if model_arg is not None and model_opt is not None and model_arg != model_opt:
        raise UserError(f"two models given (MODEL {model_arg} and --model {model_opt}): give one of them")
    model = model_opt if model_opt is not None else model_arg
    from dgcli.measure import cost as inf
    from dgcli.measure import printers as report
    from dgcli.measure.bench import keep_peaks, local_peaks, matmul_dtype, peaks_for_card
    from dgcli.measure.peaks import check_peak_flags, load_note

    check_peak_flags(peaks_file, save_peaks, measure_peaks)
    from dgcli.checkpoint.config import parse_config
    from dgcli.checkpoint.load import DIRECTORY, GGUF, format_of, load_config
    from dgcli.checkpoint.random_weights import dummy_config
    from dgcli.runtime.preflight import check_target
    from dgcli.runtime.session import default_model_path, pick_device, set_threads

    inventory = None
    check_target(model, dummy, layers)
    if dummy is not None:
        raw, _, name = dummy_config(dummy, layers)
        cfg = parse_config(raw)
        name, source = f"dummy {name}", f"config {dummy} (random weights; nothing read but the config)"
    else:
        path = Path(model) if model else default_model_path()
        cfg = load_config(path)
        kind = format_of(path)
        folder = path if kind == DIRECTORY else path.parent
        if kind == GGUF:
            inventory = inf.gguf_inventory(path)
            name, source = path.name, f"GGUF file {path}"
        else:
            if any(folder.glob("*.safetensors")):
                inventory = inf.safetensors_inventory(folder)
            name, source = folder.name, f"checkpoint {folder}" + ("" if inventory else " (config only: no safetensors found)")
    gguf = inventory is not None and "quantized_bytes_kept" in inventory
    stored = cfg.dtype if gguf else _stored_dtype(inventory, cfg.dtype)  # GGUF: the loader's run dtype
    run_dtype = dtype if dtype not in (None, "auto") else stored
    if run_dtype not in ("bfloat16", "float32", "float16") or dtype == "float16":  # fp16: a checkpoint's own only
        raise UserError(f"--dtype {run_dtype}: use auto, bfloat16 or float32")
    dev = pick_device(device or "auto")
    n_threads = set_threads(cfg, dev, threads)  # the rule every command follows: the CPU peaks are measured on it
    import torch

    ggml = None
    if gguf:  # GGML weights: int8 activations where the int8 kernel runs
        from dgcli.model.ggml import activations_on

        ggml = activations_on(getattr(torch, run_dtype), dev)
    compute = matmul_dtype(run_dtype, ggml)
    count = n_threads[0] if n_threads else None
    local = local_peaks(dev, compute, count, measure_cpu=measure_peaks, pinned=peaks_file)
    for note in (keep_peaks(save_peaks, local), load_note(count or 1) if local is not None and local.flops_range
                 and peaks_file is None else None):
        if note:
            print(note, file=sys.stderr)
    peaks = peaks_for_card(local, compute)
    card = inf.card(cfg, name=name, source=source, dtype=run_dtype, context=context, prompt_len=prompt_len,
                    peaks=peaks, inventory=inventory, threads=n_threads, budgets=_budgets(dev, memory),
                    headroom=headroom / 100)
    extra = ""
    if gguf:  # weights as loaded (quantized matrices as stored), and whether this machine holds the run
        from dgcli.checkpoint.mapped import read_rate as measured_rate
        from dgcli.runtime.preflight import memory_cap
        from dgcli.runtime.session import free_bytes

        if read_rate is not None and read_rate <= 0:
            raise UserError(f"--read-rate {read_rate:g}: give the disk's read rate in MB/s, more than 0")
        cap = memory_cap()
        extra = inf.gguf_section(card, inventory, cfg, run_dtype, context, ram=_ram(), memory_gib=memory,
                                 available=free_bytes(torch.device("cpu")), cap=cap[1] if cap else None,
                                 read_rate=read_rate * 1e6 if read_rate is not None else measured_rate(path))
    if fmt == "json":
        sys.stdout.write(report.to_json(card))
    else:
        sys.stdout.write(report.card_markdown(card) + extra + "\n" + inf.markdown(card["batch_memory"]))


def _ram() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _budgets(dev, memory_gib: float | None) -> list[dict]:
    """The memories the largest batch is sized for: the H100 and H200 (CUDA path), this device (its own
    memory: the GPU's, or the machine's RAM for a CPU run) and --memory (on this device's path)."""
    from dgcli.measure.cost import GIB, GPUS

    out = [{"name": n, "bytes": b, "cpu": False} for n, b in GPUS]
    cpu = dev.type != "cuda"
    if cpu:
        out.append({"name": "this machine", "bytes": _ram(), "cpu": cpu})
    else:
        import torch

        props = torch.cuda.get_device_properties(dev)
        out.append({"name": props.name, "bytes": props.total_memory, "cpu": cpu})
    if memory_gib is not None:
        out.append({"name": f"--memory {memory_gib:g} GiB", "bytes": int(memory_gib * GIB), "cpu": cpu})
    return out


def _stored_dtype(inventory: dict | None, fallback: str) -> str:
    """The dtype holding most of a checkpoint's bytes (the run dtype dgemma's loader picks); FP8 weights are not
    a run dtype (an FP8 checkpoint runs in the dtype of its unquantized tensors)."""
    stored = {k: v for k, v in (inventory or {}).get("text_bytes_by_dtype", {}).items()
              if not k.startswith(("float8", "uint8"))}  # uint8: NVFP4's packed codes
    return max(stored.items(), key=lambda kv: kv[1])[0] if stored else fallback

