"""A device's roofline peaks: the H100/H200 datasheet table, and a brief measurement on this CPU taken
several times, so the card shows the median and how far the repeats spread (a busy machine moves them 2x).

Owns: `Peaks`, `DEVICE_TABLE`, `measure_cpu_peaks` (cached per process and thread count), `cpu_name`,
`gpu_peaks`. Must not: run the model or print; torch is imported only inside `measure_cpu_peaks`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Peaks:
    name: str
    flops_per_s: float  # dense bf16 matmul (measured: the median of the repeats)
    bytes_per_s: float  # memory bandwidth (measured: the median of the repeats)
    source: str
    flops_range: tuple[float, float] | None = None  # measured: (min, max) over the repeats; None for a datasheet
    bytes_range: tuple[float, float] | None = None
    repeats: int = 1


# Vendor datasheet figures (dense bf16 tensor-core FLOP/s without sparsity, HBM bandwidth).
DEVICE_TABLE = {
    "H100": Peaks("NVIDIA H100 SXM", 989e12, 3.35e12, "NVIDIA H100 SXM datasheet: bf16 dense 989 TFLOP/s, HBM3 3.35 TB/s"),
    "H200": Peaks("NVIDIA H200 SXM", 989e12, 4.8e12, "NVIDIA H200 SXM datasheet: bf16 dense 989 TFLOP/s, HBM3e 4.8 TB/s"),
}

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


def measure_cpu_peaks(seconds: float = 1.0, repeats: int = 5) -> Peaks:
    """bf16 1024^3 matmul FLOP/s and 128 MiB copy bandwidth (read + write) on this CPU, at the current torch
    thread count (the run's: see dgcli.runtime.session.thread_rule). `repeats` rounds, each the best of
    matmuls then of copies over seconds / (2 x repeats); the peaks are the rounds' medians and the ranges
    their min and max. Cached per process and thread count. Measured, so it moves with other load."""
    import platform

    import torch

    threads = torch.get_num_threads()
    key = f"cpu/{threads}"
    if key in _measured:
        return _measured[key]
    n = 1024
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    out = torch.empty(n, n, dtype=torch.bfloat16)
    x = torch.ones(32 * 2**20)  # 128 MiB float32
    y = torch.empty_like(x)
    window = seconds / (2 * repeats)
    flops, band = [], []
    for _ in range(repeats):
        flops.append(_best(lambda: torch.mm(a, b, out=out), 2 * n**3, window))
        band.append(_best(lambda: y.copy_(x), 2 * x.numel() * 4, window))
    name = cpu_name() or platform.processor() or "CPU"
    peaks = Peaks(f"{name} ({threads} thread{'s' if threads != 1 else ''})", statistics.median(flops),
                  statistics.median(band),
                  f"measured here: median of {repeats} rounds, each the best of bf16 {n}x{n} matmuls and of "
                  f"128 MiB copies over {window:.2g} s; {threads} thread(s)",
                  flops_range=(min(flops), max(flops)), bytes_range=(min(band), max(band)), repeats=repeats)
    _measured[key] = peaks
    return peaks


def cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def gpu_peaks(device_name: str) -> Peaks | None:
    """Table peaks for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), or None when not tabled."""
    for key, peaks in DEVICE_TABLE.items():
        if key in device_name.upper():
            return peaks
    return None
