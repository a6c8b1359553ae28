"""`dgemma bench`: warm-up, repeats, one row per setting, the static card first, then the table, then one
JSON line. Formats md|csv|json|jsonl; --save-result writes the full JSON document (card, definitions, rows).

Owns: the bench-only flags and the order of output (one row per --batch-size). Must not: measure or format figures itself
(dgcli.measure does), or contain a denoising loop. Ctrl-C keeps the runs that finished: they are summarised and printed.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from dgcli.cli import options as o
from dgcli.cli.console import HEADLINE, budget_note, document, emit, loading, status, warn
from dgcli.errors import UserError

FORMATS = ("md", "csv", "json", "jsonl")
EXAMPLES = ["dgemma bench --runs 3 --format md",
            "dgemma bench --batch-size 1,2,4,8 --runs 3",
            "dgemma bench --dummy 26B-A4B --layers 4 --device cuda --diffusion-steps 16",
            "dgemma bench --label base --metadata gpu=h100 --result-dir results/"]


def bench(
    model: o.Model = None, dummy: o.Dummy = None, layers: o.Layers = None, preset: o.Preset = None,
    device: o.Device = None, dtype: o.Dtype = None, seed: o.Seed = None, steps: o.Steps = None,
    t_min: o.TMin = None, t_max: o.TMax = None, entropy_bound: o.EntropyBound = None,
    stability_threshold: o.Stability = None, confidence_threshold: o.Confidence = None, blocks: o.Blocks = None,
    max_tokens: o.MaxTokens = None, prompts: o.Prompts = None, random_prompts: o.RandomPrompts = False,
    num_prompts: o.NumPrompts = None, random_input_len: o.InputLen = 128, ignore_eos: o.IgnoreEos = False,
    runs: Annotated[int, typer.Option("--runs", "-r", metavar="N", help="Timed passes over the prompts.")] = 3,
    warmup: o.Warmup = 1,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="FORMAT", help="md | csv | json | jsonl")] = "md",
    save_result: Annotated[bool, typer.Option("--save-result", help="Also write the JSON document to a file (--result-dir and --result-filename imply it).")] = False,
    result_dir: Annotated[Optional[str], typer.Option("--result-dir", metavar="DIR", help=o.dflt("Implies --save-result; the folder to write to.", "."))] = None,
    result_filename: Annotated[Optional[str], typer.Option("--result-filename", metavar="NAME", help=o.dflt("Implies --save-result; the file name to use.", "a dated name"))] = None,
    batch_size: o.BatchSizes = "1",
    label: o.Label = None, metadata: o.Metadata = None, measure_peaks: o.MeasurePeaks = True,
    compile: o.Compile = False, threads: o.Threads = None,
) -> None:
    """Benchmark one sampler setting: labelled figures, roofline.

    Labelled throughput figures, the step-count distribution and the roofline, with provenance; one row
    per --batch-size (every timed pass submits all prompts at once to an engine with that many slots).
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    from dgcli.measure.grid import parse_batch_sizes
    from dgcli.measure.workload import check_counts

    sizes = parse_batch_sizes(batch_size)  # before the model, the card and the peak measurement
    check_counts(num_prompts=num_prompts, runs=runs, warmup=warmup, input_len=random_input_len)
    from dgcli.measure import bench as b
    from dgcli.measure import metrics
    from dgcli.measure import printers as report
    from dgcli.measure.quality import bench_quality
    from dgcli.measure.workload import build_prompts
    from dgcli.runtime.session import open_any
    meta = report.parse_metadata(metadata)
    flags = o.sampler_flags(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                            stability=stability_threshold, confidence=confidence_threshold, seed=seed,
                            blocks=blocks, device=device, dtype=dtype, max_tokens=max_tokens)
    baseline = b.PeakMemory.maxrss()  # before the model exists, for the CPU peak-memory figure
    with loading("loading the model…"):
        s = open_any(model, dummy, layers, preset, flags, warn=warn, compile=compile, threads=threads)
    params = s.params
    plist, source = build_prompts(s, prompts_file=prompts, random_ids=random_prompts or s.dummy,
                                  num_prompts=num_prompts, input_len=random_input_len, seed=params.seed, warn=warn)
    if s.dummy and not ignore_eos:
        warn("dgemma: note: --ignore-eos is on: random weights would hit stop ids at random")
    ignore = ignore_eos or s.dummy
    peaks = b.device_peaks(s.device, measure_cpu=measure_peaks)
    longest = max(len(p.ids) for p in plist)
    card = b.target_card(s, prompt_len=round(sum(len(p.ids) for p in plist) / len(plist)),
                         context=longest + s.num_blocks * s.config.canvas_length, peaks=b.peaks_for_card(peaks))
    card_text = "# dgemma bench\n\n" + report.card_markdown(card)
    if fmt == "md":
        sys.stdout.write(card_text + "\n")
        sys.stdout.flush()
    else:
        sys.stderr.write(card_text + "\n")

    live, progress = status(sys.stderr.isatty(), compiling=s.compiled)
    rows, last, interrupted = [], None, False
    try:
        for size in sizes:  # one row per batch size, each with its own warm-up and timed passes
            memory = b.PeakMemory(s.device, baseline)
            done: list = []
            try:
                b.measure(s, plist, params, runs=runs, warmup=warmup, ignore_eos=ignore, batch_size=size,
                          memory=memory, progress=progress, out=done)
            except KeyboardInterrupt:
                interrupted = True
                if done:
                    warn(f"dgemma: interrupted: reporting the {len(done)} finished run(s) of {runs} at batch size {size}")
            if done:
                summary = metrics.summarize(done, s.config, params.max_denoising_steps, weight_bytes=b.weight_bytes(s),
                                            peaks=peaks, peak_memory=memory.read())
                summary.update(bench_quality(plist, [p.responses for p in done]))
                rows.append(b.make_row(s, prompts=plist, prompt_source=source, params=params, runs_done=len(done),
                                       runs_asked=runs, warmup=warmup, ignore_eos=ignore, summary=summary,
                                       label=label, metadata=meta))
                last = done[-1].responses
            if interrupted:
                break
    finally:
        if live is not None:
            live.stop()
    if not rows:
        warn("dgemma: interrupted before the first run finished; nothing to report")
        raise SystemExit(130)  # not typer.Exit: under standalone_mode=False click returns its code unraised
    if interrupted and len(rows) < len(sizes):
        warn(f"dgemma: interrupted: batch size(s) {', '.join(map(str, sizes[len(rows):]))} not measured")
    headline = HEADLINE
    if len(sizes) > 1:  # the rows differ by batch size: say so next to the settings
        at = HEADLINE.index("blocks") + 1
        headline = HEADLINE[:at] + ["batch_size"] + HEADLINE[at:]
        at = headline.index("output_throughput") + 1
        headline = headline[:at] + ["request_throughput", "p99_e2el_ms", "slot_occupancy"] + headline[at:]
    emit(rows, card=card, fmt=fmt, title="Results", headline=headline)
    if not ignore:  # fixed work runs every block on purpose; otherwise say once if answers were cut short
        # every pass runs the same prompts with the same seed: the same answers, at every batch size
        note = budget_note(s, sum(r.finish_reason == "length" for r in last), len(last))
        if note:
            warn(note)
    if save_result or result_dir is not None or result_filename is not None:  # naming a place means "save it"
        path = report.save_result(document(card, rows), result_dir, result_filename, label)
        warn(f"dgemma: saved {path}")
    if interrupted:
        raise SystemExit(130)
