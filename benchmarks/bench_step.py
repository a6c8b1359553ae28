"""A denoising step per weight form and kernel mode, side by side in one run: `dgemma bench` on the ~200 M config
(benchmarks/200m.json: 32k vocabulary, 256-token canvas, a scaled-down 26B-A4B MoE), fixed work, each form in a
fresh process, forms alternating within each round so drift in the machine's load hits every form alike.

Per form (bf16, fp8, q4_k, q8_0 as `--dummy --weights`; `gguf:TYPE` for a GGUF file `dgemma quantize --type TYPE`
writes from a random checkpoint of the config (q4_k_m: llama.cpp's real mix with Q6_K, written once under --dir);
`gguf:FILE` for a GGUF file of the same config; each under every --kernels mode:
DGEMMA_KERNELS=auto|torch|reference) and thread count: the median ms per step with its range over rounds, its
ratio to the first form's, and the step's achieved FLOP/s as a share of the matmul rate `dgemma bench` measured
in the same process (dgcli.measure.peaks: the card's own CPU measurement, bf16 GEMMs for bf16 weights, int8 for
GGML weights), and the implementations the row's provenance names. Prints the card, a table, then one JSON line.

    python benchmarks/bench_step.py [--forms bf16,q4_k] [--kernels auto] [--threads 1,2] [--rounds 3] [--steps 8]
        [--config benchmarks/200m.json | --config 26B-A4B --layers 2] [--bench-args '--compile']
    python benchmarks/bench_step.py --forms bf16,q4_k,gguf:q4_k_m   # the 200 M model's Q4_K_M GGUF beside bf16

Owns: the forms' interleaving and their summary. Must not: time in-process (every figure is `dgemma bench`'s own).
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from harness import (CONFIG_200M, GGUF_TYPES, TINY, card_line, dgemma, emit, fail, gguf_of, machine, median, parser,
                     random_checkpoint, spread)


def bench_args(form: str, config: str, layers: int | None, steps: int, threads: int, runs: int, warmup: int,
               peaks: bool, extra: list[str]) -> list[str]:
    """`dgemma bench` for one form: --dummy CONFIG --weights FORM, or --model FILE for `gguf:FILE`."""
    model = (["--model", form.removeprefix("gguf:"), "--ignore-eos", "--random-prompts"] if form.startswith("gguf:")
             else ["--dummy", config, "--weights", form] + (["--layers", str(layers)] if layers else []))
    return ["bench", *model, "--diffusion-steps", str(steps), "--blocks", "1", "--runs", str(runs), "--warmup",
            str(warmup), "--num-prompts", "1", "--random-input-len", "32", "--threads", str(threads),
            "--measure-peaks" if peaks else "--no-measure-peaks", *extra, "--format", "jsonl"]


def run(forms: list[str], kernels: list[str], threads: list[int], rounds: int, files: dict, **kw) -> list[dict]:
    rows = []
    for r in range(rounds):
        for t in threads:
            for form in forms:
                for mode in kernels:
                    got = dgemma(*bench_args(files.get(form, form), threads=t, **kw), env={"DGEMMA_KERNELS": mode})[-1]
                    rows.append({"form": form, "kernels": mode, "threads": t, "round": r,
                                 "ms_per_step": got["mean_step_ms"], "flops_utilization": got.get("flops_utilization"),
                                 "peak_compute": got.get("peak_compute"), "peak_memory_bytes": got["peak_memory_bytes"],
                                 "implementations": got["provenance"]["kernels"], "weights": got.get("weights")})
                    print(f"round {r} threads {t} {form} {mode}: {rows[-1]['ms_per_step']:.1f} ms/step", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (threads, form, kernels): the step's median and range over rounds, its ratio to the first form's median
    at that thread count, and the median share of the measured matmul rate."""
    out = []
    for t in dict.fromkeys(r["threads"] for r in rows):
        keys = list(dict.fromkeys((r["form"], r["kernels"]) for r in rows if r["threads"] == t))
        base = None
        for form, mode in keys:
            mine = [r for r in rows if r["threads"] == t and r["form"] == form and r["kernels"] == mode]
            s = spread([r["ms_per_step"] for r in mine])
            base = base or s["median"]
            util = [r["flops_utilization"] for r in mine if r["flops_utilization"] is not None]
            out.append({"threads": t, "form": form, "kernels": mode, "ms_per_step": s, "ratio": s["median"] / base,
                        "share_of_matmul_rate": median(util) if util else None, "peak_compute": mine[0]["peak_compute"],
                        "implementations": mine[0]["implementations"]})
    return out


def table(summary: list[dict]) -> list[str]:
    out = ["| threads | form | DGEMMA_KERNELS | ms/step (median, range) | x first form | % matmul rate | experts "
           "| linear |",
           "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        ms, share, impl = s["ms_per_step"], s["share_of_matmul_rate"], s["implementations"]
        rate = f"{100 * share:.0f} % ({s['peak_compute']})" if share is not None else "n/a"
        out.append(f"| {s['threads']} | {s['form']} | {s['kernels']} | {ms['median']:.1f} ({ms['min']:.1f}-"
                   f"{ms['max']:.1f}) | {s['ratio']:.3f} | {rate} | {impl.get('experts')} | {impl.get('linear')} |")
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--forms", default="bf16,q4_k", help="bf16, fp8, q4_k, q8_0, gguf:TYPE or gguf:FILE, "
                    "comma-separated")
    ap.add_argument("--kernels", default="auto", help="DGEMMA_KERNELS modes, comma-separated")
    ap.add_argument("--config", default=str(CONFIG_200M), help="a --dummy config (or 26B-A4B)")
    ap.add_argument("--layers", type=int, default=None, help="cut the config to its first N layers")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="timed passes per process (after one warm-up request)")
    ap.add_argument("--bench-args", default="", help="more `dgemma bench` flags for every form, e.g. '--compile'")
    ap.add_argument("--dir", default="/tmp", help="where gguf:TYPE forms' checkpoints and files are kept")
    args = ap.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        fail("bench_step", f"--threads {args.threads!r}: give thread counts like 1,2")
    forms, kernels = args.forms.split(","), args.kernels.split(",")
    runs, warmup, peaks = args.runs, 1, True
    if args.dry_run:
        args.config, threads, args.rounds, args.steps, runs, warmup, peaks = str(TINY), [1], 1, 2, 1, 0, False
        forms, args.dir = ["bf16", "q4_k", "gguf:q8_0"], tempfile.mkdtemp()
    files = {}  # gguf:TYPE -> the config's random checkpoint, quantized
    for form in forms:
        if form.startswith("gguf:") and form[5:] in GGUF_TYPES:
            if args.layers or not Path(args.config).is_file():
                fail("bench_step", f"{form}: give --config a config.json (not cut by --layers)")
            files[form] = "gguf:" + str(gguf_of(random_checkpoint(Path(args.config), Path(args.dir)), form[5:]))
    card = machine(peaks=False)
    print(card_line(card))
    print(f"config {args.config}{f' (first {args.layers} layers)' if args.layers else ''}, {args.steps} steps x 1 "
          f"block, fixed work; forms {forms} x DGEMMA_KERNELS {kernels}; threads {threads}; {args.rounds} rounds")
    rows = run(forms, kernels, threads, args.rounds, files=files, config=args.config, layers=args.layers,
               steps=args.steps, runs=runs, warmup=warmup, peaks=peaks, extra=shlex.split(args.bench_args))
    summary = summarize(rows)
    print("\n".join(["", *table(summary)]))
    emit({"card": card, "config": args.config, "layers": args.layers, "steps": args.steps,
          "bench_args": args.bench_args, "runs": rows,
          "summary": summary})


if __name__ == "__main__":
    main()
