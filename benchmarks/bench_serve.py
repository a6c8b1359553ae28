"""`dgemma bench --base-url` against `dgemma serve` beside in-process `dgemma bench --batch-size`, on the same
prompts, in one run: what HTTP (the server's app, SSE, the client) adds on top of the engine.

Starts `dgemma serve` (the bundled model unless --model, --max-batch-size = the largest level) on a free
port, then alternates, `--rounds` times: the remote bench at --concurrency LEVELS and the in-process bench
at --batch-size LEVELS (each `--runs` timed passes over the prompt set, after a warm-up). Concurrency N
against a server with at least N slots keeps at most N requests in the engine, as batch size N does in
process, so the rows compare level by level. Prints one table (medians over rounds) and one JSON line.

    python benchmarks/bench_serve.py [--levels 1,4,8] [--runs 3] [--rounds 2] [--model DIR]

HTTP overhead per request = remote mean e2el − in-process mean e2el at the same level (the in-process
latency is timed from when a request takes its slot; with N in flight and N slots nothing waits).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from harness import ROOT, dgemma, dgemma_exe, emit, median, parser

FIELDS = ("output_throughput", "mean_ttft_ms", "mean_e2el_ms", "p99_e2el_ms", "quality", "diffusion_denoising_steps")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(args: list[str]) -> list[dict]:
    return dgemma("bench", *args, "--format", "jsonl")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of the set (default: all)")
    args = ap.parse_args()
    warmup = 2
    if args.dry_run:
        args.levels, args.runs, args.rounds, args.num_prompts, warmup = "1", 1, 1, 2, 0
    levels = [int(x) for x in args.levels.split(",")]
    model = ["--model", args.model] if args.model else []
    port = free_port()
    log = open(f"/tmp/bench_serve_{port}.log", "w")
    server = subprocess.Popen([dgemma_exe(), "serve", "--port", str(port),
                               "--max-batch-size", str(max(levels)), *model], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env=os.environ.copy())
    import httpx

    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    common = ["--runs", str(args.runs), "--warmup", str(warmup)]
    common += ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []
    got: dict[tuple[str, int], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for kind in (("remote", "local") if r % 2 == 0 else ("local", "remote")):
                if kind == "remote":
                    rows = bench(["--base-url", f"http://127.0.0.1:{port}/v1", "--concurrency", args.levels, *common])
                    key = "concurrency"
                else:
                    rows = bench(["--batch-size", args.levels, *model, *common])
                    key = "batch_size"
                for row in rows:
                    got.setdefault((kind, int(row[key])), []).append(row)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    med = {k: {f: median([x[f] for x in v]) if all(isinstance(x.get(f), (int, float)) for x in v) else None
               for f in FIELDS} for k, v in got.items()}
    print("| level | where | output tok/s | mean TTFT ms | mean e2el ms | p99 e2el ms | quality | denoising steps |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for n in levels:
        for kind in ("local", "remote"):
            m = med[(kind, n)]
            print(f"| {n} | {'in-process --batch-size' if kind == 'local' else 'HTTP --concurrency'} | "
                  + " | ".join("n/a" if m[f] is None else f"{m[f]:.4g}" for f in FIELDS) + " |")
        loc, rem = med[("local", n)], med[("remote", n)]
        summary.append({"level": n, "local": loc, "remote": rem,
                        "http_overhead_ms": rem["mean_e2el_ms"] - loc["mean_e2el_ms"],
                        "throughput_ratio": rem["output_throughput"] / loc["output_throughput"]})
    for s in summary:
        print(f"level {s['level']}: HTTP adds {s['http_overhead_ms']:.1f} ms per request (mean e2el); "
              f"throughput over HTTP = {s['throughput_ratio']:.2f}x in-process")
    emit({"levels": levels, "runs": args.runs, "rounds": args.rounds, "summary": summary})


if __name__ == "__main__":
    main()
