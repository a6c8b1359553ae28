"""`--ray` on this machine: the bundled held-out set through the `generate --input-jsonl` path locally and over
a local Ray head with 1 and 2 workers, and what the Ray path costs once per run and per request.

In one driver process: the local path (`request.run_batch` on a session opened here) and the Ray path
(`dgcli.cluster.jobs.run_rows` over a pool of 2 workers, or its first worker alone) run the same parsed rows,
alternating in rounds so that drift in the machine's load hits each alike; the median wall time per path.
The fixed cost is opening the pool (joining the head, starting the workers, each loading the model and
describing its session) against opening a local session. A chunk's bare round trip (a no-op method on a
worker) is timed on its own. Every path's answers must be equal; exact match against the set's answers is
printed once.

On a 2-core machine two workers can at most halve the loop's time, and only while nothing else runs; what it
can not show is scaling past the cores, GPUs, or several machines (the network round trip).

    nice python benchmarks/ray_overhead.py [--rounds 3] [--batch-size 1]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from harness import ROOT, emit, median, parser, skip, times, wall

HELDOUT = ROOT / "dgcli" / "data" / "prompts" / "heldout.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(temp: str) -> str:
    port = free_port()
    subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", "--num-cpus", str(os.cpu_count()),
                    "--port", str(port), "--include-dashboard=false", "--object-store-memory", str(200 * 2**20),
                    "--disable-usage-stats", "--temp-dir", temp], check=True, capture_output=True)
    return f"127.0.0.1:{port}"


def stop_head(temp: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop"], capture_output=True)
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and temp in (p / "cmdline").read_text(errors="replace"):
                os.kill(int(p.name), signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(temp, ignore_errors=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--trips", type=int, default=200, help="bare round trips timed")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts of the set (0: all)")
    args = ap.parse_args()
    if args.dry_run:
        args.rounds, args.trips, args.limit = 1, 5, 2
    if not (Path(sys.executable).parent / "ray").exists():
        skip("no Ray here (pip install 'dgemma[ray]')")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from dgcli.cli import batch
    from dgcli.cluster import jobs
    from dgcli.runtime.session import open_session

    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines()][: args.limit or None]
    local_open, session = wall(lambda: open_session(None, None, {}))
    requests = batch.parse_rows(session, rows, str(HELDOUT), raw=False, thinking=False, init_flag=None)
    temp = f"/tmp/rdgb{os.getpid()}"
    head = start_head(temp)
    try:
        def open_pool():
            pool = jobs.open_pool(head, 2, 0, jobs.spec("generate", model=None, preset=None, flags={}, compile=False,
                                                        threads=None, cuda_graphs=False), lambda m: None)
            jobs.driver_session(pool)
            return pool
        ray_open, pool = wall(open_pool)
        both = list(pool.actors)
        one = [both[0]]

        def on(actors: list) -> list:
            pool.actors = actors  # the pool's first worker alone, or both
            out: list = [None] * len(requests)
            jobs.run_rows(pool, requests, batch_size=args.batch_size, show_thinking=False, on_event=None,
                          write=lambda i, r: out.__setitem__(i, r))
            return out

        def local() -> list:
            return batch.run_rows(session, requests, batch_size=args.batch_size, show_thinking=False, on_event=None,
                                  write=lambda i, r: None)

        paths = {"local": local, "ray, 1 worker": lambda: on(one), "ray, 2 workers": lambda: on(both)}
        walls: dict[str, list[float]] = {k: [] for k in paths}
        answers: dict[str, list] = {}
        for r in range(args.rounds):
            for name, fn in paths.items():
                secs, got = wall(fn)
                walls[name].append(secs)
                answers[name] = [x.token_ids for x in got]
                print(f"round {r + 1}: {name:15s} {walls[name][-1]:6.2f} s", file=sys.stderr)
        pool.actors = one
        trips = times(lambda: pool.call("pid"), reps=args.trips, warmup=0)
        texts = local()
        pool.actors = both
        pool.close()
    finally:
        stop_head(temp)
    n = len(requests)
    med = {k: median(v) for k, v in walls.items()}
    same = all(a == answers["local"] for a in answers.values())
    exact = sum(r.text.strip() == row["answer"].strip() for r, row in zip(texts, rows) if row.get("answer"))
    answered = sum(1 for row in rows if row.get("answer"))
    load = os.getloadavg()[0]
    print(f"\n{HELDOUT.name}: {n} prompts, --batch-size {args.batch_size}, {jobs.GENERATE_CHUNK * args.batch_size} rows "
          f"per chunk, {os.cpu_count()} CPUs, load average {load:.2f} at the end, median of {args.rounds} round(s)\n")
    print("| path | wall (s) | ms / request | vs local |")
    print("|---|---|---|---|")
    for name in paths:
        print(f"| {name} | {med[name]:.2f} | {med[name] / n * 1e3:.1f} | {med['local'] / med[name]:.2f}x |")
    print(f"\nanswers equal on every path: {same}; exact match {exact}/{answered}")
    print(f"per-request overhead, 1 worker vs local: {(med['ray, 1 worker'] - med['local']) / n * 1e3:+.1f} ms; "
          f"bare round trip {median(trips) * 1e3:.2f} ms (median of {len(trips)})")
    print(f"fixed cost: open the pool (2 workers) {ray_open:.2f} s vs open a local session {local_open:.2f} s")
    emit({"walls": walls, "same": same, "load": load, "ray_open_s": ray_open, "local_open_s": local_open,
          "trip_ms": median(trips) * 1e3})


if __name__ == "__main__":
    main()
