"""The engine: requests in (at any time), events out; one per session (or server), living as long as its owner.

Owns: `LLMEngine`, `new_engine` and `KeptEngine`. Each `step()` drops cancelled requests, asks the scheduler for a
plan, has the runner run it and settles the pass handed back into events (each with `row` = the request's id). A
block that ends is committed in the request's next pass, beside the first step of its next block; a request's
last block is never committed. With the runner's lag 1 (CUDA) a row whose request stopped at pass n is discarded
when pass n+1 settles, so both lags give every request the same steps, draws and tokens (one discarded row-step
per early stop). Requests added or cancelled between two steps (from the thread that calls `step`: no lock) take
effect at the next pass. A request's clock (first_block_s, total_s) runs from its submit on the engine's busy
clock, which pauses while a consumer holds an event.
Numerics: a request's events do not depend on its batch-mates (bit for bit in bf16 on CPU without AMX: with AMX,
oneDNN's bf16 GEMM picks its kernel by the row count, benchmarks/RESULTS.md "Eighteenth session") or on how its
prompt was chunked beyond rounding.
Must not: tokenize, print, validate settings (callers pass checked DiffusionEbParams), or read device values
other than through the runner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dgcli.engine.request import Request, image_spans
from dgcli.engine.runner import ModelRunner, Pass
from dgcli.engine.scheduler import Scheduler
from dgcli.errors import UserError
from dgcli.kernels.transfer import to_device
from dgcli.sampling import host_reads
from dgcli.sampling.events import BlockStart, Commit, Done, Event, Step

DEFAULT_BUDGET = 2048  # rows (tokens) per pass: running canvases first, then prompt chunks
_COUNTERS = dict(decoder_passes=0, encoder_passes=0, row_steps=0, denoise_s=0.0, encode_s=0.0, discarded_row_steps=0,
                 prefill_tokens=0, graph_passes=0)


def new_engine(model: Any, *, step_mode: str = "dynamic", **kw: Any) -> LLMEngine:
    """step_mode "graphs" (--cuda-graphs): decode-only passes replay CUDA graphs (model/graphs.py)."""
    if step_mode not in ("dynamic", "graphs"):
        raise UserError(f"step mode {step_mode!r}: choose dynamic or graphs")
    return LLMEngine(model, graphs=step_mode == "graphs", **kw)


class LLMEngine:
    """`slots` requests at once over one paged KV cache of `max_len` positions per request (prompt + (blocks - 1)
    canvases: a request's last block is never committed)."""

    def __init__(self, model: Any, *, slots: int, max_len: int, pad_id: int = 0, compile_tiles: bool = False,
                 stats: dict | None = None, lag: int | None = None, budget: int = DEFAULT_BUDGET,
                 block_size: int = 16, graphs: bool = False, prefix_caching: bool = False):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise UserError(f"max_batch={slots!r}: must be a whole number >= 1")
        self.model, self.slots, self.max_len, self.pad_id = model, slots, max_len, pad_id
        self.c = model.config.canvas_length
        self.device = model.embed_weight.device
        lag = (1 if self.device.type == "cuda" else 0) if lag is None else lag
        self.prefix_caching = prefix_caching
        vision = getattr(model, "vision", None)  # a prompt chunk stretches to the end of an image it starts in
        # the most causal rows a pass writes: the commits and prompt chunks under the budget, or a canvas's worth
        pass_rows = max(budget + (vision.config.soft_tokens if vision is not None else 0), (slots + 1) * self.c)
        # room for the prompt, the committed blocks and a canvas (full layers hold its keys where it will commit)
        self.cache = model.new_cache(slots + graphs, max_len + self.c, block_size=block_size,
                                     **({"prefix_caching": True, "pass_rows": pass_rows} if prefix_caching else {}))
        self.stats = {} if stats is None else stats
        self.sched = Scheduler(self.cache, seqs=slots, canvas=self.c, budget=budget, prefix_caching=prefix_caching,
                               stats=self.stats)
        self.runner = ModelRunner(model, self.cache, slots=slots, graphs=graphs, compile_tiles=compile_tiles, lag=lag,
                                  stats=self.stats)
        self.lag, self.graphs = lag, self.runner.graphs
        self.cancelled: set[int] = set()
        self.stats.update(_COUNTERS)
        self.busy, self.mark = 0.0, time.perf_counter()  # the busy clock; it pauses while a consumer holds an event

    def reset(self, stats: dict | None = None) -> None:
        """An idle engine starts over as a new one would: its counters at zero (in `stats`, if given: the caller
        reads them as they grow), no cached prompt blocks, its clock at zero. Its cache and graphs stay."""
        if not self.idle:
            raise RuntimeError("reset: the engine still holds requests")
        self.stats = {} if stats is None else stats
        self.sched.stats = self.runner.stats = self.stats
        self.stats.update(_COUNTERS, prefix_cache_queries=0, prefix_cache_hits=0)
        if self.prefix_caching:
            self.cache.drop_cached()
        self.runner.images.clear()
        self.busy, self.mark = 0.0, time.perf_counter()

    # ---- requests in and out ------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], *, request_id: int, params: Any, num_blocks: int,
                    seed: int | None = None, stop_ids: Sequence[int] = (), first_canvas: Any = None,
                    constraint: Any = None, images: Sequence = ()) -> None:
        """Queue a request: host token ids (checked by the caller: `request.check_ids`), checked DiffusionEbParams,
        its block cap; `seed` (default: the params'); `request_id` is the `row` of its events."""
        request = Request(id=request_id, prompt=torch.tensor(list(prompt_ids)),  # sent to the device in `submit`
                          params=params, num_blocks=num_blocks, seed=params.seed if seed is None else seed,
                          stops=set(stop_ids), first_canvas=first_canvas, constraint=constraint,
                          images=list(images))
        self.submit(request, ids=list(prompt_ids))

    def submit(self, request: Request, ids: list[int] | None = None) -> None:
        """Queue a built `Request`. `ids`: the prompt's ids on the host when the caller has them (prefix caching
        keys blocks by them; without them they are read from the prompt once, here, outside any pass)."""
        if (self.prefix_caching or request.images) and ids is None:
            p = request.prompt
            ids = p.tolist() if p.device.type == "cpu" else host_reads.read(p, "prompt")
        if request.images:
            ids = self._place_images(request, ids)
        if request.prompt.device != self.device:  # a host prompt: sent without waiting for the device
            request.prompt = to_device(request.prompt, torch.long, self.device)
        need = len(request.prompt) + (request.num_blocks - 1) * self.c
        if need > self.max_len:
            raise UserError(f"request {request.id} needs {need} cache positions; this engine holds {self.max_len}")
        request.settings = dataclasses.replace(request.params, seed=0)
        request.submitted = self._now()
        self.sched.submit(request, ids)

    def _place_images(self, r: Request, ids: list[int]) -> list[int]:
        """r's image placeholders: each image's run of soft tokens (one per image, in order, as long as its soft
        tokens), bidirectional where the config says so. Returns the ids prefix caching keys blocks by: an image's
        tokens keyed by the image's content, so only the same image hits."""
        vision = getattr(self.model, "vision", None)
        if vision is None:
            raise UserError("this checkpoint has no vision tower, so it cannot take images; "
                            "use a multimodal DiffusionGemma checkpoint, or send text only")
        vc = vision.config
        runs = image_spans(ids, vc.image_token_id)
        need = [len(x) // vc.pooling_kernel_size ** 2 for x, _, _ in r.images]
        if [b - a for a, b in runs] != need:
            raise UserError(f"the prompt's image placeholders ({[b - a for a, b in runs]} tokens) do not match its "
                            f"{len(need)} images ({need} soft tokens); build prompts with the chat template")
        r.image_pos = [q for a, b in runs for q in range(a, b)]
        r.spans = runs if vc.bidirectional else ()
        keyed = list(ids)
        for (a, b), (_, _, key) in zip(runs, r.images):
            keyed[a:b] = [("image", key)] * (b - a)
        return keyed

    @property
    def idle(self) -> bool:
        return self.sched.idle and self.runner.pending is None

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
        plan = None
        if not self.sched.idle:
            plan = self.sched.plan()
            if plan.started:
                yield from self._start(plan.started)
        done = self.runner.run(plan)
        if done is not None:
            yield from self._settle(done)

    # ---- the busy clock -----------------------------------------------------------------------------------

    def _now(self) -> float:
        return self.busy + time.perf_counter() - self.mark

    def _paused(self, *events: Event) -> Iterator[Event]:
        """Yield `events` with the busy clock stopped while the consumer holds them."""
        now = time.perf_counter()
        self.busy, self.mark = self.busy + now - self.mark, now
        yield from events
        self.mark = time.perf_counter()

    def _start(self, rs: list[Request]) -> Iterator[Event]:
        self.runner.start_block(rs)
        yield from self._paused(*(BlockStart(block=r.block, num_blocks=r.num_blocks, prefix_len=r.prefix,
                                             canvas=r.canvas, row=r.id) for r in rs))

    # ---- settle -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _settle(self, p: Pass) -> Iterator[Event]:
        elapsed = self.runner.elapsed(p)
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
        stopped = self.runner.stopped(p)
        steps, ended = [], []
        for k, r in enumerate(rows):
            i = p.steps[k]
            if r.slot < 0 or r.block != p.blocks[k]:  # left, or its block ended at an earlier pass
                st["discarded_row_steps"] += 1
                continue
            reason = "stable_confident" if stopped[k] else ("step_cap" if i == r.max_steps - 1 else None)
            r.denoise_s += elapsed
            out = p.out
            steps.append(Step(block=r.block, step=i + 1, max_steps=r.max_steps, temperature=r.temperature(i),
                              canvas_in=p.canvas_in[k], argmax=out.argmax[k], sample=out.sample[k],
                              accepted_mask=p.accepted[k], accepted_count=p.accepted[k].sum(),
                              entropy=out.entropy[k], mean_entropy=out.entropy[k].mean(),
                              next_canvas=p.next_canvas[k], stop_reason=reason, elapsed_s=elapsed, row=r.id))
            if reason is not None:
                r.steps_per_block.append(i + 1)
                ended.append(k)
        yield from self._paused(*steps)
        if ended:
            yield from self._end_blocks(p, ended)

    def _end_blocks(self, p: Pass, ended: list[int]) -> Iterator[Event]:
        """Requests whose block ended at pass p: finish (stop id or block cap) or queue the commit and start the
        next block."""
        t0 = time.perf_counter()
        argmax = p.out.argmax
        tokens_all = self.runner.tokens(p, ended)  # the blocks' read-back
        read_s = time.perf_counter() - t0
        going_on = []
        for k, tokens in zip(ended, tokens_all):
            r = p.plan.canvases[k]
            r.denoise_s += read_s
            stop_index = next((j for j, t in enumerate(tokens) if t in r.stops), None)
            kept = tokens if stop_index is None else tokens[:stop_index]
            if r.constraint is not None:
                r.constraint.advance(tokens)
            r.answer += kept
            r.counted += sum(t != self.pad_id for t in tokens[: len(kept) + (stop_index is not None)])
            if r.block == 0:
                r.first_block_s = self._now() - r.submitted
            yield from self._paused(Commit(block=r.block, tokens=tokens, stop_index=stop_index, row=r.id))
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
            yield from self._paused(Done(token_ids=r.answer, finish_reason=finish, stop_id=stop_id,
                                         blocks=len(r.steps_per_block), steps_per_block=r.steps_per_block,
                                         decoder_passes=passes, tokens_per_forward=r.counted / passes,
                                         timings=timings, row=r.id))
        if going_on:
            yield from self._start(going_on)


class KeptEngine:
    """The engine a session owns (`Session.engines`): built at its first call, kept for the next call of the same
    shape (its cache, and its CUDA graphs, captured once and replayed by every later call: bench's runs, sweep's
    points), rebuilt for another shape (the old cache freed first). Each call starts as a new engine would
    (`LLMEngine.reset`), so keeping it changes no event."""

    def __init__(self) -> None:
        self.engine: LLMEngine | None = None
        self.key: tuple | None = None

    def get(self, model: Any, *, stats: dict | None = None, step_mode: str = "dynamic", **kw: Any) -> LLMEngine:
        key = (id(model), step_mode, tuple(sorted(kw.items())))
        if self.engine is not None and self.key == key and self.engine.idle:
            self.engine.reset(stats)
            return self.engine
        self.engine = self.key = None  # free the old cache before the new one is allocated
        self.engine = new_engine(model, step_mode=step_mode, stats=stats, **kw)
        self.key = key
        return self.engine
