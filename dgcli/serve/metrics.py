"""The server's counters and histograms (`Metrics`, thread-safe) and their Prometheus text (format 0.0.4); what each
measures is in its HELP line. Must not: import a metrics library (the format is a few lines of text) or touch the
engine.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

STEP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A request's latencies (vLLM's buckets for time_to_first_token_seconds, which also cover e2e_request_latency's):
# milliseconds for the bundled model on a CPU, minutes for long answers of a large one.
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_num(le)}"}} {n}' for le, n in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {_num(self.sum)}",
                      f"{name}_count {self.total}"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class Metrics:
    def __init__(self, slots: int):
        self.lock = threading.Lock()
        self.slots = slots
        self.requests: Counter[str] = Counter()  # by HTTP status code
        self.queued = 0  # accepted requests not yet in a slot
        self.running = 0  # requests holding a slot
        self.cancelled = 0
        self.committed_tokens = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the engine's prefix cache
        self.prefix_cache_hits = 0  # of them, tokens found (their blocks held, not encoded again)
        self.steps_per_block = Histogram(STEP_BUCKETS)
        self.pass_latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(REQUEST_BUCKETS)  # accepted -> its first block's tokens out
        self.e2e = Histogram(REQUEST_BUCKETS)  # accepted -> its answer's end (finished requests)
        self.progress_at = time.monotonic()  # when the engine thread last made progress
        self.engine_waiting = True  # blocked on an empty inbox: no progress is due

    def engine_progress(self, *, waiting: bool) -> None:
        """The engine thread made progress (finished a pass, handled a message); `waiting`: it now waits for work."""
        with self.lock:
            self.progress_at, self.engine_waiting = time.monotonic(), waiting

    def engine_age(self) -> float:
        """Seconds since the engine thread last made progress; 0 while it waits for work."""
        with self.lock:
            return 0.0 if self.engine_waiting else time.monotonic() - self.progress_at

    def count(self, status: int) -> None:
        with self.lock:
            self.requests[str(status)] += 1

    def block(self, steps: int, tokens: int) -> None:
        with self.lock:
            self.steps_per_block.observe(steps)
            self.committed_tokens += tokens

    def prefix_cache(self, queries: int, hits: int) -> None:
        """The engine's running totals (its stats), copied after a pass."""
        with self.lock:
            self.prefix_cache_queries, self.prefix_cache_hits = queries, hits

    def observe(self, histogram: Histogram, value: float) -> None:
        with self.lock:
            histogram.observe(value)

    def render(self) -> str:
        age = self.engine_age()
        with self.lock:
            lines = ["# HELP dgemma_requests_total HTTP requests answered, by status code.",
                     "# TYPE dgemma_requests_total counter"]
            lines += [f'dgemma_requests_total{{status="{code}"}} {n}' for code, n in sorted(self.requests.items())]
            for name, kind, value, what in (
                ("queue_depth", "gauge", self.queued, "Accepted requests waiting for a slot."),
                ("slots_busy", "gauge", self.running, "Requests holding a KV-cache slot (being denoised)."),
                ("slots_total", "gauge", self.slots, "Slots of the engine (--max-batch-size)."),
                ("requests_cancelled_total", "counter", self.cancelled,
                 "Requests withdrawn from the engine (client gone, stop string, max_tokens reached, shutdown)."),
                ("committed_tokens_total", "counter", self.committed_tokens,
                 "Answer tokens committed by finished blocks (up to a stop id; before a stop-string or max_tokens cut)."),
                ("prefix_cache_queries_total", "counter", self.prefix_cache_queries,
                 "Prompt tokens looked up in the prefix cache (0 with --no-prefix-caching)."),
                ("prefix_cache_hits_total", "counter", self.prefix_cache_hits,
                 "Prompt tokens found in the prefix cache: whole blocks of an earlier prompt or answer, not encoded again."),
                ("engine_last_progress_seconds", "gauge", round(age, 3),
                 "Seconds since the engine thread last finished a decoder pass or handled a message; 0 while it "
                 "waits for work. Past --stall-timeout, /health answers 503."),
            ):
                lines += [f"# HELP dgemma_{name} {what}", f"# TYPE dgemma_{name} {kind}", f"dgemma_{name} {value}"]
            for name, hist, what in (
                ("denoising_steps_per_block", self.steps_per_block, "Denoising steps each committed block took."),
                ("step_latency_seconds", self.pass_latency,
                 "One decoder pass (a denoising step of every running request)."),
                ("time_to_first_token_seconds", self.ttft,
                 "From accepting a request to its first block's tokens (vLLM's time_to_first_token_seconds; a "
                 "block commits whole, so its first token comes with the block)."),
                ("e2e_request_latency_seconds", self.e2e,
                 "From accepting a request to the end of its answer, for requests that finished (vLLM's "
                 "e2e_request_latency_seconds)."),
            ):
                lines += [f"# HELP dgemma_{name} {what}", f"# TYPE dgemma_{name} histogram"]
                lines += hist.lines(f"dgemma_{name}")
        return "\n".join(lines) + "\n"
