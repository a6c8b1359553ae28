"""The Ray actor of `--ray`: one session per worker, loaded once; each chunk method is the library call a local
run makes (`request.run_batch`, `measure.sweep.run_cell`, `measure.bench.measure`), its result the same object.

Owns: opening the session from the driver's spec, the torch thread cap (at most the CPUs Ray gave the worker),
the session's description for the driver (all but the weights), and the tests' pause points (`driver.Pool.pause`).
Must not: import ray (the driver wraps the class), print, or write files (but a pause point's marker).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Any


class _Weights:
    """The driver's copy of a session's model: its dtype and config, not the weights."""

    def __init__(self, model: Any):
        import torch

        self.embed_weight = torch.empty(0, dtype=model.embed_weight.dtype)
        self.config = model.config


class Worker:
    def __init__(self, spec: dict, cpus: int, pause: str | None = None):
        self.spec, self.cpus, self.pause = spec, cpus, pause
        self.session: Any = None
        self.baseline = 0  # ru_maxrss before the model: the CPU peak-memory figure's baseline
        self.warmed: set = set()
        self.peaks: dict = {}  # measured once per worker (about a second on CPU)
        self.paused: dict[str, int] = {}  # pause point -> times reached

    def _pause(self, point: str) -> None:
        """With `pause` "POINT:DIR" naming `point` (`load`, `describe`, or `chunk`: each chunk's start), create
        DIR/POINT-PID-N (N from 0 per process) and wait until DIR/POINT-PID-N.go exists: a test kills it there."""
        name, _, folder = (self.pause or "").partition(":")
        if name != point:
            return
        n = self.paused[point] = self.paused.get(point, -1) + 1
        mark = Path(folder) / f"{point}-{os.getpid()}-{n}"
        mark.touch()
        while not Path(f"{mark}.go").exists():
            time.sleep(0.02)

    def _open(self) -> Any:
        if self.session is not None:
            return self.session
        import torch

        from dgcli.measure.bench import PeakMemory
        from dgcli.runtime.session import open_any, open_session

        spec = self.spec
        os.environ.update(spec.get("env", {}))  # the driver's DGEMMA_* settings (e.g. --fp8-activations)
        if spec.get("threads") is None and os.environ.get("OMP_NUM_THREADS") == str(self.cpus):
            os.environ.pop("OMP_NUM_THREADS")  # Ray's own setting: let dgemma's thread rule decide, then cap it
        self.baseline = PeakMemory.maxrss()
        if spec["kind"] == "generate":
            s = open_session(spec["model"], spec["preset"], spec["flags"], compile=spec["compile"],
                             threads=spec["threads"], cuda_graphs=spec["cuda_graphs"])
        else:
            s = open_any(spec["model"], spec["dummy"], spec["layers"], spec["preset"], spec["flags"], warn=lambda m: None,
                         compile=spec["compile"], threads=spec["threads"], weights=spec.get("weights", "bf16"),
                         cuda_graphs=spec["cuda_graphs"])
        if spec["threads"] is None and s.device.type == "cpu" and s.threads > self.cpus:
            torch.set_num_threads(self.cpus)
            s = dataclasses.replace(s, threads=self.cpus, threads_source=f"ray: the worker's {self.cpus} CPU(s)")
        s.prefix_caching = spec.get("prefix_caching", True)  # the driver's --no-prefix-caching
        self.session = s
        return s

    def load(self) -> dict:
        self._pause("load")
        s = self._open()
        return {"pid": os.getpid(), "node": socket.gethostname(), "device": str(s.device)}

    def pid(self) -> int:
        return os.getpid()

    def describe(self, measure_peaks: bool) -> tuple[Any, Any, dict]:
        """(the session without weights or tokenizer, this device's peaks, the command's `weights_fields`)."""
        self._pause("describe")
        s = self._open()
        fields = self.spec["weights_fields"](s.model) if self.spec.get("weights_fields") else {}
        return dataclasses.replace(s, model=_Weights(s.model), tokenizer=None), self._peaks(measure_peaks), fields

    def _peaks(self, measure: bool) -> Any:
        from dgcli.measure import bench as b

        if measure not in self.peaks:
            s = self._open()
            self.peaks[measure] = b.device_peaks(s.device, measure_cpu=measure, compute=b.compute_dtype(s))
        return self.peaks[measure]

    def generate(self, items: list[tuple], batch_size: int, show_thinking: bool, events: bool) -> list[tuple]:
        """`--input-jsonl` rows [(index, prompt ids, seed, first canvas)] -> [(index, Response, events or None)]."""
        from dgcli.runtime.request import run_batch

        self._pause("chunk")
        s = self._open()
        seen: dict[int, list] = {n: [] for n in range(len(items))}
        on_event = (lambda e: seen[e.row].append(e)) if events else None
        got = dict(run_batch(s, [it[1] for it in items], batch_size=batch_size, seeds=[it[2] for it in items],
                             init_canvases=[it[3] for it in items], show_thinking=show_thinking, on_event=on_event))
        return [(it[0], got[n], _reindex(seen[n], it[0]) if events else None) for n, it in enumerate(items)]

    def reference(self, plist: list, ignore: bool, fp: str) -> dict:
        """The sweep's reference row (agreement), for the driver to save."""
        from dgcli.measure import sweep as sw

        return sw.reference_row(self._open(), plist, ignore, fp, lambda t: None)

    def cell(self, cell: Any, plist: list, source: str, seeds: list[int], runs: int, ignore: bool, metric: str,
             reference: Any, label: str | None, meta: dict, fp: str, warmup: int, warm_batch: int,
             measure_peaks: bool) -> dict:
        """One sweep cell's row, after this worker's warm-up (once, as the local sweep's)."""
        from dgcli.measure import bench as b
        from dgcli.measure import sweep as sw

        self._pause("chunk")
        s = self._open()
        if "sweep" not in self.warmed:
            b.warm_up(s, plist, s.params, warmup, batch_size=warm_batch, ignore_eos=ignore)
            self.warmed.add("sweep")
        return sw.run_cell(s, cell, plist, source, seeds, runs, ignore, metric, reference, self._peaks(measure_peaks),
                           b.PeakMemory(s.device, self.baseline), label, meta, fp, lambda t: None)

    def bench(self, plist: list, params: Any, runs: int, warmup: int, ignore: bool, batch_size: int) -> dict:
        """A shard of bench's prompts: its passes and the peak memory over them."""
        from dgcli.measure import bench as b

        self._pause("chunk")
        s = self._open()
        memory = b.PeakMemory(s.device, self.baseline)
        passes = b.measure(s, plist, params, runs=runs, warmup=warmup, ignore_eos=ignore, batch_size=batch_size,
                           memory=memory)
        return {"passes": passes, "peak_memory": memory.read(), "device": str(s.device), "pid": os.getpid()}


def _reindex(events: list, index: int) -> list:
    """Events carry the row within the chunk; the driver's records name the input row."""
    return [dataclasses.replace(e, row=index) if hasattr(e, "row") else e for e in events]
