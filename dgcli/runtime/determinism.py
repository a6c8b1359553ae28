"""`generate --check-determinism`: the same requests run again, alone and batched, and whether they decide the same.

Owns: `Recorder` (an event consumer keeping each request's decisions per step, its entropies and its answer) and
`check` (the requests run again as the user's run ran them, then batched the other way: alone, or beside a
batch-mate; the first difference). Decisions must be equal bit for bit (the engine's promise); entropies only
within ~1e-4 in fp32 batched (MKL's fp32 GEMM blocks by the batch's rows), so their largest gap is reported.
Must not: print, exit or read the user's files (the CLI says the outcome).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DECISIONS = ("canvas_in", "argmax", "sample", "accepted_mask", "next_canvas")


@dataclass
class Record:
    steps: list[tuple] = field(default_factory=list)  # (block, step, stop_reason, {decision: ids})
    entropies: list[Any] = field(default_factory=list)  # [C] float32 per step (CPU)
    answer: tuple = ()  # (token ids, finish reason)


class Recorder:
    """`on_event` for a run: fills one Record per request (events' `row`), on the host as they come."""

    def __init__(self, inner: Any = None):
        self.records: dict[int, Record] = {}
        self.inner = inner  # the run's own consumer (progress, output), called first

    def __call__(self, event: Any) -> None:
        from dgcli.sampling.events import Done, Step

        if self.inner is not None:
            self.inner(event)
        rec = self.records.setdefault(event.row, Record())
        if isinstance(event, Step):
            ids = {name: getattr(event, name).cpu().tolist() for name in DECISIONS}
            rec.steps.append((event.block, event.step, event.stop_reason, ids))
            rec.entropies.append(event.entropy.float().cpu())
        elif isinstance(event, Done):
            rec.answer = (list(event.token_ids), event.finish_reason)


def first_difference(a: Record, b: Record) -> str | None:
    """Where b first decides otherwise than a, in words; None when every decision and the answer agree."""
    for i, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        if sa[:3] != sb[:3]:
            return f"step record {i + 1}: block {sa[0] + 1} step {sa[1]} ({sa[2]}) against block {sb[0] + 1} " \
                   f"step {sb[1]} ({sb[2]})"
        for name in DECISIONS:
            if sa[3][name] != sb[3][name]:
                at = sum(x != y for x, y in zip(sa[3][name], sb[3][name]))
                return f"block {sa[0] + 1} step {sa[1]}: {name} differs at {at} position(s)"
    if len(a.steps) != len(b.steps):
        return f"{len(a.steps)} steps against {len(b.steps)}"
    if a.answer != b.answer:
        return "the answers differ"
    return None


def entropy_gap(a: Record, b: Record) -> float:
    """The largest |entropy difference| over every step and position (0.0: equal bits)."""
    return max((float((x - y).abs().max()) for x, y in zip(a.entropies, b.entropies)), default=0.0)


@dataclass
class Outcome:
    runs: list[str]  # what each extra run was, in words
    difference: str | None  # the first difference in decisions, with the run and request it was in
    entropy_gap: float


def check(session: Any, requests: list[Any], reference: dict[int, Record], batch_size: int) -> Outcome:
    """Run `requests` (prompt_ids, seed, init_canvas each) again as the reference ran them (batch_size slots),
    then batched the other way, and compare every request's decisions with `reference` (its Recorder's)."""
    from dgcli.runtime.request import run_batch

    def run(reqs: list[Any], slots: int) -> dict[int, Record]:
        rec = Recorder()
        for _ in run_batch(session, [r.prompt_ids for r in reqs], batch_size=slots, seeds=[r.seed for r in reqs],
                           init_canvases=[r.init_canvas for r in reqs], on_event=rec):
            pass
        return rec.records

    n = len(requests)
    plans = [(f"again at batch size {batch_size}", requests, batch_size, range(n))]  # (name, requests, slots, where)
    if batch_size > 1:
        plans.append(("each alone", requests, 1, range(n)))
    else:  # beside a batch-mate: each prompt once more with another seed (in range), so every pass holds two rows
        mates = [type(r)(r.prompt_ids, r.seed ^ 1, None) for r in requests]
        pairs = [x for pair in zip(requests, mates) for x in pair]
        plans.append(("each beside a batch-mate (batch size 2)", pairs, 2, range(0, 2 * n, 2)))
    gap = 0.0
    for name, reqs, slots, where in plans:
        got = run(reqs, slots)
        for i, k in enumerate(where):
            diff = first_difference(reference[i], got[k])
            if diff is not None:
                return Outcome([p[0] for p in plans], f"{name}, request {i + 1}: {diff}", gap)
            gap = max(gap, entropy_gap(reference[i], got[k]))
    return Outcome([p[0] for p in plans], None, gap)
