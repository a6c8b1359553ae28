"""Quality figures of bench and sweep rows, one definition each: exact match against a prompt file's answers
(the bundled held-out set has them), else agreement with a reference setting's output. Must not: run the model,
time or print anything.
"""

from __future__ import annotations

import json
from typing import Any


def agreement(ids: list[int], reference: list[int]) -> float:
    """Share of positions with equal ids, over the longer of the two sequences (a length difference counts
    as disagreement); two empty outputs agree fully."""
    n = max(len(ids), len(reference))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(ids, reference)) / n


def exact_match(text: str, answer: str) -> bool:
    """The bundled tasks' rule: equal after stripping surrounding whitespace."""
    return text.strip() == answer.strip()


def quality_of(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pass_exact_match(prompts: list[Any], responses: list[Any]) -> list[float]:
    """1.0 or 0.0 per answered prompt of one pass (prompts without an answer or decoded text left out)."""
    return [float(exact_match(r.text, p.answer)) for p, r in zip(prompts, responses)
            if p.answer is not None and r.text is not None]


def json_valid_rate(runs: list[list[Any]]) -> float | None:
    """Share of the decoded answers of every pass that parse as JSON."""
    def parses(text: str) -> bool:
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    return quality_of([float(parses(r.text)) for run in runs for r in run if r.text is not None])


def bench_quality(prompts: list[Any], runs: list[list[Any]]) -> dict:
    """The `quality` fields of a bench row: exact match over every answered prompt of every pass, else None."""
    scores = [s for run in runs for s in pass_exact_match(prompts, run)]
    if not scores:
        return {"quality_metric": None, "quality": None, "exact_match": None}
    q = quality_of(scores)
    return {"quality_metric": "exact_match", "quality": q, "exact_match": q,
            "answered_prompts": sum(p.answer is not None for p in prompts)}
