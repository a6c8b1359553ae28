"""Structured output on a vocabulary of the real size: what a schema costs to compile (outlines-core's index and its
transitions, then the token classes) and what a constrained row adds to a step (the joint draw after the vocabulary
pass it follows), side by side in one run.

    python benchmarks/structured.py [--tokenizer DIR] [--schemas 12] [--hidden 2816] [--canvas 256] [--rounds 3]

--tokenizer: a checkpoint directory holding tokenizer.json (default: the 262,144-token vocabulary of
tests/vocab262k.py, written to a temporary directory). Schemas: tests/schemas.py's `string_schemas` and any JSON
object (`--json`). The step: one canvas [1, C, H] of random bf16 hidden states against a random bf16 head [V, H]:
the vocabulary pass as the sampler's step runs it (dgcli.kernels.dispatch), then for a constrained row the joint
draw (dgcli.sampling.joint.constrain) under the first schema; the two alternate over --rounds, min and median each.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from harness import ROOT, card_line, emit, machine, median, parser

sys.path.insert(0, str(ROOT / "tests"))  # the synthetic vocabulary and the generated schemas


def compile_times(tok, sets: list[dict]) -> list[dict]:
    """Each schema's compile, split into outlines-core's index build, its transitions' hand-over, and the rest."""
    import outlines_core

    from dgcli.sampling.constrain import compile_schema

    spent = {"index": 0.0, "transitions": 0.0}

    class Timed:  # outlines-core's Index, its build and its transitions timed
        def __init__(self, *a):
            t = time.perf_counter()
            self.index = plain(*a)
            spent["index"] += time.perf_counter() - t

        def __getattr__(self, name):
            return getattr(self.index, name)

        def get_transitions(self):
            t = time.perf_counter()
            out = self.index.get_transitions()
            spent["transitions"] += time.perf_counter() - t
            return out

    outlines_core.Index, plain = Timed, outlines_core.Index
    rows = []
    try:
        t = time.perf_counter()
        compile_schema(tok, {"type": "boolean"}, tok.stop_ids)  # the vocabulary's hand-over: once per tokenizer
        print(f"first schema (with the vocabulary's hand-over to outlines-core): {time.perf_counter() - t:.2f} s")
        for i, s in enumerate(sets):
            spent.update(index=0.0, transitions=0.0)
            t = time.perf_counter()
            a = compile_schema(tok, s, tok.stop_ids)
            total = time.perf_counter() - t
            rows.append(dict(schema=i, s=total, index_s=spent["index"], transitions_s=spent["transitions"],
                             states=a.n, classes=a.k, edges=len(a.src), automaton=a))
            print(f"schema {i:2d}: {total:6.2f} s (outlines-core index {spent['index']:.2f} s, transitions "
                  f"{spent['transitions']:.2f} s), {a.n} states, {a.k} token classes, {len(a.src)} edges", flush=True)
    finally:
        outlines_core.Index = plain
    return rows


def step_times(automaton, v: int, h: int, c: int, rounds: int) -> dict:
    from dgcli.kernels.dispatch import vocab_pass
    from dgcli.sampling.constrain import Constraint
    from dgcli.sampling.joint import constrain, processed_logits

    g = torch.Generator().manual_seed(0)
    model = SimpleNamespace(embed_weight=(torch.randn(v, h, generator=g) * 0.05).bfloat16(),
                            config=SimpleNamespace(final_logit_softcapping=30.0))
    hidden = torch.randn(1, c, h, generator=g).bfloat16()
    temp, uniform = torch.tensor([0.8]), torch.rand(1, c, generator=g, dtype=torch.float64)
    ends = torch.rand(1, generator=g, dtype=torch.float64)

    def vocab():
        return vocab_pass(hidden, model.embed_weight, softcap=30.0, temperature=temp, embed_scale=h ** 0.5,
                          uniform=uniform, want_soft=True)

    def draw(out):
        constrain(out, lambda k, ids: processed_logits(model, hidden[k], temp[k], ids), v,
                  [(0, Constraint(automaton, c), 0)], uniform, ends)

    out = vocab()
    draw(out)  # warm
    got = {"vocab_pass": [], "joint_draw": []}
    for _ in range(rounds):  # alternated, so that the load on a shared machine falls on both alike
        t = time.perf_counter()
        out = vocab()
        got["vocab_pass"].append(time.perf_counter() - t)
        t = time.perf_counter()
        draw(out)
        got["joint_draw"].append(time.perf_counter() - t)
    return {k: dict(min_ms=1e3 * min(x), median_ms=1e3 * median(x)) for k, x in got.items()}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokenizer", help="a checkpoint directory with tokenizer.json (default: 262,144 synthetic)")
    ap.add_argument("--schemas", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2816, help="H of the random head (26B-A4B: 2816)")
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from schemas import string_schemas

    from dgcli.sampling.constrain import ANY_OBJECT
    from dgcli.text.tokenizer import load_tokenizer

    if a.dry_run:
        a.tokenizer, a.schemas, a.hidden, a.canvas, a.rounds = str(ROOT / "dgcli" / "data" / "tiny"), 2, 16, 32, 1
    card = machine(peaks=False)
    print(card_line(card))
    with tempfile.TemporaryDirectory() as tmp:
        if a.tokenizer is None:
            from vocab262k import write_tokenizer_262k

            a.tokenizer = str(write_tokenizer_262k(Path(tmp)))
        tok = load_tokenizer(a.tokenizer)
    sets = string_schemas(a.schemas) + [ANY_OBJECT]
    rows = compile_times(tok, sets)
    secs = [r["s"] for r in rows]
    step = step_times(rows[0]["automaton"], tok.vocab_size, a.hidden, a.canvas, a.rounds)
    ratio = step["joint_draw"]["median_ms"] / step["vocab_pass"]["median_ms"]
    print(f"compile over {len(rows)} schemas: median {median(secs):.2f} s, max {max(secs):.2f} s")
    for k, x in step.items():
        print(f"{k:10s} C={a.canvas} V={tok.vocab_size} H={a.hidden}: min {x['min_ms']:.0f} ms, median "
              f"{x['median_ms']:.0f} ms")
    print(f"a constrained row adds {ratio:.2f}x its vocabulary pass (medians)")
    emit({"card": card, "vocab": tok.vocab_size, "canvas": a.canvas, "hidden": a.hidden,
          "compile": [{k: v for k, v in r.items() if k != "automaton"} for r in rows],
          "compile_median_s": median(secs), "compile_max_s": max(secs), "step": step, "draw_over_vocab_pass": ratio})


if __name__ == "__main__":
    main()
