"""Host syncs inside a block, counted on CUDA: runs the bundled model's held-out prompts through the engine
the CUDA path uses (`AsyncStopEngine`) with `torch.cuda.set_sync_debug_mode("warn")`, and reports every
synchronizing call torch warns about, by the Python line that made it (the engine's block boundaries —
commits, admissions, the answer's read-back — are allowed to sync; anything else inside a block is a bug
for issue 15 item 4).

With `--step-mode graphs` the engine replays each step from CUDA graphs (`--cuda-graphs`); `--compare` then
also runs the same requests with the eager static step and the default (dynamic) step and reports whether
every request's tokens and steps per block are equal (captured against eager: issue 15's check on CUDA).

    python benchmarks/sync_check.py [--requests 8] [--slots 4] [--step-mode dynamic|static|graphs] [--compare]

Needs CUDA (prints why and exits 0 elsewhere). Part of benchmarks/gpu_suite.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--step-mode", default="dynamic", choices=["dynamic", "static", "graphs"])
    ap.add_argument("--compare", action="store_true", help="also run the eager static and dynamic steps: equal?")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: torch reports host syncs only on CUDA"}))
        return
    import dgcli
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.sampling.async_stop import AsyncStopEngine
    from dgcli.sampling.engine import Request
    from dgcli.sampling.events import Done
    from dgcli.text.prompts import read_prompt_file

    session = open_session(None, None, {"device": "cuda"})
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")[: args.requests]
    prompts = [torch.tensor(request.encode(session, row["prompt"]), device="cuda") for row in rows]

    def engine_for(mode: str) -> AsyncStopEngine:
        engine = AsyncStopEngine(session.model, slots=args.slots, max_len=512, pad_id=session.pad_id, step_mode=mode)
        for i, ids in enumerate(prompts):
            engine.submit(Request(id=i, prompt=ids, params=session.params, num_blocks=4, seed=i,
                                  stops=set(session.stop_ids)))
        return engine

    if args.step_mode == "graphs":  # capture outside the count: the first pass of each shape captures
        for _ in engine_for("graphs").events():
            pass
    engine = engine_for(args.step_mode)
    sites: collections.Counter[str] = collections.Counter()
    passes = 0
    done: dict[int, tuple] = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while not engine.idle:
                passes += 1
                before = len(caught)
                for ev in engine.step():
                    if isinstance(ev, Done):
                        done[ev.row] = (ev.token_ids, ev.steps_per_block)
                for w in caught[before:]:
                    sites[f"{w.filename}:{w.lineno}"] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = {"step_mode": args.step_mode, "passes": passes, "sync_warnings": sum(sites.values()),
           "by_site": dict(sites.most_common())}
    if args.compare:
        for mode in ("static", "dynamic"):
            other = {ev.row: (ev.token_ids, ev.steps_per_block) for ev in engine_for(mode).events()
                     if isinstance(ev, Done)}
            out[f"same_tokens_and_steps_as_{mode}"] = other == done
            out[f"requests_differing_from_{mode}"] = sorted(k for k in done if done[k] != other.get(k))
    print(json.dumps(out))
    if args.compare and not all(out[f"same_tokens_and_steps_as_{m}"] for m in ("static", "dynamic")):
        raise SystemExit(1)

if __name__ == "__main__":
    main()
