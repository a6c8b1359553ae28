"""The one harness every script in benchmarks/ uses: a command line with `--dry-run`, timers (host clocks, CUDA
events), median and spread, the machine card (dgcli's own peaks: the H100/H200 table on CUDA, its brief
measurement on a CPU), one JSON line per result, and the `dgemma` CLI as a subprocess.

Owns: how a benchmark times, summarizes and reports. Must not: import kernel implementations (only the CLI,
dgcli's library functions, `dgcli.kernels.dispatch` and the references; DGEMMA_KERNELS picks implementations),
or change what it measures.

`--dry-run`: every script runs its whole path on tiny shapes in seconds (tests/test_benchmarks.py runs each), so
none can rot; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# ~200 M parameters, 32k vocabulary, 256-token canvas, MoE shaped like a scaled-down 26B-A4B (dense MLP plus
# routed experts in every layer, 5 sliding : 1 full): `dgemma bench --dummy benchmarks/200m.json`
CONFIG_200M = BENCH / "200m.json"
DUMMY_MEDIUM = BENCH / "dummy-medium.json"
TINY = BENCH / "tiny.json"  # dry runs: dummy-medium at H 128, V 2048, 2 layers, canvas 32


# ---- the command line -------------------------------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="run every part on tiny shapes in seconds (numbers "
                    "mean nothing; the tests run it so the script cannot rot)")
    return ap


def fail(script: str, msg: str, code: int = 2) -> None:
    """A mistake in the command line (or a missing device): one line on stderr, exit 2."""
    print(f"{script}: {msg}", file=sys.stderr)
    sys.exit(code)


def skip(why: str) -> None:
    """What this machine cannot run (no CUDA, no Ray): one JSON line, exit 0."""
    emit({"skipped": why})
    sys.exit(0)


# ---- timers ------------------------------------------------------------------------------------------------------


class Spans:
    """Times of named spans; only the outermost span of nested calls counts (a router's norm is the router's).
    CUDA: events, read once at `totals`; CPU: host clocks (its ops are synchronous)."""

    def __init__(self, dev=None):
        self.cuda, self.depth, self.open, self.done = getattr(dev, "type", "cpu") == "cuda", 0, None, []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        (e := torch.cuda.Event(enable_timing=True)).record()
        return e

    def enter(self, name: str) -> None:
        if self.depth == 0:
            self.open = (name, self._now())
        self.depth += 1

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            name, t0 = self.open
            self.done.append((name, t0, self._now()))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        out = defaultdict(float)
        for name, a, b in self.done:
            out[name] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        self.done = []
        return dict(out)


def times(fn, reps: int, warmup: int = 2, dev=None) -> list[float]:
    """Seconds of each of `reps` calls after `warmup` untimed ones (compiles, autotuning, thread pools)."""
    for _ in range(warmup):
        fn()
    spans, out = Spans(dev), []
    for _ in range(reps):
        spans.enter("call")
        fn()
        spans.exit()
        out.append(spans.totals()["call"])
    return out


def timed(fn, dev=None, reps: int = 5, warmup: int = 2) -> float:
    """Median seconds of `reps` calls after `warmup`."""
    return median(times(fn, reps, warmup, dev))


def median(xs) -> float:
    """The upper median (an observed value; the recorded numbers in RESULTS.md use it)."""
    s = sorted(xs)
    return s[len(s) // 2]


def spread(xs) -> dict:
    """Median and range of repeated measurements: {median, min, max, spread (max-min over the median), n}."""
    m = median(xs)
    return dict(median=m, min=min(xs), max=max(xs), spread=(max(xs) - min(xs)) / m if m else 0.0, n=len(xs))


def wall(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


# ---- the machine card -----------------------------------------------------------------------------------------


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_name() -> str:
    from dgcli.measure.peaks import cpu_name as name  # one /proc/cpuinfo reader

    return name() or platform.processor() or "unknown"


def device_peaks(dev, tflops: float | None = None, gbs: float | None = None, seconds: float = 1.0):
    """(name, FLOP/s, bytes/s, source) of `dev`: given, tabled (H100/H200) or measured here (CPU: dgcli's brief
    measurement, as `dgemma info` shows it); FLOP/s and bytes/s None when unknown."""
    import torch

    from dgcli.measure.peaks import gpu_peaks, measure_cpu_peaks

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    if tflops and gbs:
        return name, tflops * 1e12, gbs * 1e9, "given on the command line"
    p = gpu_peaks(name) if dev.type == "cuda" else measure_cpu_peaks(seconds=seconds)
    if p is None:
        return name, None, None, f"no table entry for {name!r}: pass --peak-tflops and --peak-gbs"
    return (p.name if dev.type == "cpu" else name), p.flops_per_s, p.bytes_per_s, p.source


def machine(dev=None, peaks: bool = True, seconds: float = 1.0) -> dict:
    """The card a result is read against: the machine, torch, threads, load, and the device's peaks."""
    import torch

    dev = torch.device(dev or "cpu")
    card = {"machine": cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "load_avg": load_avg(),
            "kernels": os.environ.get("DGEMMA_KERNELS", "auto")}
    if peaks:
        name, pf, pb, source = device_peaks(dev, seconds=seconds)
        card.update(device=name, peak_flops=pf, peak_bytes_per_s=pb, peak_source=source)
    return card


def card_line(card: dict) -> str:
    peaks = ""
    if card.get("peak_flops"):
        peaks = (f"; {card['device']} peaks {card['peak_flops'] / 1e9:.0f} GFLOP/s, "
                 f"{card['peak_bytes_per_s'] / 1e9:.0f} GB/s ({card['peak_source']})")
    return (f"machine: {card['machine']}, {card['cpus']} CPUs, torch {card['torch']}, {card['threads']} threads, "
            f"load avg {card['load_avg']}, DGEMMA_KERNELS={card['kernels']}{peaks}")


# ---- reporting --------------------------------------------------------------------------------------------------


def emit(record: dict) -> None:
    """One result as one JSON line on stdout (scripts read the last line)."""
    print(json.dumps(record), flush=True)


def pct(x) -> str:
    return f"{100 * x:.1f}" if isinstance(x, (int, float)) else "n/a"


def num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


# ---- the CLI as a subprocess -------------------------------------------------------------------------------------


def dgemma_exe() -> str:
    """The console script beside this interpreter (the venv under test), else whichever `dgemma` PATH finds."""
    exe = Path(sys.executable).with_name("dgemma")
    return str(exe) if exe.exists() else "dgemma"


def dgemma(*args: str, env: dict | None = None, timeout: float | None = None) -> list[dict]:
    """`dgemma ARGS... --format jsonl` in a fresh process: its rows (one JSON object a line). A failure is one
    line naming the command and its last stderr line."""
    cmd = [dgemma_exe(), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=ROOT,
                         timeout=timeout)
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{' '.join(cmd[1:])}: exit {res.returncode}: {last}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


# ---- checkpoints for the benchmarks ----------------------------------------------------------------------------

GGUF_TYPES = ("f32", "bf16", "q8_0", "q4_k_m")  # `dgemma quantize --type`


def random_checkpoint(config: Path, root: Path, weights: str = "bf16", **kw) -> Path:
    """A bf16 random-weight checkpoint of the --dummy config `config` under `root` (written on first use)."""
    import torch

    from dgcli.checkpoint.random_weights import write_random_checkpoint

    path = root / f"dgemma-bench-{Path(config).stem}-{weights}"
    if not (path / "config.json").exists():
        raw = json.loads(Path(config).read_text())
        secs, _ = wall(lambda: write_random_checkpoint(path, raw["text_config"], canvas_length=raw["canvas_length"],
                                                      dtype=torch.bfloat16, tokenizer=False,
                                                      weights="fp8" if weights == "fp8" else "plain", **kw))
        print(f"wrote {path} in {secs:.1f} s", file=sys.stderr)
    return path


def gguf_of(src: Path, kind: str) -> Path:
    """`dgemma quantize SRC F.gguf --type KIND` beside the checkpoint (written on first use)."""
    dst = src.parent / f"{src.name}-{kind}.gguf"
    if not dst.exists():
        cmd = [dgemma_exe(), "quantize", str(src), str(dst), "--type", kind]
        secs, res = wall(lambda: subprocess.run(cmd, capture_output=True, text=True))
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd[1:])}: exit {res.returncode}: {res.stderr.strip()[-500:]}")
        print(f"wrote {dst} in {secs:.1f} s", file=sys.stderr)
    return dst
