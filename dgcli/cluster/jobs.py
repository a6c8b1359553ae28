"""What generate --input-jsonl, sweep and bench hand to the pool under `--ray`, and their results back as the
objects the local run produces (Responses in input order, sweep rows in cell order, bench `Pass`es).

Owns: the session spec the workers open, the driver's copy of a session (no weights), how work is cut into chunks
(generate: 2 x --batch-size rows; sweep: one cell; bench: one shard of the prompts per worker), how a bench pass
is put back together, and what the line says when every worker is gone.
Must not: run the model in the driver, contain a denoising loop, or print anything but notes on stderr.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from dgcli.cluster.driver import Ordered, Pool, ProgressLine, WorkersGone
from dgcli.errors import UserError

GENERATE_CHUNK = 2  # --input-jsonl rows per chunk, in --batch-size units: small enough to spread and to re-run


def spec(kind: str, *, model: str | None, preset: str | None, flags: dict, compile: bool, threads: int | None,
         cuda_graphs: bool | None, dummy: str | None = None, layers: int | None = None, weights: str = "bf16",
         weights_fields: Callable[[Any], dict] | None = None, prefix_caching: bool = True) -> dict:
    """What each worker opens: `kind` "generate" (a checkpoint with its tokenizer) or "any" (bench, sweep); paths
    made absolute. `weights_fields(model)`: the command's description of the weights, run in a worker."""
    def absolute(p: str | None) -> str | None:
        return str(Path(p).resolve()) if p is not None and Path(p).exists() else p

    env = {k: v for k, v in os.environ.items() if k.startswith("DGEMMA_")}  # e.g. --fp8-activations' DGEMMA_FP8
    return {"kind": kind, "model": absolute(model), "preset": absolute(preset), "flags": flags, "compile": compile,
            "threads": threads, "cuda_graphs": cuda_graphs, "dummy": absolute(dummy), "layers": layers,
            "weights": weights, "env": env, "weights_fields": weights_fields, "prefix_caching": prefix_caching}


def open_pool(address: str, workers: int | None, gpus: float | None, worker_spec: dict,
              warn: Callable[[str], None]) -> Pool:
    """Connect, start the workers and load their sessions; one line on stderr says who runs."""
    from dgcli.runtime.session import resolve_for

    if worker_spec["dummy"] is None:  # a bad --model or --preset: one line here, before any cluster starts
        resolve_for(worker_spec["model"], worker_spec["preset"], worker_spec["flags"])
    pool = Pool(address, worker_spec, workers=workers, gpus=gpus, warn=warn)
    try:
        pool.start()
    except BaseException:
        pool.close()
        raise
    warn(f"dgemma: ray: {pool.describe_workers()}")
    return pool


def driver_session(pool: Pool, *, measure_peaks: bool = False, need_tokenizer: bool = True) -> tuple[Any, Any, dict]:
    """(session, the workers' device peaks, `weights_fields` of their model): the first worker's session without
    weights, with the tokenizer loaded here (prompts are encoded and answers written here)."""
    from dgcli.checkpoint.load import load_tokenizer

    shadow, peaks, fp8 = pool.call("describe", measure_peaks)
    tokenizer = None if shadow.dummy else load_tokenizer(Path(shadow.path), need_tokenizer)  # a GGUF file's own
    return dataclasses.replace(shadow, tokenizer=tokenizer), peaks, fp8


def shared_node_note(pool: Pool) -> str | None:
    """bench and sweep: one line when two CPU workers share a node (their timed work competes for its cores)."""
    from collections import Counter

    nodes = Counter(i["node"] for i in pool.infos.values() if i and str(i.get("device", "")).startswith("cpu"))
    crowded = [(node, n) for node, n in nodes.items() if n > 1]
    if not crowded:
        return None
    where = ", ".join(f"{n} on {node}" for node, n in crowded)
    return (f"dgemma: warning: Ray CPU workers share a node ({where}): their timed runs overlap and compete for its "
            "cores, so speeds depend on what runs beside them; for timings to compare, run one worker per node "
            "(--ray-workers N for N nodes)")


# ---- generate --input-jsonl ------------------------------------------------------------------------------


def run_rows(pool: Pool, requests: list, *, batch_size: int, show_thinking: bool, on_event: Callable | None,
             write: Callable[[int, Any], None], resume: str = "") -> list[Any]:
    """`dgcli.cli.batch.run_rows` over the workers: `write(index, response)` in input order; the responses. With no
    worker left: one line, with `resume` (how to finish the run)."""
    size = GENERATE_CHUNK * batch_size
    chunks = [([(i, r.prompt_ids, r.seed, r.init_canvas) for i, r in enumerate(requests[at:at + size], at)],
               batch_size, show_thinking, on_event is not None) for at in range(0, len(requests), size)]
    out: list[Any] = [None] * len(requests)
    order, progress = Ordered(), ProgressLine(len(requests), "requests")
    written = 0
    try:
        for n, got in pool.run("generate", chunks, sizes=[len(c[0]) for c in chunks], progress=progress):
            for _, chunk in order.add(n, got):
                for index, response, events in chunk:
                    for event in events or ():
                        on_event(event)
                    out[index] = response
                    write(index, response)
                    written += 1
    except WorkersGone as e:
        raise UserError(f"{e}; {written} of the {len(requests)} record(s) to do were written (in input order) and "
                        f"stay; {resume or 'rerun to finish'}") from None
    finally:
        progress.close()
    return out


# ---- sweep -----------------------------------------------------------------------------------------------


def sweep_cells(pool: Pool, todo: list, plist: list, source: str, seeds: list[int], runs: int, ignore: bool,
                metric: str, reference: Any, label: str | None, meta: dict, fp: str, *, warmup: int,
                warm_batch: int, measure_peaks: bool, keep: Callable[[dict], None], resume: str = "") -> Iterator[dict]:
    """One cell per chunk; rows yielded in cell order. On Ctrl-C, or with no worker left, the cells that finished
    out of order go to `keep` (the row file) first; then the interrupt goes on, or one line says how to finish."""
    chunks = [(cell, plist, source, seeds, runs, ignore, metric, reference, label, meta, fp, warmup, warm_batch,
               measure_peaks) for cell in todo]
    order, progress = Ordered(), ProgressLine(len(todo), "cells")
    try:
        for n, row in pool.run("cell", chunks, progress=progress):
            for _, ready in order.add(n, row):
                yield ready
    except (KeyboardInterrupt, WorkersGone) as e:
        for n in sorted(order.waiting):
            keep(order.waiting.pop(n))
        if isinstance(e, WorkersGone):
            raise UserError(f"{e}; the finished cells are saved; {resume or 'rerun with --resume to finish'}") from None
        raise
    finally:
        progress.close()


# ---- bench -----------------------------------------------------------------------------------------------


def bench_passes(pool: Pool, plist: list, params: Any, *, runs: int, warmup: int, ignore: bool, batch_size: int,
                 out: list) -> tuple[int, str]:
    """`measure.bench.measure` with the prompts in one contiguous shard per worker, all at once; pass r of every
    shard merged into one `Pass` (appended to `out`). Returns the largest worker's peak memory. A death runs the
    whole batch size again: a row never mixes passes that did not run side by side."""
    try:
        while True:
            pool.settle()  # replacements loaded first: every shard starts at once
            n = min(len(pool.actors), len(plist))
            bounds = [len(plist) * k // n for k in range(n + 1)]
            chunks = [(plist[a:b], params, runs, warmup, ignore, batch_size) for a, b in zip(bounds, bounds[1:])]
            progress = ProgressLine(len(chunks), "shards")
            shards: list[Any] = [None] * len(chunks)
            deaths = pool.deaths
            try:
                for k, got in pool.run("bench", chunks, progress=progress, whole=True):
                    shards[k] = got
                if pool.deaths == deaths:
                    break
                progress.note(f"dgemma: ray: a worker died during batch size {batch_size}: all its shards run "
                              "again, side by side")
            finally:
                progress.close()
    except WorkersGone as e:
        raise WorkersGone(f"{e}; batch size {batch_size} was not measured: rerun the bench", e.last) from None
    out.extend(merge_pass([s["passes"][r] for s in shards]) for r in range(runs))
    peak = max(shards, key=lambda s: s["peak_memory"][0])["peak_memory"]
    return peak[0], f"the largest of {len(shards)} Ray workers: {peak[1]}"


def merge_pass(parts: list) -> Any:
    """One timed pass from the shards' simultaneous passes: counts summed, the wall time the slowest shard's."""
    from dgcli.measure.metrics import Pass

    cat = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
    return Pass(cat("responses"), max(p.wall_s for p in parts), parts[0].batch_size,
                sum(p.decoder_passes for p in parts), sum(p.row_steps for p in parts), sum(p.denoise_s for p in parts),
                queue_s=cat("queue_s"), ttft_s=cat("ttft_s"), e2el_s=cat("e2el_s"),
                prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
                prefix_cache_hits=sum(p.prefix_cache_hits for p in parts))


def ray_fields(pool: Pool, shards: int) -> dict:
    """What a --ray bench row says about who ran it."""
    infos = list(pool.infos.values())
    return {"ray_workers": shards, "ray_devices": sorted({f"{i['device']}@{i['node']}" for i in infos}),
            "ray_cluster": pool.where}
