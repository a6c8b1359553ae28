"""`dgemma generate [PROMPT|-]`: prompts in (argument, stdin or --input-jsonl), answers out.

stdout carries only answers (text, one JSON object per prompt, or typed ndjson events); progress and
warnings go to stderr. Owns: the generate flags and the output formats. Must not: contain a denoising
loop or the request logic (dgcli.runtime.request; dgcli.cli.console runs one prompt with its trace).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

import dgcli.cli.batch as batch
import dgcli.cli.options as o
from dgcli.cli.console import (THINKING_NOTE, Progress, check_writable, loading, note_answers, print_answer,
                               prompt_inputs, read_prompt, run_one, show_config as print_config, warn)
from dgcli.cli.schema import JsonObject, JsonSchema, read_schema, resolve
from dgcli.cluster import check_flags  # torch-free
from dgcli.errors import UserError
from dgcli.runtime.determinism import Recorder

FORMATS = ("text", "json", "ndjson")
EXAMPLES = ['dgemma generate "Sort: 5 9 8 6 9 0 9 2"',
            'echo "Count from 7 to 40." | dgemma generate',
            'dgemma generate --input-jsonl prompts.jsonl --batch-size 8 --format json',
            'dgemma generate --preset fixed-work --show-config']


def generate(
    prompt: Annotated[Optional[str], typer.Argument(metavar="PROMPT|-", help="Prompt text; - or nothing reads stdin.")] = None,
    model: o.Model = None, preset: o.Preset = None, device: o.Device = None, dtype: o.Dtype = None,
    seed: o.Seed = None, steps: o.Steps = None, t_min: o.TMin = None, t_max: o.TMax = None,
    entropy_bound: o.EntropyBound = None, stability_threshold: o.Stability = None,
    confidence_threshold: o.Confidence = None, blocks: o.Blocks = None, max_tokens: o.MaxTokens = None,
    threads: o.Threads = None, low_memory: o.LowMemory = None, show_config: o.ShowConfig = False,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="FORMAT", help="text | json | ndjson")] = "text",
    input_jsonl: Annotated[Optional[str], typer.Option("--input-jsonl", metavar="FILE", help=(
        "Run every {\"prompt\": ...} line of FILE (rows may carry \"seed\" and \"init_canvas\": text, "
        "\"ids:5,6,7\" or [5, 6, 7]); every row is checked first; results in input order."))] = None,
    batch_size: o.BatchSize = 1,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="FILE", help=(
        "With --input-jsonl and --format json: append the records to FILE as each finishes, in input order, "
        "instead of stdout; an existing FILE needs --resume."))] = None,
    resume: Annotated[bool, typer.Option("--resume", help=(
        "With --output: run only the rows FILE lacks (the same prompts and settings) and append them."))] = False,
    trace: o.Trace = None,
    init_canvas: o.InitCanvas = None,
    image: o.Image = None,
    thinking: o.Thinking = False,
    show_thinking: o.ShowThinking = False,
    raw: o.Raw = False,
    compile: o.Compile = False,
    cuda_graphs: o.CudaGraphs = None,
    no_prefix_caching: o.NoPrefixCaching = False,
    ray: o.Ray = None, ray_workers: o.RayWorkers = None, ray_gpus: o.RayGpus = None,
    json_schema: JsonSchema = None,
    json_object: JsonObject = False,
    check_determinism: Annotated[bool, typer.Option("--check-determinism", help=(
        "Then run the prompts twice more (as before, and batched the other way: alone, or beside a batch-mate) "
        "and check that every step decides the same; exit 1 at the first difference."))] = False,
) -> None:
    """Generate text for a prompt (argument, stdin or JSONL).

    stdout carries only the answers; progress and notes go to stderr.
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    flags = o.sampler_flags(steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                            stability=stability_threshold, confidence=confidence_threshold, seed=seed,
                            blocks=blocks, device=device, dtype=dtype, max_tokens=max_tokens)
    if show_config:
        print_config(model, preset, flags, fmt)
        return
    if isinstance(batch_size, bool) or batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be a whole number >= 1")
    if batch_size > 1 and input_jsonl is None:
        raise UserError("--batch-size batches the rows of --input-jsonl; give --input-jsonl FILE, or drop --batch-size")
    if trace and input_jsonl is not None:
        raise UserError("--trace records one generation; run one prompt, or drop --trace for --input-jsonl")
    if check_determinism and ray is not None:
        raise UserError("--check-determinism runs here, not on a cluster: drop --ray")
    if ray is not None and input_jsonl is None:
        raise UserError("--ray spreads the rows of --input-jsonl over a cluster; give --input-jsonl FILE, or drop --ray")
    if output is not None and (input_jsonl is None or fmt != "json"):
        raise UserError("--output FILE keeps the --format json records of --input-jsonl: give --input-jsonl FILE "
                        "and --format json, or drop --output")
    if resume and output is None:
        raise UserError("--resume continues an --output FILE: add -o FILE (e.g. a file of this run's --format json "
                        "records)")
    sink = batch.RecordFile(output, resume=resume) if output is not None else None  # before the model loads
    check_flags(ray, ray_workers, ray_gpus)
    rows = None
    if input_jsonl is not None:
        if prompt not in (None, "-"):
            raise UserError("give either a PROMPT argument or --input-jsonl, not both")
        from dgcli.text.prompts import read_prompt_file

        rows = read_prompt_file(input_jsonl, flag="--input-jsonl")
    schema = read_schema(json_schema, json_object)
    if (schema is not None or any("json_schema" in r for r in rows or [])) and (ray or check_determinism):
        raise UserError("a JSON schema runs on this machine's engine: drop --ray and --check-determinism, or the schema")
    if image and check_determinism:
        raise UserError("--check-determinism reruns text prompts; drop --image, or drop --check-determinism")
    if image and rows is not None:
        raise UserError("--image goes with one PROMPT; rows of --input-jsonl carry their own \"images\": [FILE, ...]")
    from dgcli.text.images import read_files

    image_bytes = read_files(image or [], "--image")  # before the model loads
    text = None if rows is not None else read_prompt(prompt)
    if trace:
        check_writable("--trace", trace)
    # Everything that needs no weights, before torch is imported: settings, blocks, the prompt's length.
    from dgcli.runtime import preflight

    _, cfg, _, resolved = preflight.resolve_for(model, preset, flags)
    if threads is not None:
        preflight.check_threads(threads)
    blocks = preflight.check_blocks(cfg, resolved)
    if text is not None and len(text) > preflight.prompt_room(cfg, blocks):  # then it may not fit: ask the tokenizer
        from dgcli.checkpoint.load import load_tokenizer

        preflight.check_prompt_chars(text, load_tokenizer(model or preflight.default_model_path()),
                                     preflight.prompt_room(cfg, blocks), cfg.max_position_embeddings)
    if show_thinking and not thinking:
        warn(THINKING_NOTE)
    from dgcli.runtime.session import fits, open_session

    pool = None
    if ray is not None:  # the model loads in each worker; here only the tokenizer (rows are encoded here)
        from dgcli.cluster import jobs

        pool = jobs.open_pool(ray, ray_workers, ray_gpus, jobs.spec(
            "generate", model=model, preset=preset, flags=flags, compile=compile, threads=threads,
            cuda_graphs=cuda_graphs, prefix_caching=not no_prefix_caching), warn)
        session = jobs.driver_session(pool)[0]
    else:
        with loading("loading the model…"):
            session = open_session(model, preset, flags, compile=compile, threads=threads, cuda_graphs=cuda_graphs,
                                   chat=not raw, check=fits(min(batch_size, len(rows or [1])), "--batch-size"),
                                   low_memory=low_memory)
    session.prefix_caching = not no_prefix_caching
    given, canvas, images = prompt_inputs(session, init_canvas, image, image_bytes)
    if rows is not None:  # rows with their own init_canvas read theirs
        requests = batch.parse_rows(session, rows, input_jsonl, raw=raw, thinking=thinking, init_flag=given,
                                    schema=resolve(schema))
        if (pool is not None or check_determinism) and any(r.images for r in requests):
            raise UserError("rows with \"images\" run here and once: drop --ray and --check-determinism")
        _run_file(session, rows, requests, batch_size=batch_size, fmt=fmt, raw=raw, show_thinking=show_thinking,
                  pool=pool, check=check_determinism, sink=sink)
        return
    progress = Progress(sys.stderr.isatty() and fmt != "ndjson", compiling=session.compiled)
    try:
        on_event = _on_event(progress, fmt, index=False)
        recorder = Recorder(on_event) if check_determinism else None  # keeps every step's decisions on the host
        response = run_one(session, text, raw=raw, thinking=thinking, show_thinking=show_thinking, trace=trace,
                           init_canvas=canvas, on_event=recorder or on_event, json_schema=resolve(schema),
                           images=images)
        _write(response, response.as_dict(session.resolved.as_dict()), fmt)
    finally:
        progress.stop()
    note_answers(session, [response], raw=raw)
    if check_determinism:
        _check(session, [batch.Request(response.prompt_ids, session.params.seed, canvas)], recorder.records, 1)


def _check(session, requests, reference, batch_size) -> None:
    """--check-determinism: the requests again (dgcli.runtime.determinism); the outcome on stderr, exit 1 if
    a decision differs."""
    from dgcli.runtime.determinism import DECISIONS, check

    with loading("checking determinism…"):
        out = check(session, requests, reference, batch_size)
    runs = f"{len(out.runs)} more runs ({'; '.join(out.runs)})"
    if out.difference is not None:
        warn(f"dgemma: determinism: FAILED in {runs}: {out.difference}")
        raise SystemExit(1)
    bits = "equal bits" if out.entropy_gap == 0 else f"within {out.entropy_gap:.2g} (not bit for bit)"
    warn(f"dgemma: determinism: the same in {runs}: every step's {', '.join(DECISIONS)}, stop and answer; "
         f"entropies {bits}")


def _run_file(session, rows, requests, *, batch_size, fmt, raw, show_thinking, pool=None, check=False,
              sink=None) -> None:
    """--input-jsonl: the checked rows through the batched loop, results in input order (to stdout, or appended
    to --output: with --resume only the rows it lacks); the notes once."""
    settings = session.resolved.as_dict()
    todo = list(range(len(rows)))
    if sink is not None and sink.resume:
        have = sink.done(rows, settings)
        todo = [i for i in todo if i not in have]
        warn(f"dgemma: {len(have)} of {len(rows)} record(s) already in {sink.path}, {len(todo)} to run")
    requests = [requests[i] for i in todo]
    progress = Progress(sys.stderr.isatty() and fmt != "ndjson" and pool is None, compiling=session.compiled)
    on_event = _on_event(progress, fmt, index=True)

    def write(n, response) -> None:
        result = batch.json_result(todo[n], rows[todo[n]], response, settings)
        sink.write(result) if sink is not None else _write(response, result, fmt)

    recorder = Recorder(on_event) if check else None

    try:
        if not requests:
            responses = []
        elif pool is not None:  # --ray: the workers' events come back only for ndjson (the progress is the pool's)
            from dgcli.cluster import jobs

            how = "rerun the same command with --resume to finish" if sink is not None else \
                "to finish, rerun with -o FILE --resume, FILE holding this run's --format json records"
            responses = jobs.run_rows(pool, requests, batch_size=batch_size, show_thinking=show_thinking,
                                      on_event=on_event if fmt == "ndjson" else None, write=write, resume=how)
        else:
            responses = batch.run_rows(session, requests, batch_size=batch_size, show_thinking=show_thinking,
                                       on_event=recorder or on_event, write=write)
    finally:
        progress.stop()
        if pool is not None:
            pool.close()
    note_answers(session, responses, raw=raw)
    if check:
        _check(session, requests, recorder.records, batch_size)


def _on_event(progress: Progress, fmt: str, *, index: bool):
    """Each event to the progress line and, for ndjson, to stdout (with --input-jsonl: with its row's index)."""
    from dgcli.sampling.events import Done

    def on_event(event) -> None:
        progress(event)
        if fmt == "ndjson" and not isinstance(event, Done):  # the result line replaces `done`
            record = {**event.to_record(), "index": event.row} if index else event.to_record()
            sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")

    return on_event


def _write(response, result: dict, fmt: str) -> None:
    """One answer on stdout: its text, its JSON `result`, or (ndjson) that result as the `result` event."""
    if fmt == "text":
        print_answer(response)
        return
    sys.stdout.write(json.dumps(result if fmt == "json" else {"type": "result", **result}, ensure_ascii=False) + "\n")
    sys.stdout.flush()
