"""Host syncs inside a block, counted on CUDA: runs the bundled model's held-out prompts through the engine
the CUDA path uses (`AsyncStopEngine`) with `torch.cuda.set_sync_debug_mode("warn")`, and reports every
synchronizing call torch warns about, by the Python line that made it (the engine's block boundaries —
commits, admissions, the answer's read-back — are allowed to sync; anything else inside a block is a bug
for issue 15 item 4).

    python benchmarks/sync_check.py [--requests 8] [--slots 4]

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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: torch reports host syncs only on CUDA"}))
        return
    import dgcli
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.sampling.async_stop import AsyncStopEngine
    from dgcli.sampling.engine import Request
    from dgcli.text.prompts import read_prompt_file

    session = open_session(None, None, {"device": "cuda"})
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")[: args.requests]
    engine = AsyncStopEngine(session.model, slots=args.slots, max_len=512, pad_id=session.pad_id)
    for i, row in enumerate(rows):
        ids = torch.tensor(request.encode(session, row["prompt"]), device="cuda")
        engine.submit(Request(id=i, prompt=ids, params=session.params, num_blocks=4, seed=i,
                              stops=set(session.stop_ids)))
    sites: collections.Counter[str] = collections.Counter()
    passes = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while not engine.idle:
                passes += 1
                before = len(caught)
                for _ in engine.step():
                    pass
                for w in caught[before:]:
                    sites[f"{w.filename}:{w.lineno}"] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(json.dumps({"passes": passes, "sync_warnings": sum(sites.values()), "by_site": dict(sites.most_common())}))


if __name__ == "__main__":
    main()
