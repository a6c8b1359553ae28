"""The model runner: runs one plan of the scheduler as ONE forward pass and the sampler step of its canvases.

Owns: `ModelRunner` and `Pass` (a launched pass: its plan, its device results, its clock). `run(plan)` launches
the pass (prompt chunks, commits and every running canvas together; `graphs`: denoise-only passes replay CUDA
graphs), runs the canvas rows' sampler step on the device (`sampling.rules.sample_step`) and hands back the pass
to settle now. `lag` (1 on CUDA, 0 elsewhere): with lag 1 pass n+1 is launched before pass n is handed back, so
the host never waits for the device inside a block: every running request speculatively goes on to its next step
(the engine discards the rows of a request that stopped). Settling reads only the pass's clock, its stop flags
(`stopped`) and the tokens of the blocks that ended (`tokens`), each through `host_reads.read`.
Must not: plan (scheduler.py), emit events or decide what a request's tokens mean (llm_engine.py), or read
device values other than through `host_reads.read`.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dgcli.engine.request import Request
from dgcli.engine.scheduler import Plan
from dgcli.kernels.transfer import to_device
from dgcli.sampling import draws, host_reads
from dgcli.sampling.rules import RowRules, sample_step


IMAGES_KEPT = 8  # images whose soft tokens the runner keeps for later requests (a few MB each at 26B-A4B)


@dataclass
class Pass:
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


class ModelRunner:
    """Runs plans over `cache` for `slots` sequences; `graphs`: sequence `slots` (never scheduled) holds the canvas
    that pads a CUDA graph's bucket. `stats` gains graph_passes."""

    def __init__(self, model: Any, cache: Any, *, slots: int, graphs: bool, compile_tiles: bool, lag: int,
                 stats: dict):
        self.model, self.cache, self.compile_tiles, self.lag, self.stats = model, cache, compile_tiles, lag, stats
        self.c, self.vocab = model.config.canvas_length, model.config.vocab_size
        self.device = model.embed_weight.device
        # the draws' position words 0..C-1, mixed once (draws.uniform_at / token_ids_at fold them per row)
        self.mixed_positions = draws.mixed_positions(torch.arange(self.c, device=self.device))
        self.graphs = None
        if graphs:
            self.cache.reserve(slots, self.c)
            self.graphs = model.pass_graphs(self.cache, slots, slots, capture=self.device.type == "cuda")
        self.pending: Pass | None = None  # lag 1: the pass launched last, not handed back yet
        self.images: dict = {}  # image content key -> its soft tokens (insertion order: the oldest goes first)

    def run(self, plan: Plan | None) -> Pass | None:
        """Launch `plan` (if it has segments) and return the pass to settle now (lag 1: the one before it)."""
        launched = self._launch(plan) if plan is not None and plan.segments else None
        if not self.lag:
            return launched
        done, self.pending = self.pending, launched
        return done

    @torch.inference_mode()
    def start_block(self, rs: list[Request]) -> None:
        """Requests `rs` begin their current block: its first canvas, an empty history, no self-conditioning."""
        dev = self.device
        states = draws.rows([(r.seed, draws.INIT, r.block, 0) for r in rs], dev)  # [k, 1]
        canvas = draws.token_ids_at(states, self.mixed_positions, self.vocab)  # [k, C]
        for k, r in enumerate(rs):
            r.canvas = r.first_canvas if r.block == 0 and r.first_canvas is not None else canvas[k]
            r.history = torch.full((r.params.stability_threshold, self.c), -1, dtype=torch.long, device=dev)
            r.soft, r.step, r.waiting = None, 0, False

    # ---- launch -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _launch(self, plan: Plan) -> Pass:
        dev, rows = self.device, plan.canvases
        t0, timing = time.perf_counter(), None
        if dev.type == "cuda":
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        p = Pass(plan, [r.block for r in rows], [r.step for r in rows])
        soft = None
        if rows:
            p.canvas_in = torch.stack([r.canvas for r in rows])  # [b, C]
            if any(r.soft is not None for r in rows):  # the zero soft embedding is exactly "none"
                zero = next(r.soft for r in rows if r.soft is not None).new_zeros(self.c, self.model.config.hidden_size)
                soft = torch.stack([zero if r.soft is None else r.soft for r in rows])
        ids = torch.cat([*plan.causal_ids, *([p.canvas_in.flatten()] if rows else [])])
        images = self._images(plan)
        hidden = None if self.graphs is None or images else self.graphs.forward(ids, plan.segments, soft)
        if hidden is None:
            extra = {"images": images} if images else {}  # (a pass without images: the text model's own call)
            hidden = self.model.forward_pass(ids, plan.segments, self.cache, soft, **extra)
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

    def _images(self, plan: Plan) -> tuple | None:
        """The pass rows of the prompt chunks' image tokens and their features (rows [M], [M, H]), or None; a
        request's images run through the vision tower at the first pass that holds one of their tokens."""
        rows, feats, row0 = [], [], sum(s.length for s in plan.segments[:len(plan.commits)])
        for seg, r in zip(plan.segments[len(plan.commits):], plan.prefills):
            lo, hi = bisect.bisect_left(r.image_pos, seg.start), bisect.bisect_left(r.image_pos, seg.start + seg.length)
            if hi > lo:
                if r.features is None:
                    r.features = torch.cat([self._image(*image) for image in r.images])
                rows += [row0 + q - seg.start for q in r.image_pos[lo:hi]]
                feats.append(r.features[lo:hi])
            row0 += seg.length
        return (to_device(rows, torch.long, self.device), torch.cat(feats)) if rows else None

    def _image(self, patches: Any, positions: Any, key: Any) -> torch.Tensor:
        """One image's soft tokens [n, H], kept by content key for the next requests that send it."""
        got = self.images.pop(key, None)
        if got is None:
            t0 = time.perf_counter()
            got = self.model.vision.features(to_device(patches, torch.float32, self.device),
                                             to_device(positions, torch.long, self.device))
            self.stats["vision_s"] = self.stats.get("vision_s", 0.0) + time.perf_counter() - t0
            self.stats["images_encoded"] = self.stats.get("images_encoded", 0) + 1
        self.images[key] = got
        while len(self.images) > IMAGES_KEPT:
            self.images.pop(next(iter(self.images)))
        return got

    def _sample(self, p: Pass, hidden: torch.Tensor) -> None:
        """The canvas rows' sampler step on the device; each request goes on speculatively to its next step."""
        dev, rows = self.device, p.plan.canvases
        depth = max(r.params.stability_threshold for r in rows)
        # [S, b, C]: a row's older entries it does not have are -1 (never equal)
        hist = torch.stack([F.pad(r.history, (0, 0, depth - len(r.history), 0), value=-1) for r in rows], dim=1)
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
                                                                 want_soft, self.compile_tiles,
                                                                 self._constrained(p, hidden, temp, uniform))
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

    def _constrained(self, p: Pass, hidden: torch.Tensor, temp: torch.Tensor, uniform: torch.Tensor) -> Any:
        """The joint draw of the rows under a schema (None when no row has one): each reads its own logits only."""
        rows = [(k, r.constraint, p.blocks[k]) for k, r in enumerate(p.plan.canvases) if r.constraint is not None]
        if not rows:
            return None
        from dgcli.sampling.joint import constrain, processed_logits

        ends = draws.uniform_at(draws.rows([(r.seed, draws.END, b, i + 1) for r, b, i in zip(p.plan.canvases, p.blocks,
                                                                                         p.steps)], self.device),
                                self.mixed_positions[:1])[:, 0]  # [b]: the state each canvas ends in
        return lambda out: constrain(out, lambda k, ids: processed_logits(self.model, hidden[k], temp[k], ids),
                                     self.vocab, rows, uniform, ends)

    # ---- settle: what the host reads ----------------------------------------------------------------------------

    @staticmethod
    def elapsed(p: Pass) -> float:
        """The pass's own seconds (on CUDA its events')."""
        if isinstance(p.timing, tuple):
            p.timing[1].synchronize()  # the pass is done by then: reading its flags and clock waits for nothing
            return p.timing[0].elapsed_time(p.timing[1]) / 1e3
        return p.timing

    @staticmethod
    def stopped(p: Pass) -> list[bool]:
        """Per canvas row, whether its stop rule held at this pass (all False when no row can stop early)."""
        return host_reads.read(p.stop, "stop") if p.stop is not None else [False] * len(p.plan.canvases)

    @staticmethod
    def tokens(p: Pass, rows: list[int]) -> list[list[int]]:
        """The argmax tokens of canvas rows `rows` of pass p: the blocks' read-back."""
        return host_reads.read(p.out.argmax[rows], "commit")
