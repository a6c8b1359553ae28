"""Graphs against eager, checked on CUDA: the bundled model in bf16 runs the same held-out prompts (same seeds)
through the engine eagerly and with CUDA graphs; every committed block must be the same token ids (exit 1 and
the first difference otherwise). The captured passes replay the eager passes' kernels on the same shapes, so
anything else is a capture bug (a stale static input, a missed warm-up).

    python benchmarks/graphs_equal.py [--requests 4]

Needs CUDA (prints one "skipped" line and exits 0 elsewhere: benchmarks/gpu_suite.py counts that as not run).
"""

from __future__ import annotations

import torch

from harness import emit, parser, skip


def commits(session, prompts, graphs: bool) -> dict:
    from dgcli.engine import LLMEngine as Engine, Request
    from dgcli.sampling.events import Commit

    c = session.model.config.canvas_length
    engine = Engine(session.model, slots=len(prompts), max_len=max(len(p) for p in prompts) + 3 * c,
                    pad_id=session.pad_id, lag=1, graphs=graphs)
    for i, ids in enumerate(prompts):
        engine.submit(Request(id=i, prompt=ids, params=session.params, num_blocks=2, seed=i,
                              stops=set(session.stop_ids)))
    return {(ev.row, ev.block): ev.tokens for ev in engine.events() if isinstance(ev, Commit)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        skip("no CUDA device: CUDA graphs run only on CUDA")
    import dgcli
    from dgcli.runtime import request
    from dgcli.runtime.session import open_session
    from dgcli.text.prompts import read_prompt_file

    session = open_session(None, None, {"device": "cuda", "dtype": "bfloat16"})
    rows = read_prompt_file(dgcli.__path__[0] + "/data/prompts/heldout.jsonl")[: args.requests]
    prompts = [torch.tensor(request.encode(session, row["prompt"]), device="cuda") for row in rows]
    eager, graphs = commits(session, prompts, False), commits(session, prompts, True)
    diff = next((k for k in sorted(eager) if eager[k] != graphs.get(k)), None)
    emit({"equal": diff is None and eager.keys() == graphs.keys(), "blocks": len(eager),
          "first_difference": None if diff is None else {"row": diff[0], "block": diff[1]}})
    raise SystemExit(0 if diff is None and eager.keys() == graphs.keys() else 1)


if __name__ == "__main__":
    main()
