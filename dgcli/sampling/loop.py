"""The entropy-bound block-diffusion sampler (spec §7): the one denoising loop, and it yields events.

Owns: the block loop (prefill, per-block canvas, denoising steps, commit, stop ids; the rules and one
step are `rules.py`), the RNG discipline (every draw
comes from the counter-based stream of `draws.py`, addressed by seed, block, step and position: same
seed, settings, device and dtype give identical events whichever kernel path runs, up to rounding at
a CDF boundary), and the run's summary (`Done`). `generate`, `watch`, `bench`, `sweep` and the trace writer all consume
`generate_events`; there is no second copy of this loop anywhere.
Must not: tokenize, print, write files, import transformers, or sync with the device inside a step
other than once for the stop decision (and not at all when no step can stop early).

Decisions (kept from the reference unless noted):
* A block's output is the argmax of its last step, never the sampled canvas.
* `Done.token_ids` stops *before* the first stop id (it is the answer text's ids); the stop id itself
  is `Done.stop_id`. HF keeps the stop id and pads after it; nothing after it is kept here.
* `tokens_per_forward` is HF's: generated ids up to and including the stop id, not counting ids equal
  to `pad_id`, divided by decoder passes (encoder passes are not counted).
* Timings (seconds, the loop's own time; time spent by the consumer between events is excluded):
  prefill_s (prompt encode), denoise_s (all blocks' steps up to the block-end read-back),
  commit_s (encodes of committed blocks), first_block_s (start to the first block's tokens),
  total_s.
* Batch: `generate_batch_events` runs many prompts through this one loop (per-row lengths, seeds,
  block caps, freezing and finishing, as HF's batched generate); `generate_events` is a batch of one.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dgcli.errors import UserError
from dgcli.sampling import draws
from dgcli.sampling.events import BlockStart, Commit, Done, Event, Step
from dgcli.sampling.params import DiffusionEbParams
from dgcli.sampling.rules import RowRules, denoise_step, temperature


@torch.inference_mode()
def _encode(model: Any, ids: torch.Tensor, cache: Any, lengths: list[int] | None = None,
            rows: list[int] | None = None) -> None:
    if lengths is None and rows is None:
        model.encode(ids, cache)  # the common case, and the mock models' signature
    else:
        model.encode(ids, cache, lengths, rows)
    if ids.device.type == "cuda":  # per block, so that prefill_s / commit_s are real durations
        torch.cuda.synchronize(ids.device)


# ---- input checks ------------------------------------------------------------------------------------


def _ids_tensor(ids: Sequence[int] | torch.Tensor, what: str, vocab: int, device: torch.device) -> torch.Tensor:
    """A [1, T] int64 tensor on `device` from a list of ids, a [T] or a [1, T] tensor."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.dtype.is_floating_point:
        raise UserError(f"{what} must be a list of token ids or an integer tensor [1, T]; got shape {tuple(t.shape)}")
    if t.shape[0] != 1:
        raise UserError(f"{what} has {t.shape[0]} rows; pass one prompt here, or a list of prompts to "
                        "generate_batch_events")
    if t.shape[1] == 0:
        raise UserError(f"{what} is empty; give at least one token")
    if int(t.min()) < 0 or int(t.max()) >= vocab:  # once per generation, before any step
        raise UserError(f"{what} holds ids outside the vocabulary [0, {vocab}); was it tokenized for this model?")
    return t.to(device=device, dtype=torch.long)


# ---- the loop ------------------------------------------------------------------------------------------


@dataclass
class _Row:
    """One request's state in the batch loop (host values only)."""

    request: int  # the caller's index, carried by every event
    params: Any  # its DiffusionEbParams
    temps: list[float]  # T_n of each step of its schedule
    seed: int
    num_blocks: int
    first_canvas: torch.Tensor | None  # [C] or None: the first block's canvas
    slot: int = -1  # its rows in the KV cache while it runs
    stops: set[int] = field(default_factory=set)  # its stop ids
    block: int = 0  # the block being denoised
    step: int = 0  # the step of that block the next decoder pass runs (0-based)
    answer: list[int] = field(default_factory=list)
    counted: int = 0  # ids for tokens_per_forward (HF definition)
    steps_per_block: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    denoise_s: float = 0.0
    commit_s: float = 0.0
    first_block_s: float = 0.0


def generate_batch_events(
    model: Any,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    params: Any,
    num_blocks: int | Sequence[int],
    seeds: Sequence[int] | None = None,
    stop_ids: Iterable[int] | Sequence[Iterable[int]] = (),
    pad_id: int = 0,
    init_canvases: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    compile_tiles: bool = False,
    max_batch: int | None = None,
    stats: dict | None = None,
) -> Iterator[Event]:
    """Run the entropy-bound sampler on several prompts at once, yielding each row's BlockStart, Step...,
    Commit per block and its Done, every event carrying `row` (the prompt's index). Rows may differ in
    prompt length, seed (default: their params' seed), block cap, first canvas, stop ids (`stop_ids` as
    one list of ids per prompt), and in every sampler setting when `params` is a list (one
    DiffusionEbParams per prompt: steps, temperatures, entropy bound, thresholds; each row keeps its own
    schedule and stop rule). Each row is at its own step of its own block: a decoder pass runs every row
    once (a [b] temperature), and a row whose block ends (stop rule or step cap) commits it and starts its next
    block at the next pass, or finishes (stop id or block cap: Done) and frees its slot. A row never
    waits for, or runs extra steps for, its batch-mates. Every random draw is addressed by the row's
    own seed, block, step and position (`draws.py`), and each row's positions start at 0, so a row's
    result does not depend on its batch-mates or their order (up to floating-point reduction order,
    which can differ with the batch's shape).

    Continuous batching: at most `max_batch` rows (default: all) run at once; the others wait in input
    order and take a free slot at the next pass (their prompts are encoded then and join the cache).
    Timings count from the call, so a queued request's first_block_s and total_s include its wait.
    `stats` (a dict, if given) receives the run's decoder_passes, encoder_passes, row_steps (rows
    computed over all passes; slot occupancy = row_steps / (decoder_passes · max_batch)), denoise_s (the
    decoder passes' own time, each pass once) and encode_s (prefills and commits)."""
    n_rows = len(prompts)
    if n_rows < 1:
        raise UserError("no prompts: give at least one")
    many = isinstance(params, (list, tuple))
    row_params = [DiffusionEbParams.check(p) for p in (params if many else [params])]  # the one validator
    if many and len(row_params) != n_rows:
        raise UserError(f"{n_rows} prompts need one params each, got {len(row_params)}")
    row_params = row_params if many else row_params * n_rows
    blocks = [num_blocks] * n_rows if isinstance(num_blocks, int) else list(num_blocks)
    seeds = [p.seed for p in row_params] if seeds is None else [int(x) for x in seeds]
    inits = [None] * n_rows if init_canvases is None else list(init_canvases)
    if not len(blocks) == len(seeds) == len(inits) == n_rows:
        raise UserError(f"{n_rows} prompts need as many block caps, seeds and initial canvases")
    for nb in blocks:
        if not isinstance(nb, int) or nb < 1:
            raise UserError(f"num_blocks={nb!r}: generate at least one block")
    for p, seed in zip(row_params, seeds):
        DiffusionEbParams.check(dataclasses.replace(p, seed=seed))  # one rule for every seed
    stop_list = list(stop_ids)
    if stop_list and all(isinstance(x, (list, tuple, set, frozenset)) for x in stop_list):  # one set per row
        if len(stop_list) != n_rows:
            raise UserError(f"{n_rows} prompts need one set of stop ids each, got {len(stop_list)}")
        row_stops = [{int(t) for t in x} for x in stop_list]
    else:
        row_stops = [{int(t) for t in stop_list}] * n_rows
    vocab, c = model.config.vocab_size, model.config.canvas_length
    device = model.embed_weight.device
    ids = [_ids_tensor(p, "prompt", vocab, device)[0] for p in prompts]  # [P_r] each
    rows = []
    for r in range(n_rows):
        first = None
        if inits[r] is not None:
            first = _ids_tensor(inits[r], "initial canvas", vocab, device)[0]  # [C]
            if first.shape[0] != c:
                raise UserError(f"initial canvas has {first.shape[0]} ids; the model's canvas holds {c}")
        p = row_params[r]
        n = p.max_denoising_steps
        temps = [temperature(i, n, p.t_min, p.t_max) for i in range(n, 0, -1)]
        rows.append(_Row(request=r, params=p, temps=temps, seed=seeds[r], num_blocks=blocks[r], first_canvas=first,
                         stops=row_stops[r]))
    # One setting for all rows (but the seed): scalars, as a batch of one runs; else per-row tensors.
    shared = all(dataclasses.replace(p, seed=0) == dataclasses.replace(row_params[0], seed=0) for p in row_params)
    depth = max(p.stability_threshold for p in row_params)  # the history's length
    positions = torch.arange(c, device=device)  # [C]

    busy, mark = 0.0, time.perf_counter()  # busy: own time; the clock pauses while a consumer holds an event
    slots = n_rows if max_batch is None else max_batch
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise UserError(f"max_batch={max_batch!r}: must be a whole number >= 1")
    stats = {} if stats is None else stats
    stats.update(decoder_passes=0, encoder_passes=0, row_steps=0, denoise_s=0.0, encode_s=0.0)
    queue = deque(rows)
    active: list[_Row] = []  # row k's state is row k of every tensor below; its K/V are cache slot row.slot
    canvas = history = soft = None  # soft None: every row is at the first step of a block
    # One KV cache for the whole run, a fixed slot per running request: a request joins by encoding its
    # prompt into a free slot and leaves by freeing it; nothing is copied. A row's last block is never
    # encoded, so a slot holds at most its prompt and blocks - 1 canvases.
    slots = min(slots, n_rows)
    cache = model.new_cache(slots, max(len(ids[r.request]) + (r.num_blocks - 1) * c for r in rows))
    free = list(range(slots))

    def cache_rows() -> list[int] | None:
        """The active rows' cache slots, or None when they are exactly the cache's rows in order."""
        got = [row.slot for row in active]
        return None if got == list(range(slots)) else got

    @torch.inference_mode()  # canvas, history and soft come out of inference-mode steps
    def start_block(ks: list[int]) -> None:
        """Rows `ks` begin their current block: its first canvas, an empty history, no self-conditioning.
        New tensors, never writes into old ones: events handed out hold views of them."""
        nonlocal canvas, history, soft
        canvas, history = canvas.clone(), history.clone()
        soft = None if soft is None else soft.clone()
        seed_k = torch.tensor([active[k].seed for k in ks], device=device)[:, None]  # [k, 1]
        block_k = torch.tensor([active[k].block for k in ks], device=device)[:, None]  # [k, 1]
        idx = torch.tensor(ks, device=device)
        canvas[idx] = draws.token_ids(seed_k, draws.INIT, block_k, 0, positions, vocab, device=device)  # [k, C]
        for k in ks:
            row = active[k]
            if row.block == 0 and row.first_canvas is not None:
                canvas[k] = row.first_canvas
            row.step = 0
        history[:, idx] = -1
        if soft is not None:
            soft[idx] = 0  # the zero soft embedding is exactly "no self-conditioning"

    while active or queue:
        fresh: list[int] = []
        # Free slots take queued requests; their prompts are encoded together and join the cache.
        if queue and len(active) < slots:
            joining = [queue.popleft() for _ in range(min(slots - len(active), len(queue)))]
            t0 = time.perf_counter()
            lengths = [len(ids[row.request]) for row in joining]
            padded = torch.full((len(joining), max(lengths)), pad_id, dtype=torch.long, device=device)  # [j, P]
            for k, row in enumerate(joining):
                padded[k, :lengths[k]] = ids[row.request]
            for row in joining:
                row.slot = free.pop(0)
                cache.lens[row.slot] = 0
            into = [row.slot for row in joining]
            _encode(model, padded, cache, None if len(set(lengths)) == 1 else lengths,
                    None if into == list(range(slots)) else into)
            stats["encoder_passes"] += 1
            for row in joining:
                row.prefill_s = time.perf_counter() - t0
            stats["encode_s"] += joining[0].prefill_s
            fresh = list(range(len(active), len(active) + len(joining)))
            active += joining
            j = len(joining)
            canvas = torch.empty(j, c, dtype=torch.long, device=device) if canvas is None else \
                torch.cat((canvas, canvas.new_empty(j, c)))
            hist = torch.empty(depth, j, c, dtype=torch.long, device=device)
            history = hist if history is None else torch.cat((history, hist), dim=1)
            if soft is not None:
                soft = torch.cat((soft, soft.new_zeros(j, c, soft.shape[2])))
            start_block(fresh)
        busy += time.perf_counter() - mark
        for k in fresh:
            row = active[k]
            yield BlockStart(block=0, num_blocks=row.num_blocks, prefix_len=cache.lens[row.slot], canvas=canvas[k],
                             row=row.request)
        mark = time.perf_counter()

        # One decoder pass: every row at its own step of its own block.
        t0 = time.perf_counter()
        b = len(active)
        step_k = torch.tensor([row.step for row in active], device=device)  # [b]
        seed_k = torch.tensor([row.seed for row in active], device=device)[:, None]  # [b, 1]
        block_k = torch.tensor([row.block for row in active], device=device)[:, None]  # [b, 1]
        uniform = draws.uniform(seed_k, draws.DRAW, block_k, step_k[:, None] + 1, positions, device=device)  # [b, C]
        noise = draws.token_ids(seed_k, draws.RENOISE, block_k, step_k[:, None] + 1, positions, vocab, device=device)
        temp = torch.tensor([row.temps[row.step] for row in active], dtype=torch.float32, device=device)  # [b]
        rules = row_params[0] if shared else RowRules.of([row.params for row in active], device)
        out, accepted, next_canvas, history, stop = denoise_step(
            model, canvas, cache, soft, temp, history, rules, uniform, noise,
            want_soft=any(row.step < len(row.temps) - 1 for row in active), compile_tiles=compile_tiles,
            rows=cache_rows())
        # Mean entropy is >= 0, so "< 0" never holds: with confidence 0 (fixed work) no row can stop early
        # and the loop never waits for the device inside a block.
        can_stop_early = any(row.params.confidence_threshold > 0 for row in active)
        stopped = stop.tolist() if can_stop_early else [False] * b  # the step's one host sync
        elapsed = time.perf_counter() - t0
        stats["decoder_passes"] += 1
        stats["row_steps"] += b
        stats["denoise_s"] += elapsed
        busy += time.perf_counter() - mark
        ended = []
        for k, row in enumerate(active):
            i, n_steps = row.step, len(row.temps)
            reason = "stable_confident" if stopped[k] else ("step_cap" if i == n_steps - 1 else None)
            row.denoise_s += elapsed
            yield Step(block=row.block, step=i + 1, max_steps=n_steps, temperature=row.temps[i], canvas_in=canvas[k],
                       argmax=out.argmax[k], sample=out.sample[k], accepted_mask=accepted[k],
                       accepted_count=accepted[k].sum(), entropy=out.entropy[k],
                       mean_entropy=out.entropy[k].mean(), next_canvas=next_canvas[k],
                       stop_reason=reason, elapsed_s=elapsed, row=row.request)
            if reason is not None:
                row.steps_per_block.append(i + 1)
                ended.append(k)
            row.step += 1
        mark = time.perf_counter()
        canvas, soft = next_canvas, out.soft

        # Rows whose block ended: commit, then finish (stop id or block cap) or go on to their next block.
        t0 = time.perf_counter()
        tokens_all = out.argmax[ended].tolist() if ended else []  # the block's read-back
        read_s = time.perf_counter() - t0
        going_on = []
        leaving = set()
        for k, tokens in zip(ended, tokens_all):
            row = active[k]
            row.denoise_s += read_s
            stop_index = next((j for j, t in enumerate(tokens) if t in row.stops), None)
            kept = tokens if stop_index is None else tokens[:stop_index]
            row.answer += kept
            row.counted += sum(t != pad_id for t in tokens[: len(kept) + (stop_index is not None)])
            if row.block == 0:
                row.first_block_s = busy + time.perf_counter() - mark
            busy += time.perf_counter() - mark
            yield Commit(block=row.block, tokens=tokens, stop_index=stop_index, row=row.request)
            mark = time.perf_counter()
            row.block += 1
            if stop_index is None and row.block < row.num_blocks:
                going_on.append(k)
                continue
            leaving.add(k)
            finish, stop_id = ("stop", tokens[stop_index]) if stop_index is not None else ("length", None)
            passes = sum(row.steps_per_block)
            timings = {"prefill_s": row.prefill_s, "denoise_s": row.denoise_s, "commit_s": row.commit_s,
                       "first_block_s": row.first_block_s, "total_s": busy + time.perf_counter() - mark}
            busy += time.perf_counter() - mark
            yield Done(token_ids=row.answer, finish_reason=finish, stop_id=stop_id, blocks=len(row.steps_per_block),
                       steps_per_block=row.steps_per_block, decoder_passes=passes,
                       tokens_per_forward=row.counted / passes, timings=timings, row=row.request)
            mark = time.perf_counter()
        if going_on:
            t0 = time.perf_counter()
            # commit: the block becomes prefix (of these rows only; the others keep denoising)
            into = [active[k].slot for k in going_on]
            _encode(model, out.argmax[going_on], cache, rows=None if into == list(range(slots)) else into)
            stats["encoder_passes"] += 1
            commit_s = time.perf_counter() - t0
            stats["encode_s"] += commit_s
            for k in going_on:
                active[k].commit_s += commit_s
            start_block(going_on)
            busy += time.perf_counter() - mark
            for k in going_on:
                row = active[k]
                yield BlockStart(block=row.block, num_blocks=row.num_blocks, prefix_len=cache.lens[row.slot],
                                 canvas=canvas[k], row=row.request)
            mark = time.perf_counter()
        if leaving:  # finished requests free their slots
            for k in sorted(leaving):
                free.append(active[k].slot)
                cache.lens[active[k].slot] = 0
            free.sort()
            keep = [k for k in range(b) if k not in leaving]
            active = [active[k] for k in keep]
            if not active:
                canvas = history = soft = None
                continue
            idx = torch.tensor(keep, device=device)
            canvas, history = canvas[idx], history[:, idx]
            soft = None if soft is None else soft[idx]
        if soft is not None and all(row.step == 0 for row in active):
            soft = None  # every row starts a block: the cheaper no-self-conditioning pass


def generate_events(
    model: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    params: Any,
    num_blocks: int,
    stop_ids: Iterable[int] = (),
    pad_id: int = 0,
    init_canvas: Sequence[int] | torch.Tensor | None = None,
    compile_tiles: bool = False,
) -> Iterator[Event]:
    """Run the entropy-bound sampler on one prompt (a batch of one in `generate_batch_events`), yielding
    BlockStart, Step..., Commit per block, then Done. `params` needs max_denoising_steps, t_min, t_max,
    entropy_bound, stability_threshold, confidence_threshold, seed (e.g.
    `dgcli.sampling.params.DiffusionEbParams`); `params.seed` keys every random draw (see `draws.py`);
    `init_canvas` [C] replaces the first block's random canvas; `compile_tiles` runs the vocabulary
    pass's tile math through torch.compile (the session's `--compile`)."""
    params = DiffusionEbParams.check(params)
    vocab = model.config.vocab_size
    prompt = _ids_tensor(prompt_ids, "prompt", vocab, model.embed_weight.device)  # [1, P]: one row only
    yield from generate_batch_events(model, [prompt[0]], params=params, num_blocks=num_blocks, stop_ids=stop_ids,
                                     pad_id=pad_id, init_canvases=[init_canvas], compile_tiles=compile_tiles)


def generate(model: Any, prompt_ids: Sequence[int] | torch.Tensor, **kw: Any) -> Done:
    """Drain `generate_events` (same arguments) and return its `Done`, for callers that want only the answer."""
    *_, done = generate_events(model, prompt_ids, **kw)  # the loop always ends with Done
    return done
