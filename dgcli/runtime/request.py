"""One request through the engine: the library's generate API, layered as mlx-lm's is (`stream` -> `run` ->
`generate`; `run_batch` for many). generate, watch, bench, sweep and the --ray workers all call these, on the
session's kept engine; the id and context rules and the max_tokens cut are the engine's (`dgcli.engine`).

Owns: prompt encoding within the context, the library's input checks (one UserError line naming the argument,
once per call), reading `--init-canvas`, what counts as an empty answer, the `Response` record.
Must not: print, write files (a trace writer is an `on_event` consumer), or contain a denoising loop.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dgcli.engine import check_ids, cut, out_of_vocab, over_context
from dgcli.engine import kind as _kind
from dgcli.errors import UserError
from dgcli.runtime.preflight import check_prompt_chars, prompt_room
from dgcli.runtime.settings import blocks_for, token_budget
from dgcli.sampling.events import BlockStart, Done, Event, Step


@dataclass
class Response:
    prompt_ids: list[int]
    token_ids: list[int]  # the answer: before the first stop id, at most max_tokens ids
    finish_reason: str  # "stop" (a stop id ended it) | "length" (blocks or max_tokens ran out)
    done: Done  # the loop's summary: blocks, steps per block, decoder passes, timings
    text: str | None = None  # the decoded answer; None without a tokenizer
    block_prefix: list[int] = field(default_factory=list)  # cache length when each block started

    def as_dict(self, settings: dict) -> dict:
        """The `--format json` result (PRODUCT.md)."""
        d = self.done
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "blocks": d.blocks, "steps_per_block": d.steps_per_block, "tokens_per_forward": d.tokens_per_forward,
                "timings": d.timings, "settings": settings, "prompt_tokens": len(self.prompt_ids)}


def check_context(session: Any, prompt_len: int, num_blocks: int | None = None) -> None:
    cfg = session.config
    blocks = session.num_blocks if num_blocks is None else num_blocks
    if over_context(prompt_len, blocks, cfg.canvas_length, cfg.max_position_embeddings) is not None:
        raise UserError(f"the prompt ({prompt_len} tokens) plus {blocks} block(s) of {cfg.canvas_length} "
                        f"exceed the model's context of {cfg.max_position_embeddings}; shorten the prompt or lower --blocks "
                        "(or --max-tokens, which sets the block count when --blocks is not given)")


def encode(session: Any, text: str, *, raw: bool = False, thinking: bool | None = None,
           images: Sequence[Any] = ()) -> list[int]:
    """Prompt text (after `images`: `runtime.vision.read_images`' pictures) -> ids through the checkpoint's chat
    template (`raw`: without it); thinking None = the session's setting. Checked against the context for the
    session's block count."""
    if not isinstance(text, str):
        fix = ("decode it first (prompt.decode())" if isinstance(text, (bytes, bytearray)) else "pass a str"
               if text is None or isinstance(text, numbers.Number) else
               "for token ids call request.run(session, ids) or request.stream(session, ids)")
        raise UserError(f"the prompt is {_kind(text)}, not text; {fix}")
    if session.tokenizer is None:
        raise UserError(f"{session.path}: no tokenizer.json; text prompts need the checkpoint's tokenizer")
    if not text.strip() and not images:
        raise UserError("the prompt is empty; pass text as an argument or on stdin")
    think = session.resolved.run.thinking if thinking is None else thinking
    cfg = session.config  # a prompt far too long is refused from its length, before it is tokenized
    check_prompt_chars(text, session.tokenizer, prompt_room(cfg, session.num_blocks), cfg.max_position_embeddings)
    if images:
        from dgcli.runtime.vision import prompt_ids

        ids = prompt_ids(session, text, list(images), raw=raw, thinking=think)
    else:
        ids = session.tokenizer.encode_prompt(text, raw=raw, thinking=think)
    check_context(session, len(ids))
    return ids


IDS_PREFIX = "ids:"
_INT = re.compile(r"-?\d+")


def read_init_canvas(session: Any, spec: str | list, *, name: str = "--init-canvas") -> tuple[list[int], str]:
    """(ids, "text" or "ids") for the start of the first canvas from `--init-canvas` (or a JSONL row's
    `init_canvas`: `name`). A string is text without the chat template ("1 2 3" too: the sort and count tasks start
    from digits), token ids only after `ids:` ("ids:5,6,7"); a list (JSON) is token ids."""
    c, v = session.config.canvas_length, session.config.vocab_size
    if isinstance(spec, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
            raise UserError(f"{name} {spec!r} is not a list of token ids; give whole numbers, e.g. [5, 6, 7]")
        ids, how = list(spec), "ids"
    elif not isinstance(spec, str):
        raise UserError(f"{name} {spec!r}: give text, \"ids:5,6,7\" or a list of token ids")
    elif spec.strip().startswith(IDS_PREFIX):
        ids, how = _id_list(spec, name), "ids"
    elif spec.strip():
        if session.tokenizer is None:
            raise UserError(f"{name} {spec!r} is text, which needs the checkpoint's tokenizer; "
                            f"give token ids as {IDS_PREFIX}5,6,7")
        try:
            ids, how = session.tokenizer.encode_text(spec), "text"
        except UserError as e:  # text that is not UTF-8: say which value it was
            raise UserError(f"{name}: {e}") from None
    else:
        ids, how = [], "text"
    if not ids:
        raise UserError(f"{name} is empty; give text or token ids ({IDS_PREFIX}5,6,7), or leave it out")
    bad = out_of_vocab(ids, v)
    if bad is not None:
        raise UserError(f"{name}: id {ids[bad]} is outside the vocabulary [0, {v}); use ids from 0 to {v - 1}")
    if len(ids) > c:
        raise UserError(f"{name} has {len(ids)} tokens; the canvas holds {c}: shorten it")
    return ids, how


def _id_list(spec: str, name: str) -> list[int]:
    """`ids:5,6,7` -> [5, 6, 7]; one line naming the first item that is not a token id."""
    parts = [p.strip() for p in spec.strip()[len(IDS_PREFIX):].split(",")]
    if parts == [""]:
        return []
    for n, p in enumerate(parts, 1):
        if not _INT.fullmatch(p):
            what = "is empty" if not p else f"{p!r} is not a token id"
            raise UserError(f"{name} {spec!r}: item {n} {what}; after {IDS_PREFIX} give comma-separated token ids "
                            f"only (e.g. {IDS_PREFIX}5,6,7), or drop the prefix for text")
    return [int(p) for p in parts]


def canvas_ids(session: Any, ids: Any, what: str = "init_canvas") -> list[int] | None:
    """A whole first canvas (`canvas_length` token ids) or None, checked as `check_ids`."""
    if ids is None:
        return None
    c = session.config.canvas_length
    fix = (f"give {c} token ids: request.fill_canvas(session, request.read_init_canvas(session, text)[0], seed) "
           "builds them, and dgcli.generate takes text")
    out = check_ids(ids, session.config.vocab_size, what, fix)
    if len(out) != c:
        raise UserError(f"{what} has {len(out)} ids; the canvas holds {c}: {fix}")
    return out


def fill_canvas(session: Any, ids: Sequence[int], seed: int) -> list[int]:
    """A first canvas that starts with `ids`; the rest stays uniform noise (the counter stream's `PAD` draws
    for `seed`, apart from the sampler's own draws)."""
    import torch

    from dgcli.sampling import draws

    c, v = session.config.canvas_length, session.config.vocab_size
    pad = draws.token_ids(seed, draws.PAD, 0, 0, torch.arange(len(ids), c), v)  # random ids after the given ones
    return list(ids) + pad.tolist()


def only_padding(token_ids: Sequence[int], pad_id: int) -> bool:
    return bool(token_ids) and all(t == pad_id for t in token_ids)


def is_empty(token_ids: Sequence[int], text: str | None, pad_id: int) -> bool:
    """An answer without text: a stop id came first, or every position settled on the pad id (a chat-trained
    checkpoint's answer to a raw prompt)."""
    if text is not None:
        return not text.strip()
    return not token_ids or only_padding(token_ids, pad_id)


def stream(session: Any, prompt_ids: Sequence[int], *, params: Any = None, ignore_eos: bool = False,
           init_canvas: Sequence[int] | None = None, json_schema: dict | None = None) -> Iterator[Event]:
    """The engine's events for one request: token ids (`encode` makes them), `params` (default: the session's),
    `init_canvas` (a whole first canvas of ids: `fill_canvas`), `json_schema` (the answer is JSON valid under it)."""
    prompt_ids = check_ids(prompt_ids, session.config.vocab_size, "prompt_ids")
    return _one(session, prompt_ids, params, ignore_eos, canvas_ids(session, init_canvas), json_schema)


def constraint(session: Any, json_schema: dict | None, num_blocks: int, ignore_eos: bool = False) -> Any:
    """The Constraint of an answer under `json_schema` (None: none; any object: `sampling.constrain.ANY_OBJECT`)."""
    if json_schema is None:
        return None
    if session.tokenizer is None:
        raise UserError(f"{session.path}: no tokenizer.json; a JSON schema needs the checkpoint's tokenizer")
    from dgcli.sampling.constrain import Constraint, compile_schema

    stops = () if ignore_eos else session.stop_ids
    room = token_budget(session.resolved.run.max_tokens, num_blocks, session.config.canvas_length)
    return Constraint(compile_schema(session.tokenizer, json_schema, stops), room)


def _one(session: Any, prompt_ids: list[int], params: Any, ignore_eos: bool, init_canvas: list[int] | None,
         json_schema: dict | None, images: list = ()) -> Iterator[Event]:
    params = session.params if params is None else params
    num_blocks = blocks_for(params, session.resolved.run.max_tokens, session.config.canvas_length)
    check_context(session, len(prompt_ids), num_blocks)  # positions past the context would run, as noise
    cons = [constraint(session, json_schema, num_blocks, ignore_eos)]
    return _events(session, [prompt_ids], params, num_blocks, ignore_eos, cons, inits=[init_canvas],
                   images=[list(images)])


def _events(session: Any, prompts: list[list[int]], params: Any, num_blocks: int, ignore_eos: bool, cons: list, *,
            seeds: list | None = None, inits: list | None = None, images: list | None = None,
            batch_size: int | None = None, stats: dict | None = None, prefix_caching: bool = False) -> Iterator[Event]:
    from dgcli.engine import generate_batch_events

    return generate_batch_events(
        session.model, prompts, params=params, num_blocks=num_blocks, seeds=seeds,
        stop_ids=() if ignore_eos else session.stop_ids, pad_id=session.pad_id, init_canvases=inits,
        compile_tiles=session.compiled, max_batch=batch_size, stats=stats, step_mode=session.step_mode,
        prefix_caching=prefix_caching, engines=getattr(session, "engines", None), constraints=cons, images=images)


def run(session: Any, prompt_ids: Sequence[int], *, params: Any = None, ignore_eos: bool = False,
        init_canvas: Sequence[int] | None = None, on_event: Callable[[Event], None] | None = None,
        show_thinking: bool = False, json_schema: dict | None = None, images: list = ()) -> Response:
    """One request to its `Response` (arguments as `stream`'s); `on_event` sees every event as it happens
    (progress, watch, trace); `images`: `runtime.vision.engine_images` of the prompt's images, in order."""
    prompt_ids = check_ids(prompt_ids, session.config.vocab_size, "prompt_ids")
    events = _one(session, prompt_ids, params, ignore_eos, canvas_ids(session, init_canvas), json_schema, images)
    [(_, response)] = _responses(session, [prompt_ids], events, show_thinking, on_event)
    return response


def run_batch(session: Any, prompts: Iterable[Sequence[int]], *, batch_size: int, seeds: Iterable[int] | None = None,
              init_canvases: Iterable[Sequence[int] | None] | None = None, params: Any = None,
              ignore_eos: bool = False, show_thinking: bool = False,
              on_event: Callable[[Event], None] | None = None, stats: dict | None = None,
              json_schemas: Iterable[dict | None] | None = None,
              images: list | None = None) -> Iterator[tuple[int, Response]]:
    """Many requests with continuous batching (`batch_size` slots; the rest queue in input order); yields (index,
    Response) as each finishes. `seeds` (default: the params'), `init_canvases`, `json_schemas`, `images`: one per
    prompt, as `run` takes them. Every input is checked at the call; `stats` receives the engine's pass counts."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be a whole number >= 1")
    fix = "pass a list of token-id lists ([request.encode(session, text), ...])"
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise UserError(f"prompts is {_kind(prompts)}; {fix}")
    vocab = session.config.vocab_size
    prompts = [check_ids(ids, vocab, f"prompts[{i}]") for i, ids in enumerate(prompts)]
    seeds = _per_prompt(seeds, "seeds", len(prompts))
    for i, x in enumerate(seeds or ()):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise UserError(f"seeds[{i}] is {x!r}; a seed is a whole number (int)")
    inits = _per_prompt(init_canvases, "init_canvases", len(prompts))
    inits = None if inits is None else [canvas_ids(session, x, f"init_canvases[{i}]") for i, x in enumerate(inits)]
    params = session.params if params is None else params
    num_blocks = blocks_for(params, session.resolved.run.max_tokens, session.config.canvas_length)
    schemas = _per_prompt(json_schemas, "json_schemas", len(prompts)) or [None] * len(prompts)
    cons = []
    for i, (ids, x) in enumerate(zip(prompts, schemas)):  # every prompt before the first runs
        try:
            check_context(session, len(ids), num_blocks)
            cons.append(constraint(session, x, num_blocks, ignore_eos))
        except UserError as e:
            raise UserError(f"prompts[{i}]: {e}") from None
    if not prompts:
        return iter(())
    events = _events(session, prompts, params, num_blocks, ignore_eos, cons, seeds=seeds, inits=inits,
                     images=_per_prompt(images, "images", len(prompts)), batch_size=batch_size, stats=stats,
                     prefix_caching=getattr(session, "prefix_caching", True))
    return _responses(session, prompts, events, show_thinking, on_event)


def _per_prompt(values: Iterable | None, name: str, n: int) -> list | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise UserError(f"{name} is {_kind(values)}; give a list, one per prompt, or leave it out")
    values = list(values)
    if len(values) != n:
        raise UserError(f"{name} has {len(values)} items for {n} prompts; give one per prompt, or leave it out")
    return values


def _responses(session: Any, prompts: list[list[int]], events: Iterator[Event], show_thinking: bool,
               on_event: Callable[[Event], None] | None) -> Iterator[tuple[int, Response]]:
    starts: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    checked = False
    for event in events:
        if not checked and isinstance(event, Step):
            checked = _check_finite(session, event)
        if on_event is not None:
            on_event(event)
        if isinstance(event, BlockStart):
            starts[event.row].append(event.prefix_len)
        elif isinstance(event, Done):
            yield event.row, _response(session, prompts[event.row], event, starts.pop(event.row), show_thinking)


def _check_finite(session: Any, step: Step) -> bool:
    """Stop with one line when the first step's entropy on a CPU run is NaN (corrupt weights: the answer would be
    noise). Not on a GPU: reading the value would be a sync outside the runner."""
    import math

    if step.mean_entropy.device.type == "cpu" and not math.isfinite(float(step.mean_entropy)):
        raise UserError(f"{session.path}: the first denoising step gave NaN/Inf logits: the weights are corrupt "
                        "(NaN or Inf values, e.g. a damaged file's scales); re-download or re-convert the checkpoint")
    return True


def _response(session: Any, prompt_ids: Sequence[int], done: Done, starts: list[int], show_thinking: bool) -> Response:
    token_ids, finish = cut(done.token_ids, done.finish_reason, session.resolved.run.max_tokens)
    text = None
    if session.tokenizer is not None:
        text = session.tokenizer.answer_text(token_ids, show_thinking=show_thinking, stop_ids=session.stop_ids)
    return Response(list(prompt_ids), token_ids, finish, done, text, starts)


def generate(session: Any, text: str, *, raw: bool = False, thinking: bool | None = None,
             show_thinking: bool = False, init_canvas: str | Sequence[int] | None = None, **kw: Any) -> Response:
    """Text in, `Response` out: `encode` then `run`. A str `init_canvas` is read as --init-canvas is (the rest of
    the canvas seeded noise); token ids are a whole canvas, as `run` takes them."""
    ids = encode(session, text, raw=raw, thinking=thinking)
    if isinstance(init_canvas, str):
        seed = (kw.get("params") or session.params).seed
        init_canvas = fill_canvas(session, read_init_canvas(session, init_canvas, name="init_canvas")[0], seed)
    return run(session, ids, show_thinking=show_thinking, init_canvas=init_canvas, **kw)
