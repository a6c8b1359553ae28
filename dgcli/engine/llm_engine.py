"""The batched denoising engine: requests in (at any time), events out, one executor for every device.

Owns: `Request` (one request and its state while it runs), `Engine` and `new_engine`. Each `step()` asks the
scheduler (`scheduler.py`) for a plan and runs it as ONE forward pass of the model over the paged KV cache:
prompt chunks, the commits of blocks that ended and every running request's canvas together (mixed phases;
`model/attention.py` gives every row its keys). The pass's sampler work (vocabulary pass, accept, renoise,
stop flags) runs on the canvas rows on the device; then the pass is settled: its stop flags and the tokens of
the blocks that ended are read (`host_reads`), and its events handed out (BlockStart / Step / Commit / Done,
each with `row` = the request's id). A block that ends is committed in the request's next pass, beside the
first step of its next block; the request's last block is never committed. `graphs`: denoise-only passes replay
CUDA graphs (model/graphs.py); `prefix_caching`: requests share cached whole prompt blocks (scheduler.py).
`lag` (1 on CUDA, 0 elsewhere): with lag 1 pass n+1 is launched before pass n is settled, so the host never
waits for the device inside a block: every running request speculatively goes on to its next step, and a row
whose request stopped at pass n is discarded when pass n+1 settles (no event, no state from it). So both lags
give every request the same steps, draws and tokens (tests/sampling/test_engine_lag.py); lag 1 costs one
discarded row-step per early stop. Requests submitted or cancelled between two steps (from the thread that
calls `step`: the engine holds no lock) take effect at the next pass. A request's clock (first_block_s,
total_s) runs from its submit on the engine's busy clock, which pauses while a consumer holds an event.
Numerics: a request's draws are addressed by its own seed, block, step and position (`draws.py`) and its
positions start at 0 in its own sequence, so its events do not depend on its batch-mates (bit for bit in bf16
on CPU; tests/sampling/test_batch.py names the fp32 caveat) or on how its prompt was chunked beyond rounding.
Must not: tokenize, print, validate settings (callers pass checked DiffusionEbParams), or read device values
other than through `host_reads.read`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dgcli.errors import UserError
from dgcli.kernels.transfer import to_device
from dgcli.sampling import draws, host_reads
from dgcli.sampling.events import BlockStart, Commit, Done, Event, Step
from dgcli.sampling.rules import RowRules, sample_step, temperature
from dgcli.sampling.scheduler import Plan, Scheduler

DEFAULT_BUDGET = 2048  # rows (tokens) per pass: running canvases first, then prompt chunks


@dataclass(eq=False)
class Request:
    """One request: what to run (prompt ids: on the host, or already on the model's device; checked params, seed,
    block cap, stop ids, first canvas) and, while it runs, its state."""

    id: int  # carried by every event as `row`
    prompt: torch.Tensor  # [P] int64
    params: Any  # DiffusionEbParams
    num_blocks: int
    seed: int
    stops: set[int] = field(default_factory=set)
    first_canvas: torch.Tensor | None = None  # [C]: the first block's canvas instead of random ids
    settings: Any = None  # its params with the seed left out: equal settings batch as one (filled on submit)
    slot: int = -1  # its cache sequence while admitted
    prefilled: int = 0  # prompt ids in the cache
    prefix: int = 0  # positions before its canvas (prompt + committed blocks, the pending commit included)
    commit: torch.Tensor | None = None  # [C] ids of its last block, committed by its next pass
    block: int = 0  # the block being denoised
    step: int = 0  # the step of that block its next pass runs (0-based)
    waiting: bool = False  # its block ends at a pass not yet settled: no step to run until then
    canvas: Any = None  # [C] its canvas for the next step (device)
    history: Any = None  # [S, C] its previous argmaxes (device), S = its stability threshold
    soft: Any = None  # [C, H] its soft embedding, None at a block's first step
    answer: list[int] = field(default_factory=list)
    counted: int = 0  # ids for tokens_per_forward (HF definition)
    steps_per_block: list[int] = field(default_factory=list)
    prefill_s: float = 0.0  # the passes carrying its prompt rows, whole (the last also runs its first step)
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
_schedule = functools.lru_cache(maxsize=8192)(temperature)


@dataclass
class _Pass:
    """A launched pass: its plan, the block and step each canvas row ran, its device results, its clock."""

    plan: Plan
    blocks: list[int]
    steps: list[int]
    canvas_in: Any = None
    out: Any = None
    accepted: Any = None
    next_canvas: Any = None
    stop: Any = None  # [b] bool (device, or its pinned copy), None when no row can stop early
    timing: Any = None  # CUDA (start, end) events, or the host seconds of the launch


def new_engine(model: Any, *, step_mode: str = "dynamic", **kw: Any) -> Engine:
    """step_mode "graphs" (--cuda-graphs): decode-only passes replay CUDA graphs (model/graphs.py)."""
    if step_mode not in ("dynamic", "graphs"):
        raise UserError(f"step mode {step_mode!r}: choose dynamic or graphs")
    return Engine(model, graphs=step_mode == "graphs", **kw)


class Engine:
    """`slots` requests at once over one paged KV cache of `max_len` positions per request (prompt + (blocks - 1)
    canvases: a request's last block is never committed)."""

    def __init__(self, model: Any, *, slots: int, max_len: int, pad_id: int = 0, compile_tiles: bool = False,
                 stats: dict | None = None, lag: int | None = None, budget: int = DEFAULT_BUDGET,
                 block_size: int = 16, graphs: bool = False, prefix_caching: bool = False):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise UserError(f"max_batch={slots!r}: must be a whole number >= 1")
        self.model, self.slots, self.max_len, self.pad_id = model, slots, max_len, pad_id
        self.compile_tiles = compile_tiles
        self.c, self.vocab = model.config.canvas_length, model.config.vocab_size
        self.device = model.embed_weight.device
        self.lag = (1 if self.device.type == "cuda" else 0) if lag is None else lag
        # the draws' position words 0..C-1, mixed once (draws.uniform_at / token_ids_at fold them per row)
        self.mixed_positions = draws.mixed_positions(torch.arange(self.c, device=self.device))
        # Room for the prompt, the committed blocks and a canvas (full layers hold its keys where it will commit).
        # prefix_caching: whole blocks of prompts and committed blocks are kept and shared (model/paged.py)
        self.prefix_caching = prefix_caching
        # (a pass's causal rows: the commits and the prompt chunks under the budget, or one canvas's worth: scheduler.py)
        self.cache = model.new_cache(slots + graphs, max_len + self.c, block_size=block_size,
                                     **({"prefix_caching": True, "pass_rows": max(budget, (slots + 1) * self.c)}
                                        if prefix_caching else {}))
        self.stats = {} if stats is None else stats
        self.sched = Scheduler(self.cache, seqs=slots, canvas=self.c, budget=budget, prefix_caching=prefix_caching,
                               stats=self.stats)
        self.graphs = None
        if graphs:  # sequence `slots` (never scheduled) holds the canvas that pads a graph's bucket
            self.cache.reserve(slots, self.c)
            self.graphs = model.pass_graphs(self.cache, slots, slots, capture=self.device.type == "cuda")
        self.pending: _Pass | None = None
        self.cancelled: set[int] = set()
        self.stats.update(decoder_passes=0, encoder_passes=0, row_steps=0, denoise_s=0.0, encode_s=0.0,
                          discarded_row_steps=0, prefill_tokens=0, graph_passes=0)
        self.busy, self.mark = 0.0, time.perf_counter()  # the busy clock; it pauses while a consumer holds an event

    # ---- requests in and out ------------------------------------------------------------------------------

    def submit(self, request: Request, ids: list[int] | None = None) -> None:
        """`ids`: the prompt's ids on the host when the caller has them (prefix caching keys blocks by them;
        without them they are read from the prompt once, here, outside any pass)."""
        if self.prefix_caching and ids is None:
            p = request.prompt
            ids = p.tolist() if p.device.type == "cpu" else host_reads.read(p, "prompt")
        if request.prompt.device != self.device:  # a host prompt: sent without waiting for the device
            request.prompt = to_device(request.prompt, torch.long, self.device)
        need = len(request.prompt) + (request.num_blocks - 1) * self.c
        if need > self.max_len:
            raise UserError(f"request {request.id} needs {need} cache positions; this engine holds {self.max_len}")
        request.settings = dataclasses.replace(request.params, seed=0)
        request.submitted = self._now()
        self.sched.submit(request, ids)

    @property
    def idle(self) -> bool:
        return self.sched.idle and self.pending is None

    def cancel(self, request_id: int) -> bool:
        """Withdraw a request: a queued one leaves the queue now, an admitted one before the next pass (no more
        events, no Done). False when the engine does not hold it."""
        s = self.sched
        for r in s.queue:
            if r.id == request_id:
                s.withdraw(r)
                return True
        if any(r.id == request_id for r in (*s.prefilling, *s.running)):
            self.cancelled.add(request_id)
            return True
        return False

    def events(self) -> Iterator[Event]:
        """Passes while there is work; every request's events, in order."""
        while not self.idle:
            yield from self.step()

    def step(self) -> Iterator[Event]:
        """One pass (after dropping cancelled requests and admitting queued ones) and the events it settles."""
        if self.cancelled:
            for r in [r for r in (*self.sched.prefilling, *self.sched.running) if r.id in self.cancelled]:
                self.sched.release(r)
            self.cancelled.clear()
        launched = None
        if not self.sched.idle:
            plan = self.sched.plan(lambda r: not r.waiting)
            if plan.started:
                self._start_block(plan.started)
                self._clock()
                for r in plan.started:
                    yield BlockStart(block=0, num_blocks=r.num_blocks, prefix_len=r.prefix, canvas=r.canvas, row=r.id)
                self.mark = time.perf_counter()
            if plan.segments:
                launched = self._launch(plan)
        if self.lag:
            done, self.pending = self.pending, launched
        else:
            done = launched
        if done is not None:
            yield from self._settle(done)

    # ---- the busy clock -----------------------------------------------------------------------------------

    def _clock(self) -> None:
        now = time.perf_counter()
        self.busy += now - self.mark
        self.mark = now

    def _now(self) -> float:
        return self.busy + time.perf_counter() - self.mark

    # ---- launch -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _start_block(self, rs: list[Request]) -> None:
        """Requests `rs` begin their current block: its first canvas, an empty history, no self-conditioning."""
        dev = self.device
        states = draws.rows([(r.seed, draws.INIT, r.block, 0) for r in rs], dev)  # [k, 1]
        canvas = draws.token_ids_at(states, self.mixed_positions, self.vocab)  # [k, C]
        for k, r in enumerate(rs):
            r.canvas = r.first_canvas if r.block == 0 and r.first_canvas is not None else canvas[k]
            r.history = torch.full((r.params.stability_threshold, self.c), -1, dtype=torch.long, device=dev)
            r.soft, r.step, r.waiting = None, 0, False

    @torch.inference_mode()
    def _launch(self, plan: Plan) -> _Pass:
        dev, rows = self.device, plan.canvases
        t0, timing = time.perf_counter(), None
        if dev.type == "cuda":
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        p = _Pass(plan, [r.block for r in rows], [r.step for r in rows])
        soft = None
        if rows:
            p.canvas_in = torch.stack([r.canvas for r in rows])  # [b, C]
            if any(r.soft is not None for r in rows):  # the zero soft embedding is exactly "none"
                zero = next(r.soft for r in rows if r.soft is not None).new_zeros(self.c, self.model.config.hidden_size)
                soft = torch.stack([zero if r.soft is None else r.soft for r in rows])
        ids = torch.cat([*plan.causal_ids, *([p.canvas_in.flatten()] if rows else [])])
        hidden = None if self.graphs is None else self.graphs.forward(ids, plan.segments, soft)
        if hidden is None:
            hidden = self.model.forward_pass(ids, plan.segments, self.cache, soft)
        else:
            self.stats["graph_passes"] += 1
        for r in plan.commits:
            r.commit = None
        if rows:
            self._sample(p, hidden)
        if timing is not None:
            timing[1].record()
        p.timing = timing if timing is not None else time.perf_counter() - t0
        return p

    def _sample(self, p: _Pass, hidden: torch.Tensor) -> None:
        """The canvas rows' sampler step on the device; each request's state goes on speculatively to its next
        step (confirmed, or discarded, when the pass is settled)."""
        dev, rows = self.device, p.plan.canvases
        depth = max(r.params.stability_threshold for r in rows)
        hist = torch.stack([self._history(r, depth) for r in rows], dim=1)  # [S, b, C]
        counters = [(r.seed, b, s + 1) for r, b, s in zip(rows, p.blocks, p.steps)]
        uniform = draws.uniform_at(draws.rows([(x, draws.DRAW, b, s) for x, b, s in counters], dev),
                                   self.mixed_positions)  # [b, C]
        noise = draws.token_ids_at(draws.rows([(x, draws.RENOISE, b, s) for x, b, s in counters], dev),
                                   self.mixed_positions, self.vocab)
        temp = to_device([r.temperature(s) for r, s in zip(rows, p.steps)], torch.float32, dev)  # [b]
        first = rows[0]
        same = first.params.stability_threshold == depth and all(r.settings == first.settings for r in rows)
        rules = first.params if same else RowRules.of([r.params for r in rows], dev)
        want_soft = any(s < r.max_steps - 1 for r, s in zip(rows, p.steps))
        out, accepted, next_canvas, new_hist, stop = sample_step(self.model, hidden, temp, hist, rules, uniform, noise,
                                                                 want_soft, self.compile_tiles)
        p.out, p.accepted, p.next_canvas = out, accepted, next_canvas
        if any(r.params.confidence_threshold > 0 for r in rows):  # else no row can stop early: nothing to read
            p.stop = stop
            if dev.type == "cuda":  # read a pass late: a pinned copy, done by then
                p.stop = torch.empty(stop.shape, dtype=torch.bool, pin_memory=True).copy_(stop, non_blocking=True)
        s_all, canvases, hists = new_hist.shape[0], next_canvas.unbind(), new_hist.unbind(1)  # views: one call each
        softs = [None] * len(rows) if out.soft is None else out.soft.unbind()
        for k, r in enumerate(rows):
            if r.step + 1 < r.max_steps:
                r.step += 1
                r.canvas, r.soft, s = canvases[k], softs[k], r.params.stability_threshold
                r.history = hists[k] if s == s_all else hists[k][s_all - s:]
            else:
                r.waiting = True  # its block ends at this pass whatever the flags say

    @staticmethod
    def _history(r: Request, depth: int) -> torch.Tensor:
        """r's history [S_r, C] as [depth, C]: older entries it does not have are -1 (never equal)."""
        h = r.history
        if h.shape[0] < depth:
            h = torch.cat((h.new_full((depth - h.shape[0], h.shape[1]), -1), h))
        return h

    # ---- settle -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _settle(self, p: _Pass) -> Iterator[Event]:
        if isinstance(p.timing, tuple):
            p.timing[1].synchronize()  # the pass is done: reading its flags and clock waits for nothing
            elapsed = p.timing[0].elapsed_time(p.timing[1]) / 1e3
        else:
            elapsed = p.timing
        plan, rows = p.plan, p.plan.canvases
        st = self.stats
        st["encoder_passes"] += bool(plan.commits or plan.prefills)
        st["prefill_tokens"] += sum(s.length for s in plan.segments if not s.canvas) - len(plan.commits) * self.c
        if not rows:
            st["encode_s"] += elapsed
        for r in plan.prefills:
            r.prefill_s += elapsed
        for r in plan.commits:
            r.commit_s += elapsed
        if not rows:
            return
        st["decoder_passes"] += 1
        st["row_steps"] += len(rows)
        st["denoise_s"] += elapsed
        stopped = host_reads.read(p.stop, "stop") if p.stop is not None else [False] * len(rows)
        self._clock()
        ended = []
        for k, r in enumerate(rows):
            i = p.steps[k]
            if r.slot < 0 or r.block != p.blocks[k]:  # left, or its block ended at an earlier pass
                st["discarded_row_steps"] += 1
                continue
            reason = "stable_confident" if stopped[k] else ("step_cap" if i == r.max_steps - 1 else None)
            r.denoise_s += elapsed
            out = p.out
            yield Step(block=r.block, step=i + 1, max_steps=r.max_steps, temperature=r.temperature(i),
                       canvas_in=p.canvas_in[k], argmax=out.argmax[k], sample=out.sample[k],
                       accepted_mask=p.accepted[k], accepted_count=p.accepted[k].sum(), entropy=out.entropy[k],
                       mean_entropy=out.entropy[k].mean(), next_canvas=p.next_canvas[k], stop_reason=reason,
                       elapsed_s=elapsed, row=r.id)
            if reason is not None:
                r.steps_per_block.append(i + 1)
                ended.append(k)
        self.mark = time.perf_counter()
        if ended:
            yield from self._end_blocks(p, ended)

    def _end_blocks(self, p: _Pass, ended: list[int]) -> Iterator[Event]:
        """Requests whose block ended at pass p: finish (stop id or block cap) or queue the commit and start the
        next block."""
        t0 = time.perf_counter()
        argmax = p.out.argmax
        tokens_all = host_reads.read(argmax[ended], "commit")  # the blocks' read-back
        read_s = time.perf_counter() - t0
        going_on = []
        for k, tokens in zip(ended, tokens_all):
            r = p.plan.canvases[k]
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
                r.commit, r.prefix = argmax[k], r.prefix + self.c
                self.sched.committed(r, tokens)  # its commit pass writes their keys (prefix caching keys them)
                going_on.append(r)
                continue
            self.sched.release(r)
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
            self._start_block(going_on)
            self._clock()
            for r in going_on:
                yield BlockStart(block=r.block, num_blocks=r.num_blocks, prefix_len=r.prefix, canvas=r.canvas,
                                 row=r.id)
            self.mark = time.perf_counter()
