"""Sweeps over sampler settings: the grid of cells, the resumable row file, the speed-quality frontier, running a
cell through `dgcli.measure.bench.measure` (the request API).

Owns: axis specs -> cells (the Cartesian product of the sampler axes and --batch-size; a value impossible alone
refused, impossible combinations set aside with the reason), the flags a sweep opens with and its --dry-run plan,
each cell's key, the sweep's fingerprint (what must match for --resume), the JSONL store and the frontier. Must not:
print (dgcli.cli.sweep does), time requests itself, or contain a denoising loop.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dgcli.errors import UserError
from dgcli.measure.grid import parse_grid_values
from dgcli.measure.plot import check_plot_path, write_plot  # noqa: F401  (re-exported: the sweep's plot)
from dgcli.measure.quality import agreement, exact_match, pass_exact_match, quality_of  # noqa: F401
from dgcli.sampling.params import CLI_FLAG, DiffusionEbParams, SettingsError

# Sweepable settings, in table order: preset key -> value type.
AXES: dict[str, type] = {"max_denoising_steps": int, "t_min": float, "t_max": float, "entropy_bound": float,
                         "stability_threshold": int, "confidence_threshold": float, "max_blocks": int}
# The run axis after them: the engine's slots (--batch-size). Not a sampler setting: answers do not depend on it.
BATCH = "batch_size"
ALL_AXES = (*AXES, BATCH)


@dataclass(frozen=True)
class Cell:
    values: dict  # axis key -> value, for the axes with more than one value (batch_size among them)
    params: DiffusionEbParams  # the full settings of the cell (seed: the sweep's first seed)
    key: str  # canonical JSON of `values`: a cell's identity in the row file
    batch_size: int = 1  # the engine's slots the cell's passes run with


def parse_axes(specs: dict[str, str | None]) -> dict[str, list]:
    """{key: spec or None} -> {key: values}; a bad spec is one line naming the flag."""
    out = {}
    for key, spec in specs.items():
        if spec is None:
            continue
        try:
            out[key] = parse_grid_values(str(spec), AXES[key])
        except UserError as e:
            raise UserError(f"{CLI_FLAG[key]}: {e}") from None
        for value in out[key]:
            _check_alone(key, value, f"{CLI_FLAG[key]} {spec}")
    return out


def _check_alone(key: str, value: Any, given: str) -> None:
    """A value no other setting makes possible (0 steps, a negative bound) is an error, as when given alone; only
    combinations (t_min >= t_max) are cells that `plan` skips."""
    try:
        DiffusionEbParams().replace(**{key: value})
    except SettingsError as e:
        if set(e.keys) != {"t_min", "t_max"}:
            raise UserError(f"{given}: {e}") from None
        if key == "t_max" and value <= 0:  # t_min >= 0 must be below it: no cell could take this value
            raise UserError(f"{given}: t_max={value}: must be above 0 (t_min, at least 0, is below it); "
                            f"set t_max (--t-max) to e.g. {DiffusionEbParams.t_max} (the default)") from None


def parse_seeds(spec: str) -> list[int]:
    try:
        seeds = parse_grid_values(spec, int)
    except UserError as e:
        raise UserError(f"--seeds: {e}") from None
    if any(s < 0 for s in seeds):
        raise UserError("--seeds: seeds must be >= 0")
    return seeds


def cell_key(values: dict) -> str:
    return json.dumps({k: values[k] for k in ALL_AXES if k in values}, separators=(",", ":"))


def swept_keys(axes: dict[str, list]) -> list[str]:
    """The axes with more than one value, in table order (the sampler settings, then batch_size)."""
    return [k for k in ALL_AXES if k in axes and len(axes[k]) > 1]


def plan(base: DiffusionEbParams, axes: dict[str, list]) -> tuple[list[Cell], list[tuple[dict, str]]]:
    """(cells, skipped): every combination of the multi-valued axes applied to `base`, and the impossible ones
    (t_min > t_max, ...) with the reason."""
    keys = swept_keys(axes)
    sizes = axes.get(BATCH) or [1]
    cells, skipped = [], []
    for combo in itertools.product(*(axes[k] for k in keys)):
        values = dict(zip(keys, combo))
        try:
            params = base.replace(**{k: v for k, v in values.items() if k != BATCH})
        except SettingsError as e:
            if values.get(BATCH, sizes[0]) == sizes[0]:  # one note per impossible setting, not per batch size
                skipped.append(({k: v for k, v in values.items() if k != BATCH}, str(e)))
            continue
        cells.append(Cell(values, params, cell_key(values), values.get(BATCH, sizes[0])))
    return cells, skipped


def base_flags(resolve: Callable[[dict], Any], flags: dict, axes: dict) -> dict:
    """The flags the session opens with, once some cell is possible. A single --t-min (or --t-max) beside a
    swept --t-max (--t-min) need not fit the checkpoint's value of the swept one, which no cell uses: then
    the first possible pair of swept values joins the flags (each cell sets its own). No possible pair, or a
    value no pair fixes: one error line."""
    pair = [k for k in ("t_min", "t_max") if len(axes.get(k, [])) > 1]
    try:
        resolve(flags)
        if not pair:
            return flags
        base = flags  # the checkpoint's values of the swept axes stay the base (agreement's reference)
    except SettingsError as e:
        if not pair or set(e.keys) != {"t_min", "t_max"}:  # not the pair's rule: no cell fixes it
            raise
        base = None
    first = None
    for combo in itertools.product(*(axes[k] for k in pair)):
        tried = dict(flags, **dict(zip(pair, combo)))
        try:
            resolve(tried)
            return tried if base is None else base
        except SettingsError as e:
            if set(e.keys) != {"t_min", "t_max"}:
                raise
            first = first or e
    raise UserError(f"no cell of the grid is possible: {first}") from None


def plan_lines(resolved: Any, name: str, canvas: int, axes: dict, seeds: list[int], done: set[str],
               where: str) -> list[str]:
    """`sweep --dry-run`'s plan: each cell with its block count and whether it is `done`, the cells set aside,
    the fixed settings."""
    from dgcli.runtime.settings import blocks_for

    cells, skipped = plan(resolved.params, axes)
    out = [f"plan: {len(cells)} cell(s) x {len(seeds)} seed(s) {seeds} on {name}; rows go to {where}"]
    keys = swept_keys(axes)
    for c in cells:
        nb = blocks_for(c.params, resolved.run.max_tokens, canvas)
        state = "done" if c.key in done else "to run"
        size = "" if BATCH in keys else f"  batch_size={c.batch_size}"
        out.append(f"  {cell_label({'cell': c.values}, keys)}  blocks={nb}{size}  [{state}]")
    out += [f"  skipped {values}: {why}" for values, why in skipped]
    base = {k: v for k, v in resolved.as_dict()["params"].items() if k not in keys}
    return out + [f"fixed settings: {base}"]


def fingerprint(parts: dict) -> str:
    """What makes two row files the same sweep: model, workload, and the settings that are not swept."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- the row file ---------------------------------------------------------------------------------------


def fresh_row_file(directory: str | Path = ".", now: float | None = None) -> Path:
    """The default --output: `sweep-YYYYmmdd-HHMMSS.jsonl` in `directory`, with `-2`, `-3`, ... while that name
    is taken, so each run starts its own file."""
    import time

    stem = time.strftime("sweep-%Y%m%d-%H%M%S", time.localtime(now))
    path, n = Path(directory) / f"{stem}.jsonl", 1
    while path.exists():
        n += 1
        path = Path(directory) / f"{stem}-{n}.jsonl"
    return path


class RowStore:
    """A JSONL file of finished rows. `append` is one O_APPEND write of the whole line, then fsync: a row
    is either on disk whole or (after a kill mid-write) a torn last line that `load` drops."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self, warn: Callable[[str], None] = lambda m: None) -> list[dict]:
        if not self.path.exists():
            return []
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{self.path}: cannot read the sweep file ({e}); fix it or choose another --output") from None
        lines = text.split("\n")
        rows, torn = [], False
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError
                rows.append(row)
            except ValueError:
                if n == len(lines) or all(not rest.strip() for rest in lines[n:]):
                    torn = True  # the last line, cut short by a kill: the cell reruns
                    continue
                raise UserError(f"{self.path}: line {n} is not a JSON row; the file is damaged: "
                                "remove that line or choose another --output") from None
        if torn or (text and not text.endswith("\n")):
            from dgcli.measure.printers import write_atomic

            warn(f"dgemma: note: {self.path}: dropped a partly written last row (the run was killed); that cell reruns")
            write_atomic(self.path, "".join(json.dumps(r, default=str) + "\n" for r in rows))
        return rows

    def append(self, row: dict) -> None:
        data = (json.dumps(row, default=str) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"--output {self.path}: cannot write ({e.strerror}); pick a writable path") from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- the frontier ----------------------------------------------------------------------------------------------


def interval(row: dict, key: str) -> tuple[float, float] | None:
    """A figure's (min, max) over the cell's timed passes (`spread`), else its single value twice."""
    sp = (row.get("spread") or {}).get(key)
    if isinstance(sp, (list, tuple)) and len(sp) == 2 and all(isinstance(v, (int, float)) for v in sp):
        return float(sp[0]), float(sp[1])
    v = row.get(key)
    return (float(v), float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def _others(front: list[dict], pair: Callable[[dict, dict], bool]) -> dict[str, list[dict]]:
    """For each frontier row (by cell_key), the cells of the other frontier rows o with pair(row, o)."""
    return {r["cell_key"]: [o["cell"] for o in front if o is not r and pair(r, o)] for r in front}


def frontier_overlaps(front: list[dict], x: str, y: str) -> dict[str, list[dict]]:
    """For each frontier row (by cell_key), the other frontier rows whose x or y interval overlaps its own (on that
    figure the passes do not separate the two)."""
    return _others(front, lambda r, o: any(_overlap(interval(r, k), interval(o, k)) for k in (x, y)))


def _beats(a: dict, b: dict, key: str, timed: bool) -> bool:
    """a is better than b on `key` beyond what the measurements spread: a's whole [min, max] above b's. A timed
    figure of a cell measured in one pass separates nothing (its interval is one point of noise)."""
    ia, ib = interval(a, key), interval(b, key)
    if ia is None or ib is None or (timed and min(a.get("spread_passes") or 1, b.get("spread_passes") or 1) < 2):
        return False
    return ia[0] > ib[1]


def separated_frontier(rows: list[dict], x: str, y: str) -> list[dict]:
    """The speed (x) - quality (y) Pareto frontier where noise decides nothing: a row leaves it only for one that
    beats it on a figure beyond both intervals (`_beats`) and is not beaten back on the other. Rows the
    measurements cannot tell apart all stay (`frontier_ties` names them); rows lacking x or y are left out."""
    pts = [r for r in rows if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]

    def better(a: dict, b: dict) -> bool:
        return _beats(a, b, x, True) or _beats(a, b, y, False)

    front = [r for r in pts if not any(o is not r and better(o, r) and not better(r, o) for o in pts)]

    return sorted(front, key=lambda r: (r[x], r[y]))


def frontier_ties(front: list[dict], x: str, y: str) -> dict[str, list[dict]]:
    """For each frontier row (by cell_key), the other frontier rows it cannot be told from: neither beats the
    other on either figure (`_beats`), so the measurements name no winner between them (a tie)."""
    return _others(front, lambda r, o: not any(_beats(a, b, k, k == x) for a, b in ((r, o), (o, r)) for k in (x, y)))


def mark_frontier(rows: list[dict], speed: str) -> list[dict]:
    """The separated frontier of `rows` (`speed` vs quality), each row marked: `pareto` (on it: no interval
    separates a better row), `pareto_overlaps`, `pareto_ties`."""
    front = separated_frontier(rows, speed, "quality")  # a difference inside the spread crowns nobody
    overlaps, ties = frontier_overlaps(front, speed, "quality"), frontier_ties(front, speed, "quality")
    for r in rows:
        r["pareto"] = r["cell_key"] in overlaps
        r["pareto_overlaps"] = overlaps.get(r["cell_key"], [])
        r["pareto_ties"] = ties.get(r["cell_key"], [])
    return front


def cell_label(row: dict, keys: list[str]) -> str:
    short = {"max_denoising_steps": "steps", "entropy_bound": "eb", "stability_threshold": "stab",
             "confidence_threshold": "conf", "max_blocks": "blocks", BATCH: "batch"}
    return " ".join(f"{short.get(k, k)}={row.get('cell', {}).get(k)}" for k in keys) or "base"


# ---- running: the reference outputs and one cell, through dgcli.measure.bench (the request API) ----------


def reference_outputs(rows: list[dict], store: RowStore, metric: str,
                      make: Callable[[], dict]) -> list[list[int]] | None:
    """Agreement's base outputs per prompt: from the file, or `make` (`reference_row`, here or on a Ray worker)
    run once and its row saved."""
    if metric != "agreement":
        return None
    for r in rows:
        if r.get("kind") == "reference":
            return r["outputs"]
    row = make()
    store.append(row)
    rows.append(row)
    return row["outputs"]


def reference_row(s: Any, plist: list, ignore: bool, fp: str, progress: Callable[[str], None]) -> dict:
    """The row of the base setting's output per prompt (`reference_outputs` saves it)."""
    from dgcli.runtime import request

    outs = []
    for i, p in enumerate(plist):
        progress(f"reference output {i + 1}/{len(plist)}")
        outs.append(request.run(s, p.ids, ignore_eos=ignore).token_ids)
    return {"kind": "reference", "sweep_fingerprint": fp, "settings": s.resolved.as_dict()["params"], "outputs": outs}


def run_cell(s: Any, cell: Cell, plist: list, source: str, seeds: list[int], runs: int, ignore: bool, metric: str,
             reference: list[list[int]] | None, peaks: Any, memory: Any, label: str | None, meta: dict, fp: str,
             progress: Callable[[str], None]) -> dict:
    """Every seed x run of one cell through the batched engine at the cell's batch size: the bench figures plus
    quality."""
    import dataclasses

    from dgcli.measure import bench as b
    from dgcli.measure import metrics
    from dgcli.runtime.settings import blocks_for

    session = dataclasses.replace(s, num_blocks=blocks_for(cell.params, s.resolved.run.max_tokens, s.config.canvas_length))
    name = cell_label({"cell": cell.values}, list(cell.values))
    all_runs, scores, per_pass = [], [], []
    memory.start()
    for seed in seeds:
        params = cell.params.replace(seed=seed)
        for one in b.measure(session, plist, params, runs=runs, warmup=0, ignore_eos=ignore, batch_size=cell.batch_size,
                             progress=lambda t: progress(f"{name} seed {seed}: {t}")):
            all_runs.append(one)
            if metric == "agreement":
                got = [agreement(req.token_ids, reference[i]) for i, req in enumerate(one.responses)]
            else:
                got = pass_exact_match(plist, one.responses)
            scores += got
            if got:
                per_pass.append(quality_of(got))
    summary = metrics.summarize(all_runs, session.config, cell.params.max_denoising_steps,
                                weight_bytes=b.weight_bytes(session), peaks=peaks, peak_memory=memory.read())
    row = b.make_row(session, prompts=plist, prompt_source=source,
                     params=cell.params, runs_done=runs, runs_asked=runs, warmup=0, ignore_eos=ignore,
                     summary=summary, label=label, metadata=meta, kind="cell")
    q = quality_of(scores)
    if per_pass:
        row["spread"]["quality"] = [min(per_pass), max(per_pass)]
    row.update({"seeds": seeds, "quality_metric": metric, "quality": q, metric: q, "cell": cell.values,
                "cell_key": cell.key, "sweep_fingerprint": fp})
    return row
