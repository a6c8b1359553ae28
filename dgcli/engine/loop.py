"""The entropy-bound block-diffusion sampler (spec §7): the entry points of the one denoising loop.

Owns: `generate_batch_events` (many prompts: checks every input and setting once, builds the requests
and runs them through an `LLMEngine`, the loop itself: a session's own, kept between calls, or a new one),
`generate_events` (one prompt: a batch of one) and `generate` (its `Done`). The rules and one step are
`sampling/rules.py`; every random draw comes from the counter-based stream of `sampling/draws.py`, addressed
by seed, block, step and position: same seed, settings, device and dtype give identical events whichever
kernel path runs (up to rounding at a CDF boundary) and whatever the batch. `generate`, `watch`, `bench`, `sweep` and the trace writer all consume these;
there is no second copy of the loop anywhere.
Must not: tokenize, print, write files, import transformers, or sync with the device inside a block: on
CUDA the engine reads a pass's stop flags one pass later (its lag), elsewhere once per pass (and
not at all when no step can stop early).

Decisions (kept from the reference unless noted):
* A block's output is the argmax of its last step, never the sampled canvas.
* `Done.token_ids` stops *before* the first stop id (it is the answer text's ids); the stop id itself
  is `Done.stop_id`. HF keeps the stop id and pads after it; nothing after it is kept here.
* `tokens_per_forward` is HF's: generated ids up to and including the stop id, not counting ids equal
  to `pad_id`, divided by decoder passes (encoder passes are not counted).
* Timings (seconds, the loop's own time; time spent by the consumer between events is excluded):
  prefill_s (the passes carrying the prompt, whole: the last also runs the first block's first step, which
  denoise_s counts too), denoise_s (all blocks' steps up to the block-end read-back),
  commit_s (encodes of committed blocks), first_block_s (start to the first block's tokens),
  total_s; in a batch every request's clock starts at the call, so a queued request's include its wait.
* Batch: each request at its own step of its own block, finished ones freeing their slot for the
  next (continuous batching); HF's batched generate instead runs a batch's rows block by block
  together, freezing finished rows: the same per-row results (tested), fewer passes here.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from dgcli.errors import UserError
from dgcli.kernels.transfer import to_device
from dgcli.engine.llm_engine import KeptEngine
from dgcli.engine.request import Request, out_of_vocab
from dgcli.sampling.events import Done, Event
from dgcli.sampling.params import DiffusionEbParams


# ---- input checks ------------------------------------------------------------------------------------


def _ids_tensor(ids: Sequence[int] | torch.Tensor, what: str, vocab: int, device: torch.device) -> torch.Tensor:
    """A [1, T] int64 tensor on `device` from a list of ids, a [T] or a [1, T] tensor."""
    if isinstance(ids, (list, tuple)) and ids and all(type(i) is int for i in ids):  # checked on the host
        if out_of_vocab(ids, vocab) is not None:
            raise UserError(f"{what} holds ids outside the vocabulary [0, {vocab}); was it tokenized for this model?")
        return to_device(ids, torch.long, device)[None]  # no copy that waits for the device
    try:  # no dtype given: float ids stay floats and are refused below, not truncated
        t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids)) if len(ids) else torch.zeros(0).long()
    except (TypeError, ValueError, RuntimeError):
        raise UserError(f"{what} must be a list of token ids (ints) or an integer tensor [1, T]; "
                        f"got {type(ids).__name__}") from None
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
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
    step_mode: str = "dynamic",
    prefix_caching: bool = False,
    engines: KeptEngine | None = None,
    constraints: Sequence[Any] | None = None,
    images: Sequence[Sequence] | None = None,
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
    decoder passes' own time, each pass once) and encode_s (prefills and commits). `step_mode` picks how a
    step runs: "dynamic" (its exact shapes) or "graphs" (CUDA graphs of denoise-only passes: model/graphs.py).
    `prefix_caching`: prompts share the cached whole blocks of earlier prompts and answers of this call (stats
    gain prefix_cache_queries and _hits). `engines`: the caller's kept engine (a session's `engines`: reused by
    the next call of the same shape, its graphs too); None: a new engine for this call. `constraints`: one
    `sampling.constrain.Constraint` or None per prompt (structured output)."""
    n_rows = len(prompts)
    if n_rows < 1:
        raise UserError("no prompts: give at least one")
    many = isinstance(params, (list, tuple))
    row_params = [DiffusionEbParams.check(p) for p in (params if many else [params])]  # the one validator
    if many and len(row_params) != n_rows:
        raise UserError(f"{n_rows} prompts need one params each, got {len(row_params)}")
    row_params = row_params if many else row_params * n_rows
    blocks = [num_blocks] * n_rows if isinstance(num_blocks, int) else list(num_blocks)
    seeds = [p.seed for p in row_params] if seeds is None else list(seeds)
    inits = [None] * n_rows if init_canvases is None else list(init_canvases)
    cons = [None] * n_rows if constraints is None else list(constraints)
    for name, values in (("num_blocks", blocks), ("seeds", seeds), ("init_canvases", inits), ("constraints", cons)):
        if len(values) != n_rows:
            raise UserError(f"{name} has {len(values)} items for {n_rows} prompts; give one per prompt")
    for i, x in enumerate(seeds):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise UserError(f"seeds[{i}] is {x!r}; a seed is a whole number (int)")
    seeds = [int(x) for x in seeds]
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
    requests = []
    for r in range(n_rows):
        first, at = None, "" if n_rows == 1 else f" (prompts[{r}])"  # which row, in a batch
        prompt = _ids_tensor(prompts[r], f"prompt{at}", vocab, device)[0]  # [P]
        if inits[r] is not None:
            first = _ids_tensor(inits[r], f"initial canvas{at}", vocab, device)[0]  # [C]
            if first.shape[0] != c:
                raise UserError(f"initial canvas has {first.shape[0]} ids{at}; the model's canvas holds {c}")
        requests.append(Request(id=r, prompt=prompt, params=row_params[r], num_blocks=blocks[r], seed=seeds[r],
                                stops=row_stops[r], first_canvas=first, constraint=cons[r],
                                images=list(images[r] if images else ())))
    slots = n_rows if max_batch is None else max_batch
    if isinstance(slots, int) and not isinstance(slots, bool):
        slots = min(slots, n_rows)
    # A request's last block is never encoded: a slot holds at most its prompt and blocks - 1 canvases.
    max_len = max(len(q.prompt) + (q.num_blocks - 1) * c for q in requests)
    engine = (KeptEngine() if engines is None else engines).get(
        model, slots=slots, max_len=max_len, pad_id=pad_id, compile_tiles=compile_tiles, stats=stats,
        step_mode=step_mode, prefix_caching=prefix_caching)
    for q, ids in zip(requests, prompts):  # host ids where given (prefix caching keys blocks by them)
        engine.submit(q, ids=list(ids) if isinstance(ids, (list, tuple)) else None)
    yield from engine.events()


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
    step_mode: str = "dynamic",
    engines: KeptEngine | None = None,
    constraint: Any = None,
    images: Sequence = (),
) -> Iterator[Event]:
    """Run the entropy-bound sampler on one prompt (a batch of one in `generate_batch_events`), yielding
    BlockStart, Step..., Commit per block, then Done. `params` needs max_denoising_steps, t_min, t_max,
    entropy_bound, stability_threshold, confidence_threshold, seed (e.g.
    `dgcli.sampling.params.DiffusionEbParams`); `params.seed` keys every random draw (see `draws.py`);
    `init_canvas` [C] replaces the first block's random canvas; `compile_tiles` runs the vocabulary
    pass's tile math through torch.compile (the session's `--compile`); `engines` as `generate_batch_events`'."""
    params = DiffusionEbParams.check(params)
    vocab = model.config.vocab_size
    prompt = _ids_tensor(prompt_ids, "prompt", vocab, model.embed_weight.device)  # [1, P]: one row only
    yield from generate_batch_events(model, [prompt[0]], params=params, num_blocks=num_blocks, stop_ids=stop_ids,
                                     pad_id=pad_id, init_canvases=[init_canvas], compile_tiles=compile_tiles,
                                     step_mode=step_mode, engines=engines, constraints=[constraint],
                                     images=[list(images)])


def generate(model: Any, prompt_ids: Sequence[int] | torch.Tensor, **kw: Any) -> Done:
    """Drain `generate_events` (same arguments) and return its `Done`, for callers that want only the answer."""
    *_, done = generate_events(model, prompt_ids, **kw)  # the loop always ends with Done
    return done
