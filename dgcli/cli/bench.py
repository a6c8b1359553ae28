"""`dgemma bench`: warm-up, repeats, the static card, then one row per --batch-size (with --base-url: per
--concurrency against a server), then one JSON line; md short unless --verbose, csv/json/jsonl every field.

Owns: the bench flags and the order of work and output; Ctrl-C keeps and prints the runs that finished. Must not:
measure or format figures (dgcli.measure does), or contain a denoising loop.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

import dgcli.cli.options as o
from dgcli.cli.console import HEADLINE, counting, document, emit, loading, note_answers, status, warn
from dgcli.cli.schema import JsonObject, JsonSchema, provenance, read_schema, resolve
from dgcli.errors import UserError

FORMATS = ("md", "csv", "json", "jsonl")
EXAMPLES = ["dgemma bench --runs 3 --verbose   # every figure with its definition, the step histogram, provenance",
            "dgemma bench --batch-size 1,2,4,8 --runs 3",
            "dgemma bench --dummy 26B-A4B --layers 4 --device cuda --diffusion-steps 16",
            "dgemma bench --base-url http://127.0.0.1:8000/v1 --concurrency 1,4,16 --label serve --result-dir results/"]
REMOTE_ONLY = {"base_url", "api_key", "concurrency", "request_rate"}


def bench(
    ctx: typer.Context, model: o.Model = None, dummy: o.Dummy = None, layers: o.Layers = None, preset: o.Preset = None,
    device: o.Device = None, dtype: o.Dtype = None, seed: o.Seed = None, steps: o.Steps = None,
    t_min: o.TMin = None, t_max: o.TMax = None, entropy_bound: o.EntropyBound = None,
    stability_threshold: o.Stability = None, confidence_threshold: o.Confidence = None, blocks: o.Blocks = None,
    max_tokens: o.MaxTokens = None, prompts: o.Prompts = None, random_prompts: o.RandomPrompts = False,
    num_prompts: o.NumPrompts = None, random_input_len: o.InputLen = 128, ignore_eos: o.IgnoreEos = False,
    runs: Annotated[int, typer.Option("--runs", "-r", metavar="N", help="Timed passes over the prompts.")] = 3,
    warmup: o.Warmup = 1,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="FORMAT", help="md | csv | json | jsonl (md: the main figures; csv, json and jsonl: every field)")] = "md",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="md: the full card and every figure with its definition, the step histogram and provenance (--base-url always prints them).")] = False,
    save_result: Annotated[bool, typer.Option("--save-result", help="Also write the JSON document to a file (--result-dir and --result-filename imply it).")] = False,
    result_dir: Annotated[Optional[str], typer.Option("--result-dir", metavar="DIR", help=o.dflt("Implies --save-result; the folder to write to.", "."))] = None,
    result_filename: Annotated[Optional[str], typer.Option("--result-filename", metavar="NAME", help=o.dflt("Implies --save-result; the file name to use.", "a dated name"))] = None,
    batch_size: o.BatchSizes = "1",
    label: o.Label = None, metadata: o.Metadata = None, measure_peaks: o.MeasurePeaks = True,
    peaks_file: o.PeaksFile = None, save_peaks: o.SavePeaks = None,
    compile: o.Compile = False, cuda_graphs: o.CudaGraphs = None, threads: o.Threads = None,
    low_memory: o.LowMemory = None,
    no_prefix_caching: o.NoPrefixCaching = False,
    base_url: Annotated[Optional[str], typer.Option("--base-url", metavar="URL", help="Measure a running OpenAI-compatible server (dgemma serve, vLLM...) from the client over HTTP instead of a local model: http://HOST:PORT or http://HOST:PORT/v1.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", metavar="KEY", help="With --base-url: sent as 'Authorization: Bearer KEY'.")] = None,
    concurrency: Annotated[Optional[str], typer.Option("--concurrency", "--max-concurrency", metavar="N[,N...]", help=o.dflt("With --base-url: most requests in flight, e.g. 1,4,16; one row per value.", "1"))] = None,
    request_rate: Annotated[Optional[float], typer.Option("--request-rate", metavar="R", help=o.dflt("With --base-url: requests/s as Poisson arrivals (seeded by --seed); inf sends every prompt at once, up to --concurrency.", "inf"))] = None,
    weights: Annotated[str, typer.Option("--weights", metavar="FORMAT", help="With --dummy: bf16 | fp8 (e4m3 attention, MLP and expert matrices with per-channel scales, as an FP8-dynamic checkpoint) | nvfp4 (the same matrices in e2m1 groups of 16, kept at 4 bits; run W4A16, or W4A8 in a VNNI CPU's C) | q4_k | q8_0 (GGML blocks as a Q4_K_M / Q8_0 GGUF holds them, kept quantized; CPU). A checkpoint runs in its own format.")] = "bf16",
    fp8_activations: Annotated[bool, typer.Option("--fp8-activations", help="FP8 weights: quantize activations per token to e4m3 (vLLM's FP8-dynamic semantics) instead of dequantizing the weights (weight-only, the default); the row's fp8_semantics says which ran.")] = False,
    ray: o.Ray = None, ray_workers: o.RayWorkers = None, ray_gpus: o.RayGpus = None,
    show_config: o.ShowConfig = False,
    image: Annotated[Optional[list[str]], typer.Option("--image", metavar="FILE", help="Every timed prompt carries this image before its text (repeatable; a checkpoint with a vision tower): the row's mean_vision_ms is the tower's time per request, image_tokens_per_prompt its prompt tokens.")] = None,
    json_schema: JsonSchema = None, json_object: JsonObject = False,
) -> None:
    """Benchmark one sampler setting: labelled figures, roofline.

    Labelled throughput figures, the step-count distribution and the roofline, with provenance; one row
    per --batch-size (every timed pass submits all prompts at once to an engine with that many slots).
    With --base-url: a running server, measured from the client; one row per --concurrency.
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    if base_url is not None and ray is not None:
        raise UserError("--base-url measures a running server; --ray runs the model on a Ray cluster: give one of them")
    for given, why in ((base_url, "--base-url measures a server"), (ray, "--ray runs the model on Ray workers"),
                       (dummy, "--dummy builds random text weights without a vision tower")):
        if image and given is not None:
            raise UserError(f"--image times this machine's vision tower on a checkpoint; {why}: drop --image, "
                            "or give --model CHECKPOINT with a vision tower")
    schema = read_schema(json_schema, json_object)  # before the model loads
    if schema is not None and (base_url is not None or ray is not None or ignore_eos):
        raise UserError("--json-schema and --json draw this machine's answers under a schema, closed by a stop id: "
                        "drop them with --base-url (a server: send response_format), --ray or --ignore-eos")
    if base_url is not None and show_config:
        raise UserError("--show-config prints a local run's settings; with --base-url the server's apply: drop one")
    sampler = dict(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound, stability=stability_threshold,
                   confidence=confidence_threshold, blocks=blocks, seed=seed, max_tokens=max_tokens)
    save = (save_result or result_dir is not None or result_filename is not None, result_dir, result_filename)
    if base_url is not None:
        return _remote(ctx, base_url, api_key, concurrency, request_rate, sampler, prompts=prompts,
                       num_prompts=num_prompts, runs=runs, warmup=warmup, fmt=fmt, label=label, metadata=metadata,
                       save=save)
    from dgcli.measure.peaks import check_peak_flags  # torch-free

    check_peak_flags(peaks_file, save_peaks, measure_peaks, ray)
    from dgcli.text.images import read_files

    image_bytes = read_files(image or [], "--image")  # before the model loads
    stray = o.given(ctx, REMOTE_ONLY)
    if stray:
        raise UserError(f"{stray[0][0]} applies only with --base-url (a server); in-process bench measures --batch-size")
    if weights not in ("bf16", "fp8", "nvfp4", "q4_k", "q8_0"):
        raise UserError(f"--weights {weights}: use bf16, fp8, nvfp4, q4_k or q8_0")
    if weights in ("q4_k", "q8_0") and dummy is None:
        raise UserError(f"--weights {weights} builds --dummy weights; a GGUF file runs in its own types "
                        "(make one with `dgemma quantize SRC DST.gguf --type`)")
    if weights in ("fp8", "nvfp4") and dummy is None:
        raise UserError(f"--weights {weights} builds --dummy weights; a checkpoint runs in its own format "
                        f"(make one with `dgemma quantize SRC DST --{weights}`)")
    if fp8_activations:
        import os

        os.environ["DGEMMA_FP8"] = "dynamic"  # read by dgcli.kernels.dispatch at every FP8 matmul
    from dgcli.measure.grid import parse_batch_sizes
    from dgcli.measure.workload import check_counts

    sizes = parse_batch_sizes(batch_size)  # before the model, the card and the peak measurement
    check_counts(num_prompts=num_prompts, runs=runs, warmup=warmup, input_len=random_input_len)
    flags = o.sampler_flags(**sampler, device=device, dtype=dtype)
    from dgcli.runtime import preflight

    if not show_config and dummy is None:  # the settings from the config files, before torch (--dtype int8, ...)
        preflight.resolve_for(model, preset, flags)
    if threads is not None:
        preflight.check_threads(threads)
    from dgcli.measure import bench as b
    from dgcli.measure import brief, metrics
    from dgcli.measure import printers as report
    from dgcli.measure.quality import bench_quality, json_valid_rate
    from dgcli.measure.workload import build_prompts

    meta = report.parse_metadata(metadata)
    if show_config:
        from dgcli.cli.console import show_config as print_config

        return print_config(model, preset, flags, "text" if fmt in ("md", "csv") else "json", dummy, layers)
    if save[0]:
        report.check_result_place(result_dir, result_filename)
    baseline = b.PeakMemory.maxrss()  # before the model exists, for the CPU peak-memory figure
    s, pool, ray_peaks, fp8_row = open_target(
        ray, ray_workers, ray_gpus, sizes, dict(model=model, dummy=dummy, layers=layers, preset=preset, flags=flags,
                                                compile=compile, threads=threads, cuda_graphs=cuda_graphs),
        prompts=prompts, random_prompts=random_prompts, num_prompts=num_prompts, measure_peaks=measure_peaks,
        prefix_caching=not no_prefix_caching, weights=weights, low_memory=low_memory)
    if pool is not None:
        from dgcli.cluster import jobs
    if fp8_activations and fp8_row["weights"] != "fp8":
        warn("dgemma: note: --fp8-activations has no effect: these weights are not FP8")
    params = s.params
    images = None
    if image:  # preprocessed for the tower (one line for a checkpoint without one), before the prompts
        from dgcli.runtime.vision import read_images

        images = list(zip(read_images(s, image_bytes, [f"--image {f}" for f in image]), image))
    plist, source = build_prompts(s, prompts_file=prompts, random_ids=random_prompts or s.dummy,
                                  num_prompts=num_prompts, input_len=random_input_len, seed=params.seed, warn=warn)
    if images:
        from dgcli.measure.workload import with_images

        plist = with_images(s, plist, [x for x, _ in images])
    if s.dummy and not ignore_eos:
        warn("dgemma: note: --ignore-eos is on: random weights would hit stop ids at random")
    ignore = ignore_eos or s.dummy
    peaks, card = target_card(s, plist, pool, ray_peaks, measure_peaks=measure_peaks, peaks_file=peaks_file,
                              save_peaks=save_peaks)
    card_text = "# dgemma bench\n\n" + (report.card_markdown(card) if verbose else brief.card_text(card))
    (sys.stdout if fmt == "md" else sys.stderr).write(card_text + "\n")
    sys.stdout.flush()

    live, progress, advance = counting(sys.stderr.isatty() and pool is None, len(sizes) * runs * len(plist),
                                       compiling=s.compiled)
    rows, last, interrupted, gone = [], None, False, None
    try:
        for size in sizes:  # one row per batch size, each with its own warm-up and timed passes
            memory = b.PeakMemory(s.device, baseline)
            done: list = []
            try:
                if pool is not None:
                    ray_memory = jobs.bench_passes(pool, plist, params, runs=runs, warmup=warmup, ignore=ignore,
                                                   batch_size=size, out=done)
                else:
                    b.measure(s, plist, params, runs=runs, warmup=warmup, ignore_eos=ignore, batch_size=size,
                              memory=memory, progress=progress, out=done, advance=advance, json_schema=resolve(schema))
            except KeyboardInterrupt:
                interrupted = True
                if done:
                    warn(f"dgemma: interrupted: reporting the {len(done)} finished run(s) of {runs} at batch size {size}")
            except UserError as e:  # every --ray worker gone: the batch sizes measured before it are still reported
                if pool is None or not isinstance(e, jobs.WorkersGone) or not rows:
                    raise
                gone, done = e, []
            if done:
                summary = metrics.summarize(done, s.config, params.max_denoising_steps, weight_bytes=b.weight_bytes(s),
                                            peaks=peaks, peak_memory=memory.read() if pool is None else ray_memory)
                summary.update(bench_quality(plist, [p.responses for p in done]),
                               json_valid_rate=json_valid_rate([p.responses for p in done]) if schema else None)
                rows.append({**b.make_row(s, prompts=plist, prompt_source=source, params=params, runs_done=len(done),
                                          runs_asked=runs, warmup=warmup, ignore_eos=ignore, summary=summary,
                                          label=label, metadata=meta, images=images,
                                          schema=provenance(json_schema, schema)), **fp8_row,
                             **(jobs.ray_fields(pool, min(len(pool.actors), len(plist))) if pool is not None else {})})
                last = done[-1].responses
            if interrupted or gone is not None:
                break
    finally:
        if live is not None:
            live.stop()
        if pool is not None:
            pool.close()
    _unmeasured(rows, interrupted or gone is not None, sizes, "batch size(s)")
    headline = HEADLINE
    if len(sizes) > 1:  # the rows differ by batch size: say so next to the settings
        at = HEADLINE.index("blocks") + 1
        headline = HEADLINE[:at] + ["batch_size"] + HEADLINE[at:]
        at = headline.index("output_throughput") + 1
        headline = headline[:at] + ["request_throughput", "p99_e2el_ms", "slot_occupancy"] + headline[at:]
    if fmt == "md" and not verbose:
        sys.stdout.write(brief.rows_text(rows, summary=metrics.SUMMARY, definitions=metrics.DEFINITIONS, title="Results")
                         + "\n" + report.headline_json(rows, ["label"] + headline) + "\n")
        sys.stdout.flush()
    else:
        emit(rows, card=card, fmt=fmt, title="Results", headline=headline)
    if not ignore:  # fixed work runs every block on purpose; otherwise say once if answers were empty or cut short
        # every pass runs the same prompts with the same seed: the same answers, at every batch size
        note_answers(s, last)
    if save[0]:  # naming a place means "save it"
        warn(f"dgemma: saved {report.save_result(document(card, rows), result_dir, result_filename, label)}")
    if gone is not None:
        raise gone
    if interrupted:
        raise SystemExit(130)


def open_target(ray: str | None, ray_workers: int | None, ray_gpus: float | None, sizes: list[int], load: dict, *,
                prompts: str | None, random_prompts: bool, num_prompts: int | None, measure_peaks: bool,
                prefix_caching: bool, weights: str = "bf16", low_memory: bool | None = None):
    """bench and sweep: (the session, the Ray pool or None, the workers' peaks, the row's weight fields). With --ray
    each worker loads the model (`load`: open_any's arguments) and the session here is the driver's copy."""
    from dgcli.cluster import check_flags  # torch-free

    check_flags(ray, ray_workers, ray_gpus)
    pool = peaks = None
    if ray is not None:
        from dgcli.cluster import jobs

        pool = jobs.open_pool(ray, ray_workers, ray_gpus, jobs.spec(
            "any", **load, weights=weights, weights_fields=_fp8_fields, prefix_caching=prefix_caching), warn)
        s, peaks, fields = jobs.driver_session(pool, measure_peaks=measure_peaks, need_tokenizer=False)
        note = jobs.shared_node_note(pool)
        if note:
            warn(note)
    else:
        from dgcli.runtime.preflight import prompt_count
        from dgcli.runtime.session import fits, open_any

        random_ids = random_prompts or load["dummy"] is not None
        with loading("loading the model…"):
            slots = lambda r: min(max(sizes), prompt_count(  # noqa: E731
                r, prompts_file=prompts, random_ids=random_ids, num_prompts=num_prompts))
            s = open_any(**load, warn=warn, weights=weights, check=fits(slots, "--batch-size"), low_memory=low_memory)
        fields = _fp8_fields(s.model)
    s.prefix_caching = prefix_caching
    return s, pool, peaks, fields


def target_card(s, plist: list, pool, ray_peaks, *, measure_peaks: bool, peaks_file: str | None,
                save_peaks: str | None) -> tuple:
    """bench and sweep: (the roofline peaks, the static card) of the measured target, the peaks' notes on stderr."""
    from dgcli.measure import bench as b

    peaks = b.session_peaks(s, measure_cpu=measure_peaks, pinned=peaks_file) if pool is None else ray_peaks
    for note in (b.keep_peaks(save_peaks, peaks), None if pool is not None else b.load_note(s)):
        if note:
            warn(note)
    card = b.target_card(s, prompt_len=round(sum(len(p.ids) for p in plist) / len(plist)),
                         context=max(len(p.ids) for p in plist) + s.num_blocks * s.config.canvas_length,
                         peaks=b.card_peaks(s, peaks))
    return peaks, card


def _fp8_fields(model) -> dict:
    """What the row says about the weights: their format and, for FP8, the semantics that ran."""
    from dgcli.kernels import dispatch
    from dgcli.model.fp8 import is_fp8
    from dgcli.model.ggml import NAMES, QuantExperts, QuantLinear
    from dgcli.model.nvfp4 import is_nvfp4

    ggml = sorted({NAMES[t] for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))
                   for t in getattr(m, "types", (getattr(m, "qtype", None),))})
    if ggml:  # GGML blocks: their types (the rest of the model in the embedding's dtype)
        return {"weights": "+".join(ggml), "fp8_semantics": None}
    if is_nvfp4(model):  # what the activations are: int8 (W4A8) in the CPU's C, else the model's dtype
        w4a8 = "W4A8" in dispatch.nvfp4_provenance(model.embed_weight.device, model.embed_weight.dtype)
        return {"weights": f"nvfp4 ({'W4A8' if w4a8 else 'W4A16'})", "fp8_semantics": None}
    if is_fp8(model):
        return {"weights": "fp8", "fp8_semantics": dispatch.fp8_semantics()}
    return {"weights": str(model.embed_weight.dtype).removeprefix("torch."), "fp8_semantics": None}


def _unmeasured(rows: list, interrupted: bool, levels: list, what: str) -> None:
    """After Ctrl-C: exit 130 when no row finished, else say which levels were not measured."""
    if not rows:
        warn("dgemma: interrupted before the first run finished; nothing to report")
        raise SystemExit(130)  # not typer.Exit: under standalone_mode=False click returns its code unraised
    if interrupted and len(rows) < len(levels):
        warn(f"dgemma: interrupted: {what} {', '.join(map(str, levels[len(rows):]))} not measured")


def _remote(ctx: typer.Context, base_url: str, api_key: str | None, concurrency: str | None, request_rate: float | None,
            sampler: dict, *, prompts: str | None, num_prompts: int | None, runs: int, warmup: int, fmt: str,
            label: str | None, metadata: list[str] | None, save: tuple) -> None:
    """`bench --base-url`: the card, then one row per --concurrency (dgcli.measure.remote measures)."""
    from dgcli.measure import printers as report
    from dgcli.measure import remote as rm
    from dgcli.measure import remote_row as rr
    from dgcli.measure.workload import check_counts

    stray = o.given(ctx, rm.NOT_WITH_BASE_URL)
    if stray:
        flag, name = stray[0]
        raise UserError(f"{flag} does not apply with --base-url: {rm.NOT_WITH_BASE_URL[name]}")
    levels, rate = rm.parse_concurrency(concurrency or "1"), rm.check_rate(request_rate)
    check_counts(num_prompts=num_prompts, runs=runs, warmup=warmup, input_len=1)
    if save[0]:
        report.check_result_place(save[1], save[2])
    meta = report.parse_metadata(metadata)
    fields = rm.request_fields(**sampler)
    plist, source = rm.load_prompts(prompts, num_prompts)
    target = rm.connect(base_url, api_key)
    card = rr.card(target, prompts=plist, prompt_source=source, fields=fields)
    card_text = "# dgemma bench\n\n" + rr.card_markdown(card)
    (sys.stdout if fmt == "md" else sys.stderr).write(card_text + "\n")
    sys.stdout.flush()
    live, progress = status(sys.stderr.isatty())
    rows, interrupted = [], False
    try:
        for level in levels:
            done: list = []
            try:
                failed, first = rm.measure(target, plist, fields, runs=runs, warmup=warmup, concurrency=level, rate=rate,
                                           seed=sampler["seed"] or 0, progress=progress, out=done)
                if failed:
                    warn(f"dgemma: warning: {failed} of {warmup} warm-up request(s) failed at concurrency {level}: {first}")
            except KeyboardInterrupt:
                interrupted = True
                if done:
                    warn(f"dgemma: interrupted: reporting the {len(done)} finished run(s) of {runs} at concurrency {level}")
            if done:
                row = rr.make_row(target, prompts=plist, prompt_source=source, fields=fields, concurrency=level,
                                  rate=rate, runs_done=len(done), runs_asked=runs, warmup=warmup,
                                  summary=rr.summarize(done, plist, fields), label=label, metadata=meta)
                rows.append(row)
                if row["failed"]:
                    warn(f"dgemma: warning: {row['failed']} of {row['failed'] + row['completed']} requests failed at "
                         f"concurrency {level}: {row['first_error']}")
            if interrupted:
                break
    finally:
        if live is not None:
            live.stop()
    _unmeasured(rows, interrupted, levels, "concurrency")
    emit(rows, card=card, fmt=fmt, title="Results", definitions=rr.DEFINITIONS,
         markdown=rr.markdown(rows) if fmt == "md" else None)
    if save[0]:
        warn(f"dgemma: saved {report.save_result(document(card, rows, rr.DEFINITIONS), save[1], save[2], label)}")
    if interrupted:
        raise SystemExit(130)
    if not any(r["completed"] for r in rows):
        warn(f"dgemma: error: every request to {target.root} failed; first: {rows[0]['first_error']}")
        raise SystemExit(1)
