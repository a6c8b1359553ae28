"""The batched denoising engine: requests in (at any time), events out, continuous batching.

Owns: `Request` (one request and its state while it runs) and `Engine`: a fixed number of slots over one
KV cache, a queue, and `events()`, which runs decoder passes while there is work and yields every
request's BlockStart / Step / Commit / Done (each with `row` = the request's id). Each running request is
at its own step of its own block: a pass runs every one once; a request whose block ends commits it
(an encoder pass over its cache slot) and starts its next block at the next pass, or finishes and frees
its slot, which the next queued request takes (its prompt is encoded into the slot). Requests submitted
while `events()` runs (between two events, from the thread that iterates it: the engine holds no lock)
join at the next pass. A request's first_block_s and total_s count from its submit on the engine's
clock, which runs only while the engine works (not while a consumer holds an event).
Must not: tokenize, print, or validate settings (callers pass checked DiffusionEbParams; `loop.py`
builds requests from user input); sync with the device inside a pass other than once for the stop
decision (and not at all when no running request can stop early); read device values other than through
`host_reads.read` (which declares the stop and commit reads; tests/sampling/test_fake_cuda.py holds the
CUDA path to it). On CUDA `async_stop.AsyncStopEngine` (a subclass; `async_stop.new_engine` picks it)
reads each pass's flags one pass later instead. A `step_mode` other than "dynamic" runs each pass as
`static_step.StaticStep` (static shapes: eager, compiled, or CUDA graphs), which brings its own KV cache.

Numerics: a request's draws are addressed by its own seed, block, step and position (`draws.py`); its
positions start at 0 in its slot; ragged rows attend one by one over exactly their own keys
(`model/gemma.py`). So a request's events do not depend on its batch-mates, their order or the slot it
got (bit for bit in bf16 on CPU; tests/sampling/test_batch.py names the fp32 caveat).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dgcli.errors import UserError
from dgcli.kernels.transfer import to_device
from dgcli.sampling import draws, host_reads
from dgcli.sampling.events import BlockStart, Commit, Done, Event, Step
from dgcli.sampling.rules import RowRules, denoise_step, temperature
from dgcli.sampling.static_step import StaticStep


@torch.inference_mode()
def encode(model: Any, ids: torch.Tensor, cache: Any, lengths: list[int] | None = None,
           rows: list[int] | None = None) -> None:
    if lengths is None and rows is None:
        model.encode(ids, cache)  # the common case, and the mock models' signature
    else:
        model.encode(ids, cache, lengths, rows)
    if ids.device.type == "cuda":  # per block, so that prefill_s / commit_s are real durations
        torch.cuda.synchronize(ids.device)


@dataclass
class Request:
    """One request: what to run (prompt ids: on the host, or already on the model's device; checked params, seed,
    block cap, stop ids, first canvas) and, while it runs, its state (host values only)."""

    id: int  # carried by every event as `row`
    prompt: torch.Tensor  # [P] int64
    params: Any  # DiffusionEbParams
    num_blocks: int
    seed: int
    stops: set[int] = field(default_factory=set)
    first_canvas: torch.Tensor | None = None  # [C]: the first block's canvas instead of random ids
    settings: Any = None  # its params with the seed left out: equal settings batch as one (filled on submit)
    slot: int = -1  # its KV cache slot while it runs
    block: int = 0  # the block being denoised
    step: int = 0  # the step of that block the next decoder pass runs (0-based)
    answer: list[int] = field(default_factory=list)
    counted: int = 0  # ids for tokens_per_forward (HF definition)
    steps_per_block: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    denoise_s: float = 0.0
    commit_s: float = 0.0
    first_block_s: float = 0.0
    submitted: float = 0.0  # the engine's clock at submit: first_block_s and total_s count from here

    @property
    def max_steps(self) -> int:
        return self.params.max_denoising_steps

    def temperature(self, step: int) -> float:
        """T_n of its schedule at 0-based `step` of a block (n = N - step: t_max first), computed when the step
        runs, not up front: a schedule as long as the step cap must never be built in one go."""
        p = self.params
        return _schedule(p.max_denoising_steps - step, p.max_denoising_steps, p.t_min, p.t_max)


# `rules.temperature` (the same float ops), memoized: requests with the same settings share one schedule.
# Bounded, so a server's memory is too.
_schedule = functools.lru_cache(maxsize=8192)(temperature)


class Engine:
    """`slots` requests at once over one KV cache of `max_len` positions per slot (a request needs its
    prompt + (blocks - 1) canvases: its last block is never encoded)."""

    def __init__(self, model: Any, *, slots: int, max_len: int, pad_id: int = 0, compile_tiles: bool = False,
                 stats: dict | None = None, step_mode: str = "dynamic"):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise UserError(f"max_batch={slots!r}: must be a whole number >= 1")
        self.model, self.slots, self.max_len, self.pad_id = model, slots, max_len, pad_id
        self.compile_tiles = compile_tiles
        self.c, self.vocab = model.config.canvas_length, model.config.vocab_size
        self.device = model.embed_weight.device
        self.positions = torch.arange(self.c, device=self.device)  # [C]
        # "dynamic": `denoise_step` (each block's exact shapes); else the static-shape step (static_step.MODES),
        # which brings its own cache (a bucketed capacity, reused by the next engine of this shape).
        self.static = None
        if step_mode == "dynamic":
            self.cache = model.new_cache(slots, max_len)
        else:
            self.static = StaticStep.acquire(model, slots, max_len, step_mode)
            self.cache = self.static.cache
            weakref.finalize(self, self.static.release)
        self.free = list(range(slots))
        self.queue: deque[Request] = deque()
        self.cancelled: set[int] = set()  # ids of running requests to drop before the next pass
        self.active: list[Request] = []  # request k's state is row k of canvas / history / soft
        self.canvas = self.history = self.soft = None  # soft None: every request is at a block's first step
        self.per_row = None  # (seeds [b, 1], accept/stop rules) of the running set; rebuilt when it changes
        self.depth = 0  # the history's length: the largest stability threshold seen
        self.stats = {} if stats is None else stats
        self.stats.update(decoder_passes=0, encoder_passes=0, row_steps=0, denoise_s=0.0, encode_s=0.0)
        # The busy clock: the engine's own time; it pauses while a consumer holds an event.
        self.busy, self.mark = 0.0, time.perf_counter()

    def submit(self, request: Request) -> None:
        if request.prompt.device != self.device:  # a host prompt: sent without waiting for the device
            request.prompt = to_device(request.prompt, torch.long, self.device)
        need = len(request.prompt) + (request.num_blocks - 1) * self.c
        if need > self.max_len:
            raise UserError(f"request {request.id} needs {need} cache positions; this engine holds {self.max_len}")
        p = request.params
        request.settings = dataclasses.replace(p, seed=0)
        self.depth = max(self.depth, p.stability_threshold)
        request.submitted = self._now()
        self.queue.append(request)

    @property
    def idle(self) -> bool:
        return not self.active and not self.queue

    # ---- the pass ----------------------------------------------------------------------------------------

    def events(self) -> Iterator[Event]:
        """Decoder passes while there is work; every request's events, in order."""
        while not self.idle:
            yield from self.step()

    def step(self) -> Iterator[Event]:
        """One decoder pass (after dropping cancelled requests and admitting queued ones) and its events;
        nothing when there is no work. A server's engine thread calls this between reading its inbox."""
        if self.cancelled:
            self._drop_cancelled()
        if not self.idle:
            yield from self._pass()

    def cancel(self, request_id: int) -> bool:
        """Withdraw a request: a queued one leaves the queue now, a running one frees its slot before the
        next pass (it gets no more events, no Done). False when the engine does not hold it."""
        for r in self.queue:
            if r.id == request_id:
                self.queue.remove(r)
                return True
        if any(r.id == request_id for r in self.active):
            self.cancelled.add(request_id)
            return True
        return False

    def _drop_cancelled(self) -> None:
        gone = {k for k, r in enumerate(self.active) if r.id in self.cancelled}
        self.cancelled.clear()
        if gone:
            self._leave(gone)
            if self.soft is not None and all(r.step == 0 for r in self.active):
                self.soft = None

    def _clock(self) -> None:
        now = time.perf_counter()
        self.busy += now - self.mark
        self.mark = now

    def _now(self) -> float:
        return self.busy + time.perf_counter() - self.mark

    def _cache_rows(self) -> list[int] | None:
        """The running requests' slots, or None when they are exactly the cache's rows in order."""
        got = [r.slot for r in self.active]
        return None if got == list(range(self.slots)) else got

    @torch.inference_mode()  # canvas, history and soft come out of inference-mode steps
    def _start_block(self, ks: list[int]) -> None:
        """Requests `ks` begin their current block: its first canvas, an empty history, no
        self-conditioning. New tensors, never writes into old ones: events handed out hold views."""
        dev, active = self.device, self.active
        self.canvas, self.history = self.canvas.clone(), self.history.clone()
        self.soft = None if self.soft is None else self.soft.clone()
        seed_k = to_device([active[k].seed for k in ks], torch.long, dev)[:, None]  # [k, 1]
        block_k = to_device([active[k].block for k in ks], torch.long, dev)[:, None]  # [k, 1]
        idx = to_device(ks, torch.long, dev)
        self.canvas[idx] = draws.token_ids(seed_k, draws.INIT, block_k, 0, self.positions, self.vocab, device=dev)
        for k in ks:
            r = active[k]
            if r.block == 0 and r.first_canvas is not None:
                self.canvas[k] = r.first_canvas
            r.step = 0
        self.history[:, idx] = -1
        if self.soft is not None:
            self.soft[idx] = 0  # the zero soft embedding is exactly "no self-conditioning"

    def _admit(self) -> list[int]:
        """Free slots take queued requests; their prompts are encoded together into their slots."""
        if not self.queue or not self.free:
            return []
        joining = [self.queue.popleft() for _ in range(min(len(self.free), len(self.queue)))]
        t0 = time.perf_counter()
        lengths = [len(r.prompt) for r in joining]
        padded = torch.full((len(joining), max(lengths)), self.pad_id, dtype=torch.long, device=self.device)
        for k, r in enumerate(joining):
            padded[k, :lengths[k]] = r.prompt
            r.slot = self.free.pop(0)
            self.cache.lens[r.slot] = 0
        into = [r.slot for r in joining]
        encode(self.model, padded, self.cache, None if len(set(lengths)) == 1 else lengths,
               None if into == list(range(self.slots)) else into)
        prefill_s = time.perf_counter() - t0
        self.stats["encoder_passes"] += 1
        self.stats["encode_s"] += prefill_s
        for r in joining:
            r.prefill_s = prefill_s
        fresh = list(range(len(self.active), len(self.active) + len(joining)))
        self.active += joining
        self.per_row = None
        j, c, dev = len(joining), self.c, self.device
        self.canvas = torch.empty(j, c, dtype=torch.long, device=dev) if self.canvas is None else \
            torch.cat((self.canvas, self.canvas.new_empty(j, c)))
        if self.history is not None and self.history.shape[0] < self.depth:  # a deeper stability rule joined
            older = self.history.new_full((self.depth - self.history.shape[0], *self.history.shape[1:]), -1)
            self.history = torch.cat((older, self.history))
        hist = torch.empty(self.depth, j, c, dtype=torch.long, device=dev)
        self.history = hist if self.history is None else torch.cat((self.history, hist), dim=1)
        if self.soft is not None:
            self.soft = torch.cat((self.soft, self.soft.new_zeros(j, c, self.soft.shape[2])))
        self._start_block(fresh)
        return fresh

    def _per_row(self) -> tuple[torch.Tensor, Any]:
        """The running set's seeds [b, 1] and accept/stop settings: the shared params when every request has
        the same (but the seed) and the history is exactly as deep as their rule, else one tensor row per
        request. Built once per running set (requests joining or leaving reset it), not per pass."""
        if self.per_row is None:
            active, first = self.active, self.active[0]
            seeds = to_device([r.seed for r in active], torch.long, self.device)[:, None]
            if first.params.stability_threshold == self.depth and all(r.settings == first.settings for r in active):
                rules = first.params
            else:
                rules = RowRules.of([r.params for r in active], self.device)
            self.per_row = seeds, rules
        return self.per_row

    def _pass(self) -> Iterator[Event]:
        dev = self.device
        fresh = self._admit()
        active = self.active
        self._clock()
        for k in fresh:
            r = active[k]
            yield BlockStart(block=0, num_blocks=r.num_blocks, prefix_len=self.cache.lens[r.slot],
                             canvas=self.canvas[k], row=r.id)
        self.mark = time.perf_counter()

        # One decoder pass: every request at its own step of its own block.
        t0 = time.perf_counter()
        b = len(active)
        step_k = to_device([r.step for r in active], torch.long, dev)[:, None] + 1  # [b, 1] 1-based
        seed_k, rules = self._per_row()  # [b, 1]
        block_k = to_device([r.block for r in active], torch.long, dev)[:, None]  # [b, 1]
        uniform = draws.uniform(seed_k, draws.DRAW, block_k, step_k, self.positions, device=dev)  # [b, C]
        noise = draws.token_ids(seed_k, draws.RENOISE, block_k, step_k, self.positions, self.vocab, device=dev)
        temps = [r.temperature(r.step) for r in active]
        temp = to_device(temps, torch.float32, dev)  # [b]
        out, accepted, next_canvas, self.history, stop = self._denoise(
            self.canvas, self.soft, temp, self.history, rules, uniform, noise,
            any(r.step < r.max_steps - 1 for r in active), self._cache_rows())
        # Mean entropy is >= 0, so "< 0" never holds: with confidence 0 (fixed work) no request can stop
        # early and the engine never waits for the device inside a block.
        can_stop_early = any(r.params.confidence_threshold > 0 for r in active)
        stopped = host_reads.read(stop, "stop") if can_stop_early else [False] * b  # the pass's one host sync
        elapsed = time.perf_counter() - t0
        self.stats["decoder_passes"] += 1
        self.stats["row_steps"] += b
        self.stats["denoise_s"] += elapsed
        self._clock()
        ended = []
        canvas_in = self.canvas
        for k, r in enumerate(active):
            i, n_steps = r.step, r.max_steps
            reason = "stable_confident" if stopped[k] else ("step_cap" if i == n_steps - 1 else None)
            r.denoise_s += elapsed
            yield Step(block=r.block, step=i + 1, max_steps=n_steps, temperature=temps[k], canvas_in=canvas_in[k],
                       argmax=out.argmax[k], sample=out.sample[k], accepted_mask=accepted[k],
                       accepted_count=accepted[k].sum(), entropy=out.entropy[k],
                       mean_entropy=out.entropy[k].mean(), next_canvas=next_canvas[k],
                       stop_reason=reason, elapsed_s=elapsed, row=r.id)
            if reason is not None:
                r.steps_per_block.append(i + 1)
                ended.append(k)
            r.step += 1
        self.mark = time.perf_counter()
        self.canvas, self.soft = next_canvas, out.soft
        yield from self._end_blocks(ended, out.argmax)

    def _denoise(self, canvas, soft, temp, history, rules, uniform, noise, want_soft: bool, rows: list[int] | None):
        """One decoder pass of `denoise_step` (or the static step), for the rows of cache slots `rows`."""
        if self.static is not None:
            return self.static(canvas, soft, temp, history, rules, uniform, noise, want_soft, rows)
        return denoise_step(self.model, canvas, self.cache, soft, temp, history, rules, uniform, noise,
                            want_soft=want_soft, compile_tiles=self.compile_tiles, rows=rows)

    def _end_blocks(self, ended: list[int], argmax: torch.Tensor) -> Iterator[Event]:
        """Requests whose block ended: commit, then finish (stop id or block cap) or start the next block."""
        active = self.active
        t0 = time.perf_counter()
        tokens_all = host_reads.read(argmax[ended], "commit") if ended else []  # the blocks' read-back
        read_s = time.perf_counter() - t0
        going_on, leaving = [], set()
        for k, tokens in zip(ended, tokens_all):
            r = active[k]
            r.denoise_s += read_s
            stop_index = next((j for j, t in enumerate(tokens) if t in r.stops), None)
            kept = tokens if stop_index is None else tokens[:stop_index]
            r.answer += kept
            r.counted += sum(t != self.pad_id for t in tokens[: len(kept) + (stop_index is not None)])
            if r.block == 0:
                r.first_block_s = self._now() - r.submitted
            self._clock()
            yield Commit(block=r.block, tokens=tokens, stop_index=stop_index, row=r.id)
            self.mark = time.perf_counter()
            r.block += 1
            if stop_index is None and r.block < r.num_blocks:
                going_on.append(k)
                continue
            leaving.add(k)
            finish, stop_id = ("stop", tokens[stop_index]) if stop_index is not None else ("length", None)
            passes = sum(r.steps_per_block)
            timings = {"prefill_s": r.prefill_s, "denoise_s": r.denoise_s, "commit_s": r.commit_s,
                       "first_block_s": r.first_block_s, "total_s": self._now() - r.submitted}
            self._clock()
            yield Done(token_ids=r.answer, finish_reason=finish, stop_id=stop_id, blocks=len(r.steps_per_block),
                       steps_per_block=r.steps_per_block, decoder_passes=passes,
                       tokens_per_forward=r.counted / passes, timings=timings, row=r.id)
            self.mark = time.perf_counter()
        if going_on:
            t0 = time.perf_counter()
            into = [active[k].slot for k in going_on]  # commit: the block becomes these requests' prefix
            encode(self.model, argmax[going_on], self.cache, rows=None if into == list(range(self.slots)) else into)
            commit_s = time.perf_counter() - t0
            self.stats["encoder_passes"] += 1
            self.stats["encode_s"] += commit_s
            for k in going_on:
                active[k].commit_s += commit_s
            self._start_block(going_on)
            self._clock()
            for k in going_on:
                r = active[k]
                yield BlockStart(block=r.block, num_blocks=r.num_blocks, prefix_len=self.cache.lens[r.slot],
                                 canvas=self.canvas[k], row=r.id)
            self.mark = time.perf_counter()
        if leaving:
            self._leave(leaving)
        if self.soft is not None and all(r.step == 0 for r in self.active):
            self.soft = None  # every request starts a block: the cheaper pass without self-conditioning

    def _leave(self, leaving: set[int]) -> None:
        """Finished requests free their slots (nothing is copied: the slot's length goes back to 0)."""
        for k in sorted(leaving):
            self.free.append(self.active[k].slot)
            self.cache.lens[self.active[k].slot] = 0
        self.free.sort()
        keep = [k for k in range(len(self.active)) if k not in leaving]
        self.active = [self.active[k] for k in keep]
        self.per_row = None
        if not self.active:
            self.canvas = self.history = self.soft = None
            return
        idx = to_device(keep, torch.long, self.device)
        self.canvas, self.history = self.canvas[idx], self.history[:, idx]
        self.soft = None if self.soft is None else self.soft[idx]
