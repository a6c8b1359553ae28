"""The entropy-bound block-diffusion sampler (spec §7): the one denoising loop, and it yields events.

Owns: the block loop (prefill, per-block canvas, denoising steps, commit, stop ids), the accept /
stability / confidence / temperature rules as small pure functions, the RNG discipline (every draw
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
from dgcli.kernels.dispatch import vocab_pass
from dgcli.kernels.reference import VocabPassOut
from dgcli.sampling.params import DiffusionEbParams


# ---- the rules, as pure functions (tested directly) ----------------------------------------------


def temperature(n: int, num_steps: int, t_min: float, t_max: float) -> float:
    """T_n = t_min + (t_max - t_min)·n/N for n = N..1 (first step t_max, last t_min + (t_max-t_min)/N;
    never t_min), rounded to float32 the way the reference computes it from an int32 step tensor."""
    ratio = torch.tensor(n, dtype=torch.int32) / num_steps  # float32, as in the reference
    return float(t_min + (t_max - t_min) * ratio)


def accept_mask(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Entropy-bound acceptance [B, C] -> bool [B, C]: sort entropies ascending; the position of rank j
    is accepted iff the sum of the strictly lower-ranked entropies (cumsum - self) is <= bound.
    Rank 0 is always accepted. Ties are broken by position (stable sort), lower index first."""
    sorted_h, order = torch.sort(entropy, dim=-1, stable=True)  # [B, C]
    below = torch.cumsum(sorted_h, dim=-1) - sorted_h  # [B, C] the reference's formula, not an exclusive scan
    keep = below <= bound  # [B, C] in sorted order
    return torch.zeros_like(keep).scatter(-1, order, keep)


def is_stable(history: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """argmax [B, C] equals each of the previous argmaxes in history [S, B, C] -> bool [B].
    History starts filled with -1 (never equal); S = 0 means always stable (`all` of nothing)."""
    return (history == argmax[None]).all(dim=-1).all(dim=0)  # [B]


def push_history(history: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Drop the oldest argmax canvas and append the newest: [S, B, C] -> [S, B, C]."""
    if history.shape[0] == 0:
        return history
    return torch.cat((history[1:], argmax[None]), dim=0)


def is_confident(entropy: torch.Tensor, threshold: float) -> torch.Tensor:
    """Mean entropy over the canvas strictly below threshold: [B, C] -> bool [B] (threshold 0: never)."""
    return entropy.mean(dim=-1) < threshold


# ---- one step and one block boundary ---------------------------------------------------------------


@torch.inference_mode()
def _denoise_step(model: Any, canvas: torch.Tensor, cache: Any, soft: torch.Tensor | None,
                  temp: torch.Tensor, history: torch.Tensor, params: Any, uniform: torch.Tensor, noise: torch.Tensor,
                  want_soft: bool, compile_tiles: bool) -> tuple[VocabPassOut, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode, vocab pass (categorical draws at `uniform` [B, C]), accept, renoise (with `noise` [B, C]
    token ids: every position has one, used only where not accepted), stop flags; all on the device."""
    hidden = model.decode(canvas, cache, soft)  # [B, C, H]
    out = vocab_pass(hidden, model.embed_weight, softcap=model.config.final_logit_softcapping,
                     temperature=temp, embed_scale=model.embed_scale, uniform=uniform,
                     want_soft=want_soft, compile_tiles=compile_tiles)
    accepted = accept_mask(out.entropy, params.entropy_bound)  # [B, C]
    next_canvas = torch.where(accepted, out.sample, noise)  # [B, C]
    stop = is_stable(history, out.argmax) & is_confident(out.entropy, params.confidence_threshold)  # [B]
    return out, accepted, next_canvas, push_history(history, out.argmax), stop


@torch.inference_mode()
def _encode(model: Any, ids: torch.Tensor, cache: Any, lengths: list[int] | None = None) -> None:
    if lengths is None:
        model.encode(ids, cache)  # the common case, and the mock models' signature
    else:
        model.encode(ids, cache, lengths)
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
    seed: int
    num_blocks: int
    first_canvas: torch.Tensor | None  # [C] or None: the first block's canvas
    block: int = 0  # the block being denoised
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
    stop_ids: Iterable[int] = (),
    pad_id: int = 0,
    init_canvases: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    compile_tiles: bool = False,
    max_batch: int | None = None,
    stats: dict | None = None,
) -> Iterator[Event]:
    """Run the entropy-bound sampler on several prompts at once, yielding each row's BlockStart, Step...,
    Commit per block and its Done, every event carrying `row` (the prompt's index). Rows may differ in
    prompt length, seed (default `params.seed`), block cap and first canvas; the sampler settings are
    shared. A row that met the stop rule is frozen for the rest of the block (its output is the argmax of
    its stopping step, it emits no more steps; the batch still computes it, as the reference does); a row
    that hit a stop id or its block cap finishes (Done) and leaves the batch at the block boundary.
    Every random draw is addressed by the row's own seed, block, step and position (`draws.py`), and each
    row's positions start at 0, so a row's result does not depend on its batch-mates or their order
    (up to floating-point reduction order, which can differ with the batch's shape).

    Continuous batching: at most `max_batch` rows (default: all) run at once; the others wait in input
    order and take a slot at the next block boundary after a row finishes (their prompts are encoded
    then and join the cache). Timings count from the call, so a queued request's first_block_s and
    total_s include its wait. `stats` (a dict, if given) receives the run's decoder_passes,
    encoder_passes, row_steps (rows computed over all passes) and busy_row_steps (rows that were
    still denoising: the rest were frozen or idle)."""
    params = DiffusionEbParams.check(params)  # the one validator (presets, flags and requests use it too)
    n_rows = len(prompts)
    if n_rows < 1:
        raise UserError("no prompts: give at least one")
    blocks = [num_blocks] * n_rows if isinstance(num_blocks, int) else list(num_blocks)
    seeds = [params.seed] * n_rows if seeds is None else [int(x) for x in seeds]
    inits = [None] * n_rows if init_canvases is None else list(init_canvases)
    if not len(blocks) == len(seeds) == len(inits) == n_rows:
        raise UserError(f"{n_rows} prompts need as many block caps, seeds and initial canvases")
    for nb in blocks:
        if not isinstance(nb, int) or nb < 1:
            raise UserError(f"num_blocks={nb!r}: generate at least one block")
    for seed in seeds:
        DiffusionEbParams.check(dataclasses.replace(params, seed=seed))  # one rule for every seed
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
        rows.append(_Row(request=r, seed=seeds[r], num_blocks=blocks[r], first_canvas=first))
    stops = {int(s) for s in stop_ids}
    n_steps = params.max_denoising_steps
    temps = [temperature(n, n_steps, params.t_min, params.t_max) for n in range(n_steps, 0, -1)]
    temps_dev = torch.tensor(temps, dtype=torch.float32, device=device)  # [N]: one copy, then device views
    # Mean entropy is >= 0, so "< 0" never holds: no step can stop early and the loop never has to
    # wait for the device inside a block (fixed-work mode).
    can_stop_early = params.confidence_threshold > 0
    positions = torch.arange(c, device=device)  # [C]
    step_ids = torch.arange(1, n_steps + 1, device=device)[:, None]  # [N, 1]

    busy, mark = 0.0, time.perf_counter()  # busy: own time; the clock pauses while a consumer holds an event
    slots = n_rows if max_batch is None else max_batch
    if not isinstance(slots, int) or slots < 1:
        raise UserError(f"max_batch={max_batch!r}: must be a whole number >= 1")
    stats = {} if stats is None else stats
    stats.update(decoder_passes=0, encoder_passes=0, row_steps=0, busy_row_steps=0)
    queue = deque(rows)
    active: list[_Row] = []  # in cache order
    cache = None
    while active or queue:
        # Block boundary: queued requests take the free slots; their prompts are encoded together and
        # join the running rows' cache.
        if queue and len(active) < slots:
            joining = [queue.popleft() for _ in range(min(slots - len(active), len(queue)))]
            t0 = time.perf_counter()
            lengths = [len(ids[row.request]) for row in joining]
            padded = torch.full((len(joining), max(lengths)), pad_id, dtype=torch.long, device=device)  # [j, P]
            for k, row in enumerate(joining):
                padded[k, :lengths[k]] = ids[row.request]
            # A row's last block is never encoded.
            fresh = model.new_cache(len(joining), max(n + (row.num_blocks - 1) * c for n, row in zip(lengths, joining)))
            _encode(model, padded, fresh, None if len(set(lengths)) == 1 else lengths)
            stats["encoder_passes"] += 1
            cache = fresh if cache is None else cache.extend(fresh)
            prefill_s = time.perf_counter() - t0
            for row in joining:
                row.prefill_s = prefill_s
            active += joining
        b = len(active)
        seed_t = torch.tensor([row.seed for row in active], device=device)[:, None, None]  # [b, 1, 1]
        block_t = torch.tensor([row.block for row in active], device=device)[:, None, None]  # [b, 1, 1]
        canvas = draws.token_ids(seed_t[:, 0], draws.INIT, block_t[:, 0], 0, positions, vocab, device=device)  # [b, C]
        for k, row in enumerate(active):
            if row.block == 0 and row.first_canvas is not None:
                canvas[k] = row.first_canvas
        # This block's draws for every step it may take, by counter (steps it does not take cost a few
        # integer ops and are never read).
        uniforms = draws.uniform(seed_t, draws.DRAW, block_t, step_ids, positions, device=device)  # [b, N, C]
        noises = draws.token_ids(seed_t, draws.RENOISE, block_t, step_ids, positions, vocab, device=device)  # [b, N, C]
        history = torch.full((params.stability_threshold, b, c), -1, dtype=torch.long, device=device)  # [S, b, C]
        soft = None  # self-conditioning restarts from zero in every block
        busy += time.perf_counter() - mark
        for k, row in enumerate(active):
            yield BlockStart(block=row.block, num_blocks=row.num_blocks, prefix_len=cache.lens[k], canvas=canvas[k],
                             row=row.request)
        mark = time.perf_counter()
        running = [True] * b
        final = torch.empty(b, c, dtype=torch.long, device=device)  # [b, C] each row's block output

        for i in range(n_steps):
            t0 = time.perf_counter()
            last = i == n_steps - 1
            out, accepted, next_canvas, history, stop = _denoise_step(
                model, canvas, cache, soft, temps_dev[i], history, params, uniforms[:, i], noises[:, i],
                want_soft=not last, compile_tiles=compile_tiles)
            stopped = stop.tolist() if can_stop_early else [False] * b  # the step's one host sync
            elapsed = time.perf_counter() - t0
            stats["decoder_passes"] += 1
            stats["row_steps"] += b
            stats["busy_row_steps"] += sum(running)
            busy += time.perf_counter() - mark
            for k, row in enumerate(active):
                if not running[k]:
                    continue
                reason = "stable_confident" if stopped[k] else ("step_cap" if last else None)
                row.denoise_s += elapsed
                yield Step(block=row.block, step=i + 1, max_steps=n_steps, temperature=temps[i], canvas_in=canvas[k],
                           argmax=out.argmax[k], sample=out.sample[k], accepted_mask=accepted[k],
                           accepted_count=accepted[k].sum(), entropy=out.entropy[k],
                           mean_entropy=out.entropy[k].mean(), next_canvas=next_canvas[k],
                           stop_reason=reason, elapsed_s=elapsed, row=row.request)
                if reason is not None:
                    running[k] = False
                    row.steps_per_block.append(i + 1)
                    final[k] = out.argmax[k]
            mark = time.perf_counter()
            if not any(running):
                break
            canvas, soft = next_canvas, out.soft  # frozen rows keep being computed; their results are unread

        t0 = time.perf_counter()
        tokens_all = final.tolist()  # the block's read-back: one sync per block
        read_s = time.perf_counter() - t0
        keep = []
        for k, row in enumerate(active):
            tokens = tokens_all[k]
            row.denoise_s += read_s
            stop_index = next((j for j, t in enumerate(tokens) if t in stops), None)
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
                keep.append(k)
                continue
            finish, stop_id = ("stop", tokens[stop_index]) if stop_index is not None else ("length", None)
            passes = sum(row.steps_per_block)
            timings = {"prefill_s": row.prefill_s, "denoise_s": row.denoise_s, "commit_s": row.commit_s,
                       "first_block_s": row.first_block_s, "total_s": busy + time.perf_counter() - mark}
            busy += time.perf_counter() - mark
            yield Done(token_ids=row.answer, finish_reason=finish, stop_id=stop_id, blocks=len(row.steps_per_block),
                       steps_per_block=row.steps_per_block, decoder_passes=passes,
                       tokens_per_forward=row.counted / passes, timings=timings, row=row.request)
            mark = time.perf_counter()
        if keep:
            t0 = time.perf_counter()
            cache.keep(keep)  # finished rows leave the batch
            _encode(model, final[keep] if len(keep) < b else final, cache)  # commit: the block becomes prefix
            stats["encoder_passes"] += 1
            commit_s = time.perf_counter() - t0
            for k in keep:
                active[k].commit_s += commit_s
        else:
            cache = None
        active = [active[k] for k in keep]


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
