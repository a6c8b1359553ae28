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
* Batch: one prompt per call. The step math is written over [B, C] rows, but a batch needs per-row
  freezing and finishing (HF does both); until then B > 1 is a clear error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
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
def _encode(model: Any, ids: torch.Tensor, cache: Any) -> None:
    model.encode(ids, cache)
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
        raise UserError(f"{what} has {t.shape[0]} rows: batched generation is not supported yet; "
                        "pass one prompt at a time")
    if t.shape[1] == 0:
        raise UserError(f"{what} is empty; give at least one token")
    if int(t.min()) < 0 or int(t.max()) >= vocab:  # once per generation, before any step
        raise UserError(f"{what} holds ids outside the vocabulary [0, {vocab}); was it tokenized for this model?")
    return t.to(device=device, dtype=torch.long)


# ---- the loop ------------------------------------------------------------------------------------------


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
    """Run the entropy-bound sampler on one prompt, yielding BlockStart, Step..., Commit per block,
    then Done. `params` needs max_denoising_steps, t_min, t_max, entropy_bound, stability_threshold,
    confidence_threshold, seed (e.g. `dgcli.sampling.params.DiffusionEbParams`); `params.seed` keys every
    random draw (see `draws.py`); `init_canvas` [C] replaces the first block's random canvas;
    `compile_tiles` runs the vocabulary pass's tile math through torch.compile (the session's `--compile`)."""
    params = DiffusionEbParams.check(params)  # the one validator (presets, flags and requests use it too)
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise UserError(f"num_blocks={num_blocks!r}: generate at least one block")
    vocab, c = model.config.vocab_size, model.config.canvas_length
    device = model.embed_weight.device
    prompt = _ids_tensor(prompt_ids, "prompt", vocab, device)  # [1, P]
    first_canvas = None
    if init_canvas is not None:
        first_canvas = _ids_tensor(init_canvas, "initial canvas", vocab, device)  # [1, C]
        if first_canvas.shape[1] != c:
            raise UserError(f"initial canvas has {first_canvas.shape[1]} ids; the model's canvas holds {c}")
    seed, positions = params.seed, torch.arange(c, device=device)  # [C]
    stops = {int(s) for s in stop_ids}
    n_steps = params.max_denoising_steps
    temps = [temperature(n, n_steps, params.t_min, params.t_max) for n in range(n_steps, 0, -1)]
    temps_dev = torch.tensor(temps, dtype=torch.float32, device=device)  # [N]: one copy, then device views
    # Mean entropy is >= 0, so "< 0" never holds: no step can stop early and the loop never has to
    # wait for the device inside a block (fixed-work mode).
    can_stop_early = params.confidence_threshold > 0

    timings = {"prefill_s": 0.0, "denoise_s": 0.0, "commit_s": 0.0, "first_block_s": 0.0, "total_s": 0.0}
    busy, mark = 0.0, time.perf_counter()  # busy: own time; the clock pauses while a consumer holds an event

    cache = model.new_cache(1, prompt.shape[1] + (num_blocks - 1) * c)  # the last block is never encoded
    _encode(model, prompt, cache)
    timings["prefill_s"] = time.perf_counter() - mark

    answer: list[int] = []
    counted = 0  # ids for tokens_per_forward (HF definition)
    steps_per_block: list[int] = []
    finish, stop_id = "length", None
    for block in range(num_blocks):
        if block == 0 and first_canvas is not None:
            canvas = first_canvas
        else:
            canvas = draws.token_ids(seed, draws.INIT, block, 0, positions, vocab, device=device)[None]  # [1, C]
        # This block's draws for every step it may take, by counter (steps it does not take cost a few
        # [N, C] integer ops and are never read).
        steps = torch.arange(1, n_steps + 1, device=device)[:, None]  # [N, 1]
        uniforms = draws.uniform(seed, draws.DRAW, block, steps, positions, device=device)  # [N, C]
        noises = draws.token_ids(seed, draws.RENOISE, block, steps, positions, vocab, device=device)  # [N, C]
        history = torch.full((params.stability_threshold, 1, c), -1, dtype=torch.long, device=device)  # [S, 1, C]
        soft = None  # self-conditioning restarts from zero in every block
        busy += time.perf_counter() - mark
        yield BlockStart(block=block, num_blocks=num_blocks, prefix_len=cache.length, canvas=canvas[0])
        mark = time.perf_counter()
        block_denoise = 0.0

        for i in range(n_steps):
            t0 = time.perf_counter()
            last = i == n_steps - 1
            out, accepted, next_canvas, history, stop = _denoise_step(
                model, canvas, cache, soft, temps_dev[i], history, params, uniforms[i][None], noises[i][None],
                want_soft=not last, compile_tiles=compile_tiles)
            converged = can_stop_early and bool(stop.all())  # the step's one host sync
            reason = "stable_confident" if converged else ("step_cap" if last else None)
            elapsed = time.perf_counter() - t0
            block_denoise += elapsed
            busy += time.perf_counter() - mark
            yield Step(block=block, step=i + 1, max_steps=n_steps, temperature=temps[i], canvas_in=canvas[0],
                       argmax=out.argmax[0], sample=out.sample[0], accepted_mask=accepted[0],
                       accepted_count=accepted[0].sum(), entropy=out.entropy[0],
                       mean_entropy=out.entropy[0].mean(), next_canvas=next_canvas[0],
                       stop_reason=reason, elapsed_s=elapsed)
            mark = time.perf_counter()
            if reason is not None:
                break
            canvas, soft = next_canvas, out.soft
        steps_per_block.append(i + 1)

        t0 = time.perf_counter()
        tokens = out.argmax[0].tolist()  # the block's read-back: one sync per block
        timings["denoise_s"] += block_denoise + time.perf_counter() - t0
        stop_index = next((j for j, t in enumerate(tokens) if t in stops), None)
        kept = tokens if stop_index is None else tokens[:stop_index]
        answer += kept
        counted += sum(t != pad_id for t in tokens[: len(kept) + (stop_index is not None)])
        if block == 0:
            timings["first_block_s"] = busy + time.perf_counter() - mark
        busy += time.perf_counter() - mark
        yield Commit(block=block, tokens=tokens, stop_index=stop_index)
        mark = time.perf_counter()
        if stop_index is not None:
            finish, stop_id = "stop", tokens[stop_index]
            break
        if block < num_blocks - 1:
            t0 = time.perf_counter()
            _encode(model, out.argmax, cache)  # commit: the block becomes prefix for the next one
            timings["commit_s"] += time.perf_counter() - t0

    busy += time.perf_counter() - mark
    timings["total_s"] = busy
    passes = sum(steps_per_block)
    yield Done(token_ids=answer, finish_reason=finish, stop_id=stop_id, blocks=len(steps_per_block),
               steps_per_block=steps_per_block, decoder_passes=passes, tokens_per_forward=counted / passes,
               timings=timings)


def generate(model: Any, prompt_ids: Sequence[int] | torch.Tensor, **kw: Any) -> Done:
    """Drain `generate_events` (same arguments) and return its `Done`, for callers that want only the answer."""
    *_, done = generate_events(model, prompt_ids, **kw)  # the loop always ends with Done
    return done
