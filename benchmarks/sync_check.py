"""Host syncs inside a pass, checked on CUDA: runs the bundled model's held-out prompts through the engine as CUDA
runs it (`Engine(..., lag=1)`: pass n+1 is launched before pass n is settled) and fails on any host sync made
while a pass is launched.

Only `Engine._launch` (the pass, its sampler work and its stop flags' copy to pinned memory) runs under
`torch.cuda.set_sync_debug_mode("error")`: a sync there raises, and is reported as a failure with the Python line
that made it (exit 1). A first, unchecked run of the same requests compiles and autotunes the Triton kernels
(their first call per shape syncs by design). The settle's declared reads — the stop flags from their pinned
copy, the tokens of the blocks that end, read by `host_reads` — are allowed to sync; the whole run is under
"warn" and its warnings are counted by line, as information.

    python benchmarks/sync_check.py [--requests 8] [--slots 4] [--graphs]

Needs CUDA (prints one line and exits 0 elsewhere). Part of benchmarks/gpu_suite.py.
Must not: change the engine (it only wraps the instance's `_launch`).
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings

import torch

from harness import ROOT, emit, parser, skip


def sync_site(exc: BaseException) -> dict:
    """The line that made the sync (the innermost frame: torch raises from inside the op that frame called) and
    the innermost frame in this repository, if that is another."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = frames[-1]
    ours = next((f for f in reversed(frames) if f.filename.startswith(str(ROOT))), inner)
    site = {"line": f"{inner.filename}:{inner.lineno}", "code": inner.line, "error": str(exc).splitlines()[0]}
    if ours is not inner:
        site["repo_line"] = f"{ours.filename}:{ours.lineno}"
    return site


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--graphs", action="store_true", help="the engine with CUDA graphs (decode-only passes replayed)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        skip("no CUDA device: torch reports host syncs only on CUDA")
    if args.dry_run:
        args.requests, args.slots = 2, 2
    import dgcli
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.engine import LLMEngine as Engine, Request
    from dgcli.sampling.events import Done
    from dgcli.text.prompts import read_prompt_file

    session = open_session(None, None, {"device": "cuda"})
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")[: args.requests]
    prompts = [torch.tensor(request.encode(session, row["prompt"]), device="cuda") for row in rows]
    c = session.model.config.canvas_length

    engine = Engine(session.model, slots=args.slots, max_len=max(len(p) for p in prompts) + 3 * c,
                    pad_id=session.pad_id, lag=1, graphs=args.graphs)

    def submit(first_id: int) -> None:
        for i, ids in enumerate(prompts):
            engine.submit(Request(id=first_id + i, prompt=ids, params=session.params, num_blocks=4, seed=i,
                                  stops=set(session.stop_ids)))

    # Warm-up, unchecked: Triton compiles each kernel and autotunes the vocabulary pass and the experts at the
    # first call of each shape, and each graph bucket is captured at its first pass, which syncs by design (once
    # per shape, not per pass); the checked run repeats the same requests on the same engine: the same passes
    # and buckets.
    submit(0)
    for _ in engine.events():
        pass
    submit(len(prompts))
    launch = engine.runner._launch  # (the runner launches a plan: dgcli/engine/runner.py)
    launches = 0

    def guarded(plan):  # only the pass: a sync here is an error, not a warning
        nonlocal launches
        launches += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    engine.runner._launch = guarded
    sites: collections.Counter[str] = collections.Counter()
    steps, done, failure = 0, 0, None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                while not engine.idle:
                    steps += 1
                    done += sum(isinstance(ev, Done) for ev in engine.step())
            except RuntimeError as e:
                if "synchroniz" not in str(e):
                    raise
                failure = sync_site(e)
            for w in caught:
                sites[f"{w.filename}:{w.lineno}"] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = {"lag": 1, "graphs": args.graphs, "graph_passes": engine.stats["graph_passes"], "steps": steps, "launches": launches, "requests_done": done, "requests": len(prompts),
           "sync_in_launch": failure, "settle_sync_warnings": sum(sites.values()),
           "settle_by_site": dict(sites.most_common())}
    emit(out)
    if failure is not None:
        where = f" (from {failure['repo_line']})" if "repo_line" in failure else ""
        print(f"sync_check: FAILED: a host sync inside a pass at {failure['line']}{where}: {failure['code']}",
              file=sys.stderr)
        raise SystemExit(1)
    if done != len(prompts):
        raise SystemExit(f"sync_check: only {done} of {len(prompts)} requests finished")


if __name__ == "__main__":
    main()
