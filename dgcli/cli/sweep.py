"""`dgemma sweep`: a grid over sampler settings, several seeds per cell, speed and quality per cell, rows
appended to a JSONL file as each cell finishes; then the varying columns, the Pareto frontier, an optional plot.

Owns: the sweep flags (grid specs `8,16,32`, `a-b+step`) and the order of work (plan, reference outputs for
agreement, warm-up, cells) and of output. Must not: measure or decide figures (dgcli.measure does), or run a
denoising loop. Ctrl-C keeps the finished cells in the file (`-o FILE --resume` continues it); without -o each
run writes a new `sweep-YYYYmmdd-HHMMSS.jsonl` here, named on stderr at the start and the end.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

import dgcli.cli.options as o
from dgcli.cli.console import check_writable, emit, status, warn
from dgcli.errors import UserError


def _grid(flag: str, *aliases: str, what: str, eg: str):
    return Annotated[Optional[str], typer.Option(flag, *aliases, metavar="GRID", help=f"{what}: a comma list and/or ranges a-b+step, e.g. {eg}.")]


EXAMPLES = ["dgemma sweep --diffusion-steps 8,16,32,48 --seeds 0,1 --plot frontier.svg",
            "dgemma sweep --entropy-bound 0.05-0.2+0.05 --dry-run",
            "dgemma sweep --diffusion-steps 8,48 --batch-size 1,4",
            "dgemma sweep --diffusion-steps 8,16,32,48 -o sweep-20261125-183012.jsonl --resume   # after Ctrl-C"]
TABLE_FIGURES = ["output_throughput", "diffusion_committed_throughput", "diffusion_steps_per_canvas",
                 "p90_steps_per_block", "cap_hit_rate", "mean_step_ms", "quality"]


def sweep(
    model: o.Model = None, dummy: o.Dummy = None, layers: o.Layers = None, preset: o.Preset = None,
    device: o.Device = None, dtype: o.Dtype = None, max_tokens: o.MaxTokens = None,
    steps: _grid("--diffusion-steps", "--max-denoising-steps", what="Most denoising steps per block", eg="8,16,32 or 8-48+8") = None,
    t_min: _grid("--t-min", what="Asymptotic temperature", eg="0.2-0.4+0.1") = None,
    t_max: _grid("--t-max", what="First-step temperature", eg="0.6,0.8,1.0") = None,
    entropy_bound: _grid("--entropy-bound", what="Accept rule bound", eg="0.05,0.1,0.2") = None,
    stability_threshold: _grid("--stability-threshold", what="Equal argmax canvases to stop", eg="0,1,2") = None,
    confidence_threshold: _grid("--confidence-threshold", what="Mean-entropy stop threshold", eg="0,0.005,0.05") = None,
    blocks: _grid("--blocks", "--diffusion-blocks", what="Most blocks per request", eg="1,2,4") = None,
    seeds: Annotated[str, typer.Option("--seeds", metavar="GRID", help="Seeds run in every cell (grid syntax), e.g. 0,1,2.")] = "0",
    prompts: o.Prompts = None, random_prompts: o.RandomPrompts = False, num_prompts: o.NumPrompts = None,
    random_input_len: o.InputLen = 128, ignore_eos: o.IgnoreEos = False, warmup: o.Warmup = 1,
    runs: Annotated[int, typer.Option("--runs", "-r", metavar="N", help="Timed passes over the prompts per seed: each cell's figures get a min-max spread over seeds x runs; cells whose spreads overlap (or measured once) are a tie, never a winner.")] = 3,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="FILE", help="JSONL file the rows are appended to; an existing FILE needs --resume. Default: a new sweep-YYYYmmdd-HHMMSS.jsonl here per run, named on stderr.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue -o FILE: skip the cells it already holds.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and exit (nothing is loaded or run).")] = False,
    plot: Annotated[Optional[str], typer.Option("--plot", metavar="FILE", help="Write the speed-quality frontier plot (FILE.svg, or FILE.png with matplotlib).")] = None,
    speed: Annotated[str, typer.Option("--speed-metric", metavar="NAME", help="The frontier's speed figure.")] = "output_throughput",
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="FORMAT", help="md | csv | json | jsonl (the final rows)")] = "md",
    batch_size: o.BatchSizes = "1",
    label: o.Label = None, metadata: o.Metadata = None, measure_peaks: o.MeasurePeaks = True,
    peaks_file: o.PeaksFile = None, save_peaks: o.SavePeaks = None,
    compile: o.Compile = False, cuda_graphs: o.CudaGraphs = None, threads: o.Threads = None,
    no_prefix_caching: o.NoPrefixCaching = False,
    ray: o.Ray = None, ray_workers: o.RayWorkers = None, ray_gpus: o.RayGpus = None,
) -> None:
    """Sweep sampler settings: speed, quality, Pareto frontier.

    Per cell speed and quality, rows appended to a resumable JSONL file, then the Pareto frontier.
    """
    from dgcli.measure.grid import parse_batch_sizes
    from dgcli.measure.workload import check_counts

    sizes = parse_batch_sizes(batch_size)  # --dry-run too
    check_counts(num_prompts=num_prompts, runs=runs, warmup=warmup, input_len=random_input_len)  # --dry-run too
    from dgcli.cluster import check_flags  # torch-free

    check_flags(ray, ray_workers, ray_gpus)  # --dry-run too
    from dgcli.measure.peaks import check_peak_flags  # torch-free

    check_peak_flags(peaks_file, save_peaks, measure_peaks, ray)  # --dry-run too
    from dgcli.measure import printers as report
    from dgcli.measure import sweep as sw  # (torch-free: the grid is checked before torch loads)
    from dgcli.measure.metrics import DEFINITIONS, IMAGE_FIGURES
    from dgcli.runtime import preflight

    if fmt not in ("md", "csv", "json", "jsonl"):
        raise UserError(f"--format {fmt}: use one of md, csv, json, jsonl")
    if speed not in DEFINITIONS or speed in IMAGE_FIGURES or speed.startswith(("quality", "exact", "agree")):
        raise UserError(f"--speed-metric {speed}: use a figure such as output_throughput or diffusion_committed_throughput")
    if threads is not None:
        preflight.check_threads(threads)
    axes = sw.parse_axes({"max_denoising_steps": steps, "t_min": t_min, "t_max": t_max, "entropy_bound": entropy_bound,
                          "stability_threshold": stability_threshold, "confidence_threshold": confidence_threshold,
                          "max_blocks": blocks})
    axes[sw.BATCH] = sizes
    seed_list = sw.parse_seeds(seeds)
    if plot:
        sw.check_plot_path(plot)
        check_writable("--plot", plot, "frontier.svg")
    meta = report.parse_metadata(metadata)
    single = {k: v[0] for k, v in axes.items() if len(v) == 1 and k != sw.BATCH}  # the values every cell shares
    if len(axes.get("max_blocks", [])) > 1 and min(axes["max_blocks"]) > 0:
        # Swept block counts are flags too: they outrank the checkpoint's token budget (settings.resolve),
        # so a cell of 8 blocks is 8 canvases of answer; each cell sets its own count over this one.
        single["max_blocks"] = max(axes["max_blocks"])
    flags = o.sampler_flags(seed=seed_list[0], blocks=single.pop("max_blocks", None), device=device, dtype=dtype,
                            max_tokens=max_tokens) | single
    fresh = output is None  # the file is named per run: a dry run only says so
    output = _row_file(output, resume)
    check_writable("--output", output, "sweep.jsonl")  # now, not after the first cell
    store = sw.RowStore(output)
    if store.path.exists() and store.path.stat().st_size and not (resume or dry_run):
        raise UserError(f"--output {output} exists: add --resume to continue it, or choose another --output")

    if dry_run:
        where = "a new sweep-YYYYmmdd-HHMMSS.jsonl (named when the sweep starts)" if fresh else str(store.path)
        resolve, name, canvas = _resolver(model, dummy, layers, preset)
        flags = sw.base_flags(resolve, flags, axes)
        done = {r.get("cell_key") for r in store.load()} if resume else set()
        print("\n".join(sw.plan_lines(resolve(flags), name, canvas, axes, seed_list, done, where)))
        return
    if any(len(axes.get(k, [])) > 1 for k in ("t_min", "t_max")):  # before loading: see sw.base_flags
        flags = sw.base_flags(_resolver(model, dummy, layers, preset)[0], flags, axes)

    from dgcli.cli.bench import open_target, target_card
    from dgcli.measure import bench as b
    from dgcli.measure.workload import build_prompts, prompt_set_hash

    baseline = b.PeakMemory.maxrss()  # before the model exists, for the CPU peak-memory figure
    s, pool, ray_peaks, _ = open_target(
        ray, ray_workers, ray_gpus, sizes, dict(model=model, dummy=dummy, layers=layers, preset=preset, flags=flags,
                                                compile=compile, threads=threads, cuda_graphs=cuda_graphs),
        prompts=prompts, random_prompts=random_prompts, num_prompts=num_prompts, measure_peaks=measure_peaks,
        prefix_caching=not no_prefix_caching)
    plist, source = build_prompts(s, prompts_file=prompts, random_ids=random_prompts or s.dummy,
                                  num_prompts=num_prompts, input_len=random_input_len, seed=seed_list[0], warn=warn)
    ignore = ignore_eos or s.dummy
    cells, skipped = sw.plan(s.params, axes)
    for values, why in skipped:
        warn(f"dgemma: note: cell {values} skipped: {why}")
    if not cells:
        raise UserError("the grid has no possible cell; check the axis values (e.g. t_min <= t_max)")
    answered = [p for p in plist if p.answer is not None]
    quality_metric = "exact_match" if answered and s.tokenizer is not None else "agreement"
    swept = {k for k, v in axes.items() if len(v) > 1}  # single values are part of the fixed settings
    fixed = {k: v for k, v in s.resolved.as_dict()["params"].items() if k not in swept and k != "seed"}
    if sw.BATCH not in swept:  # one batch size is the whole sweep's (several: each cell's key has its own)
        fixed[sw.BATCH] = sizes[0]
    fp = sw.fingerprint({"model": str(s.path), "name": s.name, "dtype": s.dtype_name,
                         "device": s.device.type, "prompts": prompt_set_hash(plist), "fixed": fixed,
                         "seeds": seed_list, "runs": runs, "ignore_eos": ignore, "quality": quality_metric})
    rows = store.load(warn) if resume else []
    foreign = [r for r in rows if r.get("sweep_fingerprint") != fp]
    if foreign:
        raise UserError(f"--resume {output}: the file was written by a different sweep (model, prompts, seeds or "
                        "fixed settings differ); rerun with those settings or choose another --output")
    done_keys = {r["cell_key"] for r in rows if r.get("kind") == "cell"}
    todo = [c for c in cells if c.key not in done_keys]
    if resume and not todo:  # no peaks, card or table again: the file already holds every cell
        warn(f"dgemma: nothing left to run: all {len(cells)} cell(s) are already in {output}")
        if pool is not None:
            pool.close()
        return

    peaks, card = target_card(s, plist, pool, ray_peaks, measure_peaks=measure_peaks, peaks_file=peaks_file,
                              save_peaks=save_peaks)
    (sys.stdout if fmt == "md" else sys.stderr).write("# dgemma sweep\n\n" + report.card_markdown(card) + "\n")
    where = f"dgemma: sweep rows in {output} (resume with -o {output} --resume)"
    warn(where)  # once the model loaded: a bad flag or model is still one error line
    warn(f"dgemma: {len(cells)} cell(s) x {len(seed_list)} seed(s) x {len(plist)} prompt(s); "
         f"{len(cells) - len(todo)} already in {output}, {len(todo)} to run; quality = {quality_metric}")

    live, progress = status(sys.stderr.isatty() and pool is None, compiling=s.compiled)
    try:
        if pool is not None:
            from dgcli.cluster import jobs

            reference = sw.reference_outputs(rows, store, quality_metric,
                                             lambda: pool.call("reference", plist, ignore, fp))
            cell_rows = jobs.sweep_cells(pool, todo, plist, source, seed_list, runs, ignore, quality_metric, reference,
                                         label, meta, fp, warmup=warmup, warm_batch=max(sizes),
                                         measure_peaks=measure_peaks, keep=store.append,
                                         resume=f"rerun the same command with -o {output} --resume to finish")
        else:
            reference = sw.reference_outputs(rows, store, quality_metric,
                                             lambda: sw.reference_row(s, plist, ignore, fp, progress))
            if todo:  # the batched path the cells take, at the largest batch size
                b.warm_up(s, plist, s.params, warmup, batch_size=max(sizes), ignore_eos=ignore, progress=progress)
            cell_rows = (sw.run_cell(s, cell, plist, source, seed_list, runs, ignore, quality_metric, reference,
                                     peaks, b.PeakMemory(s.device, baseline), label, meta, fp, progress) for cell in todo)
        for n, (cell, row) in enumerate(zip(todo, cell_rows), 1):
            store.append(row)
            rows.append(row)
            warn(f"dgemma: cell {n}/{len(todo)} {sw.cell_label(row, list(cell.values))}: "
                 f"{speed}={report.fmt(row.get(speed))} quality={report.fmt(row.get('quality'))}")
    except KeyboardInterrupt:
        kept = sum(r.get("kind") == "cell" for r in store.load())  # the file, not memory: it is the truth
        warn(f"dgemma: interrupted: {kept} of {len(cells)} cell(s) are saved in {output}; "
             f"rerun the same command with -o {output} --resume to continue")
        raise SystemExit(130)  # not typer.Exit: under standalone_mode=False click returns its code unraised
    finally:
        if live is not None:
            live.stop()
        if pool is not None:
            pool.close()
    _finish(rows, cells, axes, speed, plot, fmt, card, output)
    if not ignore:
        _budget_note(rows, cells)
    warn(where)  # again at the end: the start's line has scrolled away under the progress and the table


def _row_file(output: str | None, resume: bool) -> str:
    """--output as given, else a fresh per-run name; --resume needs the file named (it continues one run)."""
    from pathlib import Path

    from dgcli.measure import sweep as sw

    if output is not None:
        return output
    if resume:
        runs = sorted(Path(".").glob("sweep-*.jsonl"), key=lambda p: p.stat().st_mtime)
        eg = runs[-1].name if runs else "sweep-YYYYmmdd-HHMMSS.jsonl"
        raise UserError(f"--resume needs the file to continue: add -o FILE (the name the run printed, e.g. -o {eg})")
    return str(sw.fresh_row_file())


def _budget_note(rows: list[dict], cells: list) -> None:
    """Once, at the end: how many cells had answers end at their token budget rather than at a stop id."""
    wanted = {c.key for c in cells}
    cut = [r for r in rows if r.get("kind") == "cell" and r.get("cell_key") in wanted and r.get("finish_length_rate")]
    if cut:
        worst = max(r["finish_length_rate"] for r in cut)
        warn(f"dgemma: note: in {len(cut)} of {len(wanted)} cell(s) answers ended at the token budget (finish_length_rate "
             f"up to {worst:.2f}); raise it with --max-tokens or --blocks")


def _resolver(model, dummy, layers, preset):
    """(flags -> the resolved settings, the model's name, its canvas length), from the config files alone."""
    from dgcli.runtime.preflight import settings_source
    from dgcli.runtime.settings import resolve

    path, cfg, gen, forced = settings_source(model, dummy, layers)
    return lambda flags: resolve(gen, preset, {**flags, **forced}), getattr(path, "name", path), cfg.canvas_length


def _finish(rows, cells, axes, speed, plot, fmt, card, output) -> None:
    from dgcli.measure import printers as report
    from dgcli.measure import sweep as sw
    from dgcli.measure.metrics import DEFINITIONS
    wanted = {c.key for c in cells}
    done = [r for r in rows if r.get("kind") == "cell" and r.get("cell_key") in wanted]
    keys = sw.swept_keys(axes)
    front = sw.mark_frontier(done, speed)
    if plot:
        path = sw.write_plot(plot, done, front, speed, "quality", title=f"speed vs quality ({len(done)} cells)",
                             label=lambda r: sw.cell_label(r, keys))
        warn(f"dgemma: plot written to {path}")
    if fmt != "md":
        emit(done, card=card, fmt=fmt, title="Sweep")
        return

    def span(r: dict, key: str) -> str:
        iv = sw.interval(r, key)
        return "-" if iv is None else f"{report.fmt(r.get(key))} [{report.fmt(iv[0])}, {report.fmt(iv[1])}]"

    cols = [k for k in report.varying_keys(done, keys)] or keys
    figures = [f for f in TABLE_FIGURES if f not in (speed, "quality")]
    header = ["cell"] + cols + [f"{speed} [min, max]", "quality [min, max]"] + figures + ["pareto"]
    body = [[sw.cell_label(r, keys)] + [report.fmt(r["cell"].get(k)) for k in cols] + [span(r, speed), span(r, "quality")]
            + [report.fmt(r.get(f)) for f in figures]
            + [("tie" if r["pareto_ties"] else "*") if r["pareto"] else ""] for r in done]
    passes = max((r.get("spread_passes") or 1 for r in done), default=1)
    one = ("; one timed pass per cell measures no spread, so no speed difference separates two cells: add --runs 3"
           if passes < 2 else "")
    out = [f"## Sweep: {len(done)} cell(s) from {output}", "", report.md_table(header, body), "",
           f"### Pareto frontier ({speed} vs quality; * above, tie where the measurements name no winner)", "",
           f"[min, max] over each cell's {passes} timed pass{'es' if passes != 1 else ''} (seeds x runs). A cell leaves the frontier only for "
           "one whose interval lies wholly above its own on a figure; cells that no interval separates are a tie "
           f"(more --runs or --seeds narrow the intervals){one}.", ""]
    for r in front:
        near = "; ".join(sw.cell_label({"cell": c}, keys) for c in r["pareto_ties"])
        out.append(f"- {sw.cell_label(r, keys)}: {speed} {span(r, speed)}, quality {span(r, 'quality')}"
                   + (f" tie with {near}" if near else ""))
    if not front:
        out.append("(no cell has both figures)")
    out += ["", "Definitions: " + "; ".join(f"`{k}`: {DEFINITIONS.get(k, '')}" for k in [speed, "quality"] + figures + ["spread"])]
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.write(report.headline_json([{"cells": len(done), "frontier": [
        {**r["cell"], speed: r.get(speed), "quality": r.get("quality"), f"{speed}_interval": sw.interval(r, speed),
         "quality_interval": sw.interval(r, "quality"), "overlaps": r["pareto_overlaps"], "ties": r["pareto_ties"]}
        for r in front]}],
        ["cells", "frontier"]) + "\n")
