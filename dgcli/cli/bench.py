"""`dgemma bench`: warm-up, repeats, one row per setting, the static card first, then the table, then one
JSON line. Formats md|csv|json|jsonl; --save-result writes the full JSON document (card, definitions, rows).

Owns: the bench flags (the ones bench, sweep and info share are declared here once and imported by them)
and the order of output. Must not: measure or format figures itself (dgcli.measure.bench, dgcli.measure.printers do), or
contain a denoising loop. Ctrl-C keeps the runs that finished: they are summarised and printed.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from dgcli.cli import options as o
from dgcli.errors import UserError

FORMATS = ("md", "csv", "json", "jsonl")

# Shared by bench, sweep and info.
Dummy = Annotated[Optional[str], typer.Option(
    "--dummy", help="Random weights for a config.json path (or the word 26B-A4B, the shipped config): no weights read; fixed-work mode.")]
Layers = Annotated[Optional[int], typer.Option("--layers", help="Keep only the first N layers of a --dummy config (last forced to full attention).")]
Prompts = Annotated[Optional[str], typer.Option("--prompts", help="JSONL prompt file ({\"prompt\", \"answer\"?} per line; default: the bundled prompt set).")]
RandomPrompts = Annotated[bool, typer.Option("--random-prompts", help="Use random token ids as prompts (a loud warning: early stopping behaves differently).")]
NumPrompts = Annotated[Optional[int], typer.Option("--num-prompts", help="Use the first N prompts (random prompts: N, default 4).")]
InputLen = Annotated[int, typer.Option("--random-input-len", help="Length of random-id prompts.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Never stop at a stop id: every request runs all its blocks (forced for --dummy).")]
Warmup = Annotated[int, typer.Option("--warmup", "--num-warmups", help="Untimed warm-up requests first.")]
Label = Annotated[Optional[str], typer.Option("--label", help="A name for the row(s).")]
Metadata = Annotated[Optional[list[str]], typer.Option("--metadata", help="KEY=VALUE recorded in every row's provenance (repeatable).")]
MeasurePeaks = Annotated[bool, typer.Option("--measure-peaks/--no-measure-peaks", help="Measure this CPU's matmul and bandwidth peaks (~1 s) for the roofline.")]

HEADLINE = ["mode", "max_denoising_steps", "blocks", "output_throughput", "diffusion_committed_throughput",
            "diffusion_canvas_positions_per_s", "mean_ttft_ms", "mean_step_ms", "diffusion_committed_per_step",
            "diffusion_steps_per_canvas", "p90_steps_per_block", "cap_hit_rate", "peak_memory_bytes", "step_vs_floor"]


def warn(msg: str) -> None:
    print(msg, file=sys.stderr)


def status(enabled: bool):
    """A one-line progress display on stderr when it is a terminal; a no-op otherwise."""
    if not enabled:
        return None, lambda text: None
    from rich.console import Console
    from rich.status import Status

    live = Status("…", console=Console(stderr=True))
    live.start()
    return live, lambda text: live.update(text)


def bench(
    model: o.Model = None, dummy: Dummy = None, layers: Layers = None, preset: o.Preset = None,
    device: o.Device = None, dtype: o.Dtype = None, seed: o.Seed = None, steps: o.Steps = None,
    t_min: o.TMin = None, t_max: o.TMax = None, entropy_bound: o.EntropyBound = None,
    stability_threshold: o.Stability = None, confidence_threshold: o.Confidence = None, blocks: o.Blocks = None,
    max_tokens: o.MaxTokens = None, prompts: Prompts = None, random_prompts: RandomPrompts = False,
    num_prompts: NumPrompts = None, random_input_len: InputLen = 128, ignore_eos: IgnoreEos = False,
    runs: Annotated[int, typer.Option("--runs", "-r", help="Timed passes over the prompts.")] = 3,
    warmup: Warmup = 1,
    fmt: Annotated[str, typer.Option("--format", "-f", help="md | csv | json | jsonl")] = "md",
    save_result: Annotated[bool, typer.Option("--save-result", help="Also write the JSON document to --result-dir.")] = False,
    result_dir: Annotated[Optional[str], typer.Option("--result-dir", help="Folder for --save-result (default: .).")] = None,
    result_filename: Annotated[Optional[str], typer.Option("--result-filename", help="File name for --save-result.")] = None,
    label: Label = None, metadata: Metadata = None, measure_peaks: MeasurePeaks = True,
    compile: o.Compile = False,
) -> None:
    """Benchmark one sampler setting: labelled throughput figures, step-count distribution, roofline."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    from dgcli.measure import bench as b
    from dgcli.measure import printers as report
    meta = report.parse_metadata(metadata)
    flags = o.sampler_flags(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                            stability=stability_threshold, confidence=confidence_threshold, seed=seed,
                            blocks=blocks, device=device, dtype=dtype, max_tokens=max_tokens)
    baseline = b.PeakMemory.maxrss()  # before the model exists, for the CPU peak-memory figure
    target = b.open_target(model, dummy, layers, preset, flags, warn=warn, compile=compile)
    s = target.session
    params = s.params
    plist, source = b.build_prompts(s, prompts_file=prompts, random_ids=random_prompts or target.dummy,
                                    num_prompts=num_prompts, input_len=random_input_len, seed=params.seed, warn=warn)
    if target.dummy and not ignore_eos:
        warn("dgemma: note: --ignore-eos is on: random weights would hit stop ids at random")
    ignore = ignore_eos or target.dummy
    peaks = b.device_peaks(s.device, measure_cpu=measure_peaks)
    longest = max(len(p.ids) for p in plist)
    card = b.target_card(target, prompt_len=round(sum(len(p.ids) for p in plist) / len(plist)),
                         context=longest + s.num_blocks * s.config.canvas_length, peaks=b.peaks_for_card(peaks))
    card_text = "# dgemma bench\n\n" + report.card_markdown(card)
    if fmt == "md":
        sys.stdout.write(card_text + "\n")
        sys.stdout.flush()
    else:
        sys.stderr.write(card_text + "\n")

    memory = b.PeakMemory(s.device, baseline)
    live, progress = status(sys.stderr.isatty())
    done: list = []
    try:
        b.measure(s, plist, params, runs=runs, warmup=warmup, ignore_eos=ignore, memory=memory,
                  progress=progress, out=done)
    except KeyboardInterrupt:
        if not done:
            warn("dgemma: interrupted before the first run finished; nothing to report")
            raise SystemExit(130)  # not typer.Exit: under standalone_mode=False click returns its code unraised
        warn(f"dgemma: interrupted: reporting the {len(done)} finished run(s) of {runs}")
    finally:
        if live is not None:
            live.stop()
    summary = b.summarize(done, s.config, params.max_denoising_steps, weight_bytes=b.weight_bytes(s), peaks=peaks,
                          peak_memory=memory.read())
    row = b.make_row(target, prompts=plist, prompt_source=source, params=params, runs_done=len(done),
                     runs_asked=runs, warmup=warmup, ignore_eos=ignore, summary=summary, label=label, metadata=meta)
    emit([row], card=card, fmt=fmt, title="Results")
    if save_result:
        path = report.save_result(document(card, [row]), result_dir, result_filename, label)
        warn(f"dgemma: saved {path}")
    if len(done) < runs:
        raise SystemExit(130)


def document(card: dict, rows: list[dict]) -> dict:
    from dgcli.measure.bench import DEFINITIONS

    return {"card": card, "definitions": DEFINITIONS, "rows": rows}


def emit(rows: list[dict], *, card: dict, fmt: str, title: str, headline: list[str] = HEADLINE) -> None:
    """Print rows in the chosen format on stdout (the card was printed first)."""
    from dgcli.measure import printers as report
    from dgcli.measure.bench import DEFINITIONS, NOT_IN_CSV

    if fmt == "md":
        sys.stdout.write(report.to_markdown(rows, headline=headline, definitions=DEFINITIONS, title=title,
                                            skip=NOT_IN_CSV) + "\n")
        sys.stdout.write(report.headline_json(rows, ["label"] + headline) + "\n")
    elif fmt == "csv":
        sys.stdout.write(report.to_csv(rows, skip=NOT_IN_CSV))
    elif fmt == "jsonl":
        sys.stdout.write(report.to_jsonl(rows))
    else:
        sys.stdout.write(report.to_json(document(card, rows)))
    sys.stdout.flush()
