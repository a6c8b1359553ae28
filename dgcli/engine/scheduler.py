"""Which rows the next pass runs: the scheduler of the engine (host only).

Owns: `Plan` (one pass: its segments in row order, the requests whose prompt chunk, commit or canvas it carries)
and `Scheduler` (the waiting queue, the requests being prefilled, the running ones, their cache sequences).
Each pass: free sequences take queued requests whose positions the cache can reserve; every running request's
canvas runs (a block that ended rides along as its commit: causal rows before it); admitted prompts are encoded
in chunks in arrival order under a per-pass token budget (running canvases count against it; a prompt still gets
one canvas's worth when they fill it), so a long prompt never stalls the requests that are denoising. A request
whose prompt completes in a pass starts its first block in that same pass.
Prefix caching: at admission a request holds the cache's longest run of whole blocks of its prompt and encodes
only the rest; the whole blocks a planned pass completes are keyed for later requests (`cache.register`) once
the pass that writes them is planned. Counts prompt tokens looked up and found (`prefix_cache_queries`,
`prefix_cache_hits`, as vLLM counts them). Each plan first trims every sequence's sliding blocks below where its
later passes start (`cache.trim`), then holds the positions its causal segments write (`cache.hold`).
Must not: touch tensors other than slicing a request's ids, read the device, or know about the sampler's math.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Seg:
    """A segment as the model takes it (`model/attention.py: Segment`), kept here to stay out of the model."""

    seq: int
    start: int
    length: int
    canvas: bool
    spans: tuple = ()  # its image runs that see each other (positions)


@dataclass
class Plan:
    segments: list[Seg] = field(default_factory=list)  # causal first, then canvases
    causal_ids: list[Any] = field(default_factory=list)  # device id tensors of the causal segments, in order
    prefills: list[Any] = field(default_factory=list)  # requests with a prompt chunk in this pass
    commits: list[Any] = field(default_factory=list)  # requests whose last block is committed in this pass
    canvases: list[Any] = field(default_factory=list)  # requests whose canvas runs a step, in row order
    started: list[Any] = field(default_factory=list)  # requests whose prompt completes here (first block)


def _whole_spans(spans: tuple, start: int, n: int) -> int:
    """A chunk of n rows from `start`, cut before (or, when it starts inside one, stretched to the end of) an image
    span it would split: an image's tokens see each other, so they are encoded in one pass."""
    end = start + n
    for a, b in spans:
        if a < end < b:
            end = a if a > start else b
    return end - start


class Scheduler:
    def __init__(self, cache: Any, *, seqs: int, canvas: int, budget: int, prefix_caching: bool = False,
                 stats: dict | None = None):
        self.cache, self.c, self.budget = cache, canvas, budget
        self.free = list(range(seqs))
        self.queue: deque = deque()
        self.prefilling: list = []  # admitted, prompt not fully encoded yet (arrival order)
        self.running: list = []  # denoising; row k of a pass's canvases is running[k] when every one runs
        # Prefix caching: each request's host ids of its positions so far (prompt, then committed blocks).
        self.prefix_caching, self.ids = prefix_caching, {}
        self.front: dict[int, int] = {}  # sequence -> the first position its later passes can start at
        self.stats = {} if stats is None else stats
        self.stats.update(prefix_cache_queries=0, prefix_cache_hits=0)

    def submit(self, r: Any, ids: list[int] | None = None) -> None:
        """Queue r; `ids`: its prompt's ids on the host (what prefix caching looks up and keys blocks by)."""
        if self.prefix_caching:
            self.ids[r] = list(ids)
        self.queue.append(r)

    def withdraw(self, r: Any) -> None:
        """A queued request leaves before it was admitted."""
        self.queue.remove(r)
        self.ids.pop(r, None)

    def committed(self, r: Any, tokens: list[int]) -> None:
        """r's block ended with `tokens` (all C ids): their keys are written by its commit, in its next pass."""
        if self.prefix_caching:
            self.ids[r] += tokens

    @property
    def idle(self) -> bool:
        return not (self.queue or self.prefilling or self.running)

    def admit(self) -> None:
        """Free sequences take queued requests (in order) while the cache can reserve their positions."""
        while self.queue and self.free:
            r = self.queue[0]
            need = len(r.prompt) + r.num_blocks * self.c
            if self.prefix_caching:  # its prompt's longest cached run of whole blocks is held, not encoded again
                hit, b = self.cache.lookup(self.ids[r][:len(r.prompt)]), self.cache.block_size
                while hit and any(a < len(hit) * b < e for a, e in r.spans):  # an image's tokens: all or none
                    hit = hit[:-1]
                if not self.cache.reserve(self.free[0], need, shared=hit):
                    break
                r.prefilled = len(hit) * b
                self.stats["prefix_cache_queries"] += len(r.prompt)
                self.stats["prefix_cache_hits"] += r.prefilled
            elif not self.cache.reserve(self.free[0], need):
                break
            self.queue.popleft()
            r.slot = self.free.pop(0)
            self.prefilling.append(r)

    def release(self, r: Any) -> None:
        """r leaves (finished or cancelled): its sequence and blocks are free for the next pass."""
        if r in self.running:
            self.running.remove(r)
        if r in self.prefilling:
            self.prefilling.remove(r)
        self.cache.release(r.slot)
        self.ids.pop(r, None)
        self.front.pop(r.slot, None)
        self.free.append(r.slot)
        self.free.sort()
        r.slot = -1

    def plan(self) -> Plan:
        """The next pass: the running requests' canvases but those waiting for their block's end to be read."""
        if self.prefix_caching:
            for seq, start in self.front.items():
                self.cache.trim(seq, start)
        self.admit()
        p, c = Plan(), self.c
        keyed = []  # (request, positions written so far): whole blocks to key once their sliding blocks are held
        canvases = [r for r in self.running if not r.waiting]
        for r in canvases:
            if r.commit is not None:
                p.segments.append(Seg(r.slot, r.prefix - c, c, False))
                p.causal_ids.append(r.commit)
                p.commits.append(r)
                keyed.append((r, r.prefix))
        left = self.budget - len(canvases) * c - len(p.commits) * c
        if self.prefilling and left < 1:
            left = c  # progress for the prompts whatever the running set
        for r in list(self.prefilling):
            n = _whole_spans(r.spans, r.prefilled, min(len(r.prompt) - r.prefilled, left))
            if n < 1 and r.prefilled < len(r.prompt):
                break
            if n > 0:  # (none when its whole prompt was a prefix hit)
                spans = tuple((a, b) for a, b in r.spans if r.prefilled <= a < r.prefilled + n)  # (whole: see above)
                p.segments.append(Seg(r.slot, r.prefilled, n, False, spans))
                p.causal_ids.append(r.prompt[r.prefilled:r.prefilled + n])
                p.prefills.append(r)
                r.prefilled += n
                left -= n
                keyed.append((r, r.prefilled))
            if r.prefilled == len(r.prompt):
                self.prefilling.remove(r)
                self.running.append(r)
                r.prefix = len(r.prompt)
                p.started.append(r)
                canvases.append(r)
        p.canvases = canvases
        p.segments += [Seg(r.slot, r.prefix, c, True) for r in canvases]
        if self.prefix_caching:
            for s in p.segments:  # (a canvas after its sequence's causal rows: where its later passes start)
                if not s.canvas:
                    self.cache.hold(s.seq, s.start, s.start + s.length)
                self.front[s.seq] = s.start if s.canvas else s.start + s.length
            for r, upto in keyed:
                self.cache.register(r.slot, self.ids[r][:upto])
        return p
