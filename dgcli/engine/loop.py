"""The entry points of the one denoising loop (spec §7): `generate_batch_events` (many prompts: every input and
setting checked once, the requests run through an `LLMEngine`: the session's kept one, or a new one),
`generate_events` (a batch of one) and `generate` (its `Done`). `generate`, `watch`, `bench`, `sweep` and the
trace writer all consume these; there is no second copy of the loop anywhere.

Batch: each request at its own step of its own block, finished ones freeing their slot for the next (continuous
batching); HF's batched generate instead runs a batch's rows block by block together, freezing finished rows: the
same per-row results (tested), fewer passes here.
Must not: tokenize, print, write files, import transformers, or sync with the device inside a block.
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
from dgcli.engine.request import check_ids
from dgcli.sampling import host_reads
from dgcli.sampling.events import Done, Event
from dgcli.sampling.params import DiffusionEbParams


def _host_ids(ids: Any, what: str, vocab: int) -> list[int]:
    """`check_ids` of a list of ids or a [T] or [1, T] integer tensor."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise UserError(f"{what} has {ids.shape[0]} rows; pass one prompt here, or a list of prompts to "
                            "generate_batch_events")
        if ids.dim() > 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise UserError(f"{what} must be a list of token ids or an integer tensor [1, T]; "
                            f"got {ids.dtype} of shape {tuple(ids.shape)}")
        ids = ids.reshape(-1) if ids.device.type == "cpu" else host_reads.read(ids.reshape(-1), "prompt")
    return check_ids(ids, vocab, what, fix="pass a list of token ids or an integer tensor [1, T]")


def generate_batch_events(model: Any, prompts: Sequence[Sequence[int] | torch.Tensor], *, params: Any,
                          num_blocks: int | Sequence[int], seeds: Sequence[int] | None = None,
                          stop_ids: Iterable[int] | Sequence[Iterable[int]] = (), pad_id: int = 0,
                          init_canvases: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
                          compile_tiles: bool = False, max_batch: int | None = None, stats: dict | None = None,
                          step_mode: str = "dynamic", prefix_caching: bool = False, engines: KeptEngine | None = None,
                          constraints: Sequence[Any] | None = None,
                          images: Sequence[Sequence] | None = None) -> Iterator[Event]:
    """Run the entropy-bound sampler on several prompts at once, yielding each row's BlockStart, Step..., Commit per
    block and its Done, every event carrying `row` (the prompt's index). Per row: its own prompt length, seed
    (default: its params'), block cap, first canvas, stop ids (`stop_ids` as one list per prompt) and, when `params`
    is a list, sampler settings. A row never waits for, or runs extra steps for, its batch-mates, and its draws are
    addressed by its own seed, block, step and position, so its result does not depend on them (up to
    floating-point reduction order, which can differ with the batch's shape).

    At most `max_batch` rows (default: all) run at once; the others wait in input order. `stats` (a dict) receives
    the run's decoder_passes, encoder_passes, row_steps, denoise_s and encode_s (and prefix_cache_queries / _hits).
    `step_mode`: "dynamic" or "graphs" (CUDA graphs of denoise-only passes). `prefix_caching`: prompts share cached
    whole blocks. `engines`: the caller's `KeptEngine` (reused by the next call of the same shape); None: a new
    engine. `constraints`: one `sampling.constrain.Constraint` or None per prompt (structured output)."""
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
    ids = [_host_ids(x, "prompt" if n_rows == 1 else f"prompts[{r}]", vocab) for r, x in enumerate(prompts)]
    firsts = [None if x is None else _host_ids(x, "initial canvas" if n_rows == 1 else f"init_canvases[{r}]", vocab)
              for r, x in enumerate(inits)]
    for r, x in enumerate(firsts):
        if x is not None and len(x) != c:
            raise UserError(f"initial canvas has {len(x)} ids{'' if n_rows == 1 else f' (prompts[{r}])'}; the "
                            f"model's canvas holds {c}")
    slots = n_rows if max_batch is None else max_batch
    if isinstance(slots, int) and not isinstance(slots, bool):
        slots = min(slots, n_rows)
    # A request's last block is never encoded: a slot holds at most its prompt and blocks - 1 canvases.
    max_len = max(len(x) + (nb - 1) * c for x, nb in zip(ids, blocks))
    engine = (KeptEngine() if engines is None else engines).get(
        model, slots=slots, max_len=max_len, pad_id=pad_id, compile_tiles=compile_tiles, stats=stats,
        step_mode=step_mode, prefix_caching=prefix_caching)
    for r, first in enumerate(firsts):
        first = None if first is None else to_device(first, torch.long, model.embed_weight.device)  # [C]
        engine.add_request(ids[r], request_id=r, params=row_params[r], num_blocks=blocks[r], seed=seeds[r],
                           stop_ids=row_stops[r], first_canvas=first, constraint=cons[r],
                           images=images[r] if images else ())
    yield from engine.events()


def generate_events(model: Any, prompt_ids: Sequence[int] | torch.Tensor, *, params: Any, num_blocks: int,
                    stop_ids: Iterable[int] = (), pad_id: int = 0,
                    init_canvas: Sequence[int] | torch.Tensor | None = None, compile_tiles: bool = False,
                    step_mode: str = "dynamic", engines: KeptEngine | None = None, constraint: Any = None,
                    images: Sequence = ()) -> Iterator[Event]:
    """`generate_batch_events` on one prompt (ids, a [T] or [1, T] tensor); `init_canvas` [C] replaces the first
    block's random canvas; `compile_tiles`: the vocabulary pass's tile math through torch.compile (`--compile`)."""
    yield from generate_batch_events(model, [prompt_ids], params=params, num_blocks=num_blocks, stop_ids=stop_ids,
                                     pad_id=pad_id, init_canvases=[init_canvas], compile_tiles=compile_tiles,
                                     step_mode=step_mode, engines=engines, constraints=[constraint],
                                     images=[list(images)])


def generate(model: Any, prompt_ids: Sequence[int] | torch.Tensor, **kw: Any) -> Done:
    """`generate_events`' `Done` (same arguments)."""
    *_, done = generate_events(model, prompt_ids, **kw)  # the loop always ends with Done
    return done
