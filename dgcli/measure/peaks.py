"""A device's roofline peaks: the H100/H200 datasheet table, and a brief measurement on this CPU taken several
times (the card shows the median and the spread: a busy machine moves them 2x), pinned peaks (`--save-peaks FILE`,
`--peaks FILE`: runs compared on a busy machine share one measurement) and the busy-machine note.

A peak is a matmul rate in one dtype (`Peaks.compute`): a run is held to the fastest matmul its kernels use
(bench.py::matmul_dtype), so its floor stays a lower bound. Must not: run the model or print; torch is imported
only inside `measure_cpu_peaks`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from dgcli.errors import UserError


@dataclass(frozen=True)
class Peaks:
    name: str
    flops_per_s: float  # dense matmul in `compute` (measured: the median of the repeats)
    bytes_per_s: float  # memory bandwidth (measured: the median of the repeats)
    source: str
    flops_range: tuple[float, float] | None = None  # measured: (min, max) over the repeats; None for a datasheet
    bytes_range: tuple[float, float] | None = None
    repeats: int = 1
    compute: str = "bfloat16"  # the matmul's dtype: bfloat16, float32, int8 or float8 (e4m3, CUDA only)


COMPUTE = {"bfloat16": "bf16", "float32": "fp32", "int8": "int8", "float8": "fp8"}  # dtype -> short name
# Vendor datasheet figures (dense tensor-core FLOP/s without sparsity; fp32 on the CUDA cores, as torch runs an
# fp32 matmul by default (no TF32); HBM bandwidth). The H200 has the H100's compute.
DEVICE_TABLE = {
    "H100": Peaks("NVIDIA H100 SXM", 989e12, 3.35e12, "NVIDIA H100 SXM datasheet: bf16 dense 989 TFLOP/s, HBM3 3.35 TB/s"),
    "H200": Peaks("NVIDIA H200 SXM", 989e12, 4.8e12, "NVIDIA H200 SXM datasheet: bf16 dense 989 TFLOP/s, HBM3e 4.8 TB/s"),
}
GPU_COMPUTE = {"bfloat16": (989e12, "bf16 dense 989 TFLOP/s"), "float32": (67e12, "fp32 (no TF32) 67 TFLOP/s"),
               "int8": (1979e12, "int8 dense 1979 TOP/s"), "float8": (1979e12, "fp8 dense 1979 TFLOP/s")}

_measured: dict[str, Peaks] = {}


def _best(fn, work: float, seconds: float) -> float:
    """The best rate (work / s) of `fn` over about `seconds` (at least one call)."""
    best, t_end = 0.0, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        best = max(best, work / (time.perf_counter() - t0))
        if time.perf_counter() >= t_end:
            return best


def measure_cpu_peaks(seconds: float = 1.0, repeats: int = 5, compute: str = "bfloat16") -> Peaks:
    """1024^3 matmul FLOP/s in `compute` (bfloat16, float32 or int8) and 128 MiB copy bandwidth (read + write) on
    this CPU at the current thread count: the medians of `repeats` rounds, each the best of matmuls then of copies
    over seconds / (2 x repeats), and their ranges. Cached per process, thread count and dtype."""
    import torch

    if compute not in ("bfloat16", "float32", "int8"):
        raise ValueError(f"no CPU peak for {compute} matmuls: use bfloat16, float32 or int8")
    threads = torch.get_num_threads()
    key = f"cpu/{threads}/{compute}"
    if key in _measured:
        return _measured[key]
    n = 1024
    if compute == "int8":
        a, b = (torch.randint(-128, 128, (n, n), dtype=torch.int8) for _ in range(2))
        matmul = lambda: torch._int_mm(a, b)  # noqa: E731
    else:
        a, b = (torch.randn(n, n).to(getattr(torch, compute)) for _ in range(2))
        out = torch.empty(n, n, dtype=a.dtype)
        matmul = lambda: torch.mm(a, b, out=out)  # noqa: E731
    x = torch.ones(32 * 2**20)  # 128 MiB float32
    y = torch.empty_like(x)
    window = seconds / (2 * repeats)
    flops, band = [], []
    for _ in range(repeats):
        flops.append(_best(matmul, 2 * n**3, window))
        band.append(_best(lambda: y.copy_(x), 2 * x.numel() * 4, window))
    peaks = Peaks(cpu_label(threads), statistics.median(flops),
                  statistics.median(band),
                  f"measured here: median of {repeats} rounds, each the best of {compute} {n}x{n} matmuls and of "
                  f"128 MiB copies over {window:.2g} s; {threads} thread(s)",
                  flops_range=(min(flops), max(flops)), bytes_range=(min(band), max(band)), repeats=repeats,
                  compute=compute)
    _measured[key] = peaks
    return peaks


def cpu_label(threads: int | None = None) -> str:
    """This CPU as a row's provenance names it (its model), and as its measured peaks do: with the thread count
    they were measured with."""
    import platform

    name = cpu_name() or platform.processor() or "CPU"
    return name if threads is None else f"{name} ({threads} thread{'s' if threads != 1 else ''})"


def cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def gpu_peaks(device_name: str, compute: str = "bfloat16") -> Peaks | None:
    """Table peaks for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') and matmul dtype, or None."""
    for key, peaks in DEVICE_TABLE.items():
        if key in device_name.upper():
            return table_peaks(peaks, compute)
    return None


def table_peaks(peaks: Peaks, compute: str) -> Peaks:
    """A datasheet row (bf16) at another matmul dtype's compute peak."""
    if compute == "bfloat16":
        return peaks
    flops, what = GPU_COMPUTE[compute]
    return dataclasses.replace(peaks, flops_per_s=flops, compute=compute,
                               source=peaks.source.replace(GPU_COMPUTE["bfloat16"][1], what))


# ---- pinned peaks: one measurement shared by the runs to compare --------------------------------------------

PEAKS_FILE_KIND = "dgemma-peaks"


def peaks_json(peaks: Peaks) -> str:
    """What a `--save-peaks FILE` holds: the measured peaks as JSON (what `load_peaks` reads back)."""
    doc = {"kind": PEAKS_FILE_KIND, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "peaks": dataclasses.asdict(peaks)}
    return json.dumps(doc, indent=2) + "\n"


def load_peaks(path: str | Path, *, name: str, compute: str) -> Peaks:
    """`--peaks FILE`: the peaks a `--save-peaks` file or a saved bench/sweep JSON (its card's measured device)
    holds for this machine (`name`: the CPU and thread count) and matmul dtype; else one error line."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--peaks {path}: no such file; write one with --save-peaks {path}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"--peaks {path}: not a JSON file ({type(e).__name__}); give a file written by --save-peaks "
                        "or a saved bench JSON") from None
    found = []
    if isinstance(doc, dict) and doc.get("kind") == PEAKS_FILE_KIND and isinstance(doc.get("peaks"), dict):
        found = [(doc["peaks"], doc.get("measured_at"))]
    elif isinstance(doc, dict) and isinstance(doc.get("card"), dict):  # bench/sweep --format json or --save-result
        found = [(d, None) for d in doc["card"].get("devices") or [] if isinstance(d, dict) and d.get("flops_range")]
    fields = {f.name for f in dataclasses.fields(Peaks)}
    got = []
    for d, when in found:
        try:
            p = Peaks(**{k: (tuple(v) if k.endswith("_range") and v else v) for k, v in d.items() if k in fields})
            float(p.flops_per_s), float(p.bytes_per_s)
        except (TypeError, ValueError):
            continue
        got.append((p, when))
    if not got:
        raise UserError(f"--peaks {path}: holds no measured CPU peaks; give a file written by --save-peaks or a "
                        "saved bench JSON of a CPU run")
    p, when = got[0]
    if p.name != name:
        raise UserError(f"--peaks {path}: measured on {p.name}, this run is {name}; pin peaks measured with the "
                        "same CPU and --threads")
    if p.compute != compute:
        raise UserError(f"--peaks {path}: holds a {p.compute} matmul peak, this run's matmuls are {compute}; save "
                        "peaks from a run of the same weights and --dtype")
    at = f" (measured {when})" if when else ""
    return dataclasses.replace(p, source=f"pinned from {path}{at}: {p.source}")


def load_note(threads: int) -> str | None:
    """One warning line when the 1-minute load average exceeds the cores this process may use."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except OSError:
        return None
    if load <= cores:
        return None
    return (f"dgemma: warning: the 1-minute load average is {load:.2f} on {cores} core{'s' if cores != 1 else ''} "
            f"(this run uses {threads} thread{'s' if threads != 1 else ''}): other work competes for them, so timings "
            "and measured peaks move with it; measure on a quiet machine, or pin peaks with --peaks FILE")


def check_peak_flags(pinned: str | None, save: str | None, measure: bool, ray: str | None = None) -> None:
    """Before the model: `--peaks`, `--save-peaks` and `--no-measure-peaks` agree and the files can be used."""
    if ray is not None and (pinned is not None or save is not None):
        flag = "--peaks" if pinned is not None else "--save-peaks"
        raise UserError(f"{flag} pins this machine's CPU peaks; --ray workers measure their own: drop one of them")
    if pinned is not None and save is not None:
        raise UserError("--peaks reads pinned peaks, --save-peaks writes measured ones: give one of them")
    if save is not None and not measure:
        raise UserError("--save-peaks saves the measured peaks; --no-measure-peaks measures none: drop one")
    if pinned is not None and not Path(pinned).is_file():
        raise UserError(f"--peaks {pinned}: no such file; write one with --save-peaks {pinned}")
    if save is not None:
        folder = Path(save).resolve().parent
        if Path(save).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UserError(f"--save-peaks {save}: cannot write a file there; pick a writable file path")
