"""The engine without a host sync inside a block: each pass's stop flags are read one pass later.

Owns: `AsyncStopEngine`, the `Engine` for CUDA (`new_engine` picks it there). A synchronous engine reads
every pass's stop flags (`stop.tolist()`) before it can build the next pass, so the device idles while the
host decides. Here pass n+1 is launched first — every running request speculatively goes on to its next
step — and only then are pass n's flags read (an async copy, usually complete by then) and its events
handed out. A request that stopped at pass n has its speculative step n+1 discarded: no event, no state
from it; its block is committed and its next block starts at the following pass. A request at its last
step is not continued speculatively (its block ends whatever the flags say). So every request runs exactly
the steps, draws and tokens of the synchronous engine (tests/sampling/test_async_stop.py compares the two
event by event); the cost is one discarded row-step per early stop, and on the device's side nothing.
Timings: on CUDA a pass's `elapsed_s` comes from CUDA events around it (the host clock would measure
queueing); on CPU, where every op runs synchronously, this engine only wastes work (forced in tests).
Must not: change what a request computes, or read the device inside a block other than the flags of a
pass already done (through `host_reads.read`, as every read of the engines).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dgcli.kernels.transfer import to_device
from dgcli.sampling import draws, host_reads
from dgcli.sampling.engine import Engine, Request
from dgcli.sampling.events import BlockStart, Event, Step
from dgcli.sampling.rules import RowRules


@dataclass
class _Launched:
    """One pass in flight: the requests it ran (with the block and step each ran) and its device results."""

    rows: list[Request]
    blocks: list[int]
    steps: list[int]  # 0-based step each row ran
    canvas_in: torch.Tensor
    out: Any
    accepted: torch.Tensor
    next_canvas: torch.Tensor
    history: torch.Tensor
    stop: torch.Tensor | None  # [b] bool on the device, None when no row can stop early
    stop_host: torch.Tensor | None  # its async copy (pinned) on CUDA
    events: tuple | None  # CUDA (start, end) events around the pass
    seconds: float  # host time of the launch (the pass itself on CPU)


def new_engine(model: Any, *, async_stop: bool | None = None, **kw: Any) -> Engine:
    """The engine for `model`'s device: `AsyncStopEngine` on CUDA, `Engine` elsewhere (or as asked)."""
    if async_stop is None:
        async_stop = model.embed_weight.device.type == "cuda"
    return (AsyncStopEngine if async_stop else Engine)(model, **kw)


class AsyncStopEngine(Engine):
    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.pending: _Launched | None = None
        self.stats["discarded_row_steps"] = 0

    @property
    def idle(self) -> bool:
        return super().idle and self.pending is None

    def step(self) -> Iterator[Event]:
        if self.cancelled:
            self._drop_cancelled()
        fresh = self._admit()
        self._clock()
        for k in fresh:
            r = self.active[k]
            yield BlockStart(block=0, num_blocks=r.num_blocks, prefix_len=self.cache.lens[r.slot],
                             canvas=self.canvas[k], row=r.id)
        self.mark = time.perf_counter()
        launched = self._launch()  # pass n+1, before pass n's flags are read
        if self.pending is not None:
            yield from self._settle(self.pending)
        self.pending = launched

    # ---- launch ------------------------------------------------------------------------------------------

    def _valid(self, p: _Launched | None, r: Request) -> int | None:
        """r's row in pass `p` if that row is r's current step (not since superseded by a block end)."""
        if p is None:
            return None
        for k, q in enumerate(p.rows):
            if q is r:
                return k if p.blocks[k] == r.block and p.steps[k] == r.step else None
        return None

    @torch.inference_mode()
    def _launch(self) -> _Launched | None:
        p, dev = self.pending, self.device
        rows, steps, canvas, history, soft = [], [], [], [], []
        depth = self.depth
        for cur, r in enumerate(self.active):
            k = self._valid(p, r)
            if k is None:  # its state is settled: the engine's own tensors
                rows.append(r), steps.append(r.step)
                canvas.append(self.canvas[cur]), history.append(self.history[:, cur])
                soft.append(None if self.soft is None else self.soft[cur])
            elif r.step + 1 < r.max_steps:  # speculatively on from the pending pass
                rows.append(r), steps.append(r.step + 1)
                canvas.append(p.next_canvas[k])
                h = p.history[:, k]
                if h.shape[0] < depth:  # a request with a deeper stability rule joined since
                    h = torch.cat((h.new_full((depth - h.shape[0], h.shape[1]), -1), h))
                history.append(h)
                soft.append(p.out.soft[k])
            # else: its block ends at the pending pass whatever the flags say; nothing to continue
        if not rows:
            return None
        b, c = len(rows), self.c
        t0 = time.perf_counter()
        events = None
        if dev.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        canvas_in = torch.stack(canvas)
        hist = torch.stack(history, dim=1)
        soft_in = None
        if any(s is not None for s in soft) and any(st > 0 for st in steps):
            zero = next(s for s in soft if s is not None).new_zeros(c, self.model.config.hidden_size)
            soft_in = torch.stack([zero if s is None or st == 0 else s for s, st in zip(soft, steps)])
        seed_k = to_device([r.seed for r in rows], torch.long, dev)[:, None]
        block_k = to_device([r.block for r in rows], torch.long, dev)[:, None]
        step_k = to_device(steps, torch.long, dev)[:, None] + 1
        uniform = draws.uniform(seed_k, draws.DRAW, block_k, step_k, self.positions, device=dev)
        noise = draws.token_ids(seed_k, draws.RENOISE, block_k, step_k, self.positions, self.vocab, device=dev)
        temp = to_device([r.temperature(s) for r, s in zip(rows, steps)], torch.float32, dev)
        first = rows[0]
        if first.params.stability_threshold == depth and all(r.settings == first.settings for r in rows):
            rules = first.params
        else:
            ps = [r.params for r in rows]
            rules = RowRules(to_device([[q.entropy_bound] for q in ps], torch.float32, dev),
                             to_device([q.confidence_threshold for q in ps], torch.float32, dev),
                             to_device([q.stability_threshold for q in ps], torch.long, dev))
        slots = [r.slot for r in rows]
        out, accepted, next_canvas, new_hist, stop = self._denoise(
            canvas_in, soft_in, temp, hist, rules, uniform, noise, any(s < r.max_steps - 1 for r, s in zip(rows, steps)),
            None if slots == list(range(self.slots)) else slots)
        stop_host = None
        if not any(r.params.confidence_threshold > 0 for r in rows):
            stop = None  # no row can stop early: nothing to read
        elif dev.type == "cuda":
            stop_host = torch.empty(b, dtype=torch.bool, pin_memory=True)
            stop_host.copy_(stop, non_blocking=True)
        if events is not None:
            events[1].record()
        return _Launched(rows, [r.block for r in rows], steps, canvas_in, out, accepted, next_canvas, new_hist,
                         stop, stop_host, events, time.perf_counter() - t0)

    # ---- settle --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _settle(self, p: _Launched) -> Iterator[Event]:
        """Pass `p`'s flags (done by now), its events, and its results taken into the engine's state."""
        if p.events is not None:
            p.events[1].synchronize()  # the pass and its flag copy are done: the host reads, nothing waits
            elapsed = p.events[0].elapsed_time(p.events[1]) / 1e3
        else:
            elapsed = p.seconds
        flags = p.stop_host if p.stop_host is not None else p.stop
        stopped = host_reads.read(flags, "stop") if flags is not None else [False] * len(p.rows)
        self.stats["decoder_passes"] += 1
        self.stats["row_steps"] += len(p.rows)
        self.stats["denoise_s"] += elapsed
        self._clock()
        where = {id(r): cur for cur, r in enumerate(self.active)}
        cur_idx, p_idx, ended = [], [], []
        for k, r in enumerate(p.rows):
            cur = where.get(id(r))
            if cur is None or self._valid(p, r) != k:  # left, or superseded: a discarded speculative step
                self.stats["discarded_row_steps"] += 1
                continue
            i, n_steps = p.steps[k], r.max_steps
            reason = "stable_confident" if stopped[k] else ("step_cap" if i == n_steps - 1 else None)
            r.denoise_s += elapsed
            yield Step(block=r.block, step=i + 1, max_steps=n_steps, temperature=r.temperature(i),
                       canvas_in=p.canvas_in[k], argmax=p.out.argmax[k], sample=p.out.sample[k],
                       accepted_mask=p.accepted[k], accepted_count=p.accepted[k].sum(), entropy=p.out.entropy[k],
                       mean_entropy=p.out.entropy[k].mean(), next_canvas=p.next_canvas[k],
                       stop_reason=reason, elapsed_s=elapsed, row=r.id)
            if reason is not None:
                r.steps_per_block.append(i + 1)
                ended.append(cur)
            r.step += 1
            cur_idx.append(cur)
            p_idx.append(k)
        self.mark = time.perf_counter()
        if not cur_idx:
            return
        # The settled rows' state: new tensors (events handed out hold views of the old ones).
        ci, pi = to_device(cur_idx, torch.long, self.device), to_device(p_idx, torch.long, self.device)
        self.canvas = self.canvas.clone()
        self.canvas[ci] = p.next_canvas[pi]
        hist = p.history[:, pi]
        if hist.shape[0] < self.depth:
            hist = torch.cat((hist.new_full((self.depth - hist.shape[0], *hist.shape[1:]), -1), hist))
        self.history = self.history.clone()
        self.history[:, ci] = hist
        if p.out.soft is not None:
            self.soft = (p.out.soft.new_zeros(len(self.active), *p.out.soft.shape[1:]) if self.soft is None
                         else self.soft.clone())
            self.soft[ci] = p.out.soft[pi]
        argmax = p.out.argmax.new_zeros(len(self.active), self.c)
        argmax[ci] = p.out.argmax[pi]
        yield from self._end_blocks(ended, argmax)
