"""One request as the engine holds it, and the one check of a request's ids and length that every front-end uses.

Owns: `Request` (what to run and, while it runs, its state), `check_ids` (token ids in [0, vocab): one line naming
the argument and the first bad item) and `over_context` (the positions a prompt and its blocks need, when the
model's context cannot hold them); each front-end words its refusals from these rules.
Must not: tokenize, touch the device, or know about the scheduler's or the runner's work.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dgcli.errors import UserError

if TYPE_CHECKING:  # (this module loads without torch: the server's parser checks ids with it)
    import torch


@dataclass(eq=False)
class Request:
    """One request: what to run (checked params, seed, block cap, stop ids, first canvas) and its running state."""

    id: int  # carried by every event as `row`
    prompt: torch.Tensor  # [P] int64, on the host or already on the model's device
    params: Any  # DiffusionEbParams
    num_blocks: int
    seed: int
    stops: set[int] = field(default_factory=set)
    first_canvas: torch.Tensor | None = None  # [C]: the first block's canvas instead of random ids
    constraint: Any = None  # sampling.constrain.Constraint: its canvases drawn under a schema's automaton
    images: list = field(default_factory=list)  # (patches [n, 3·p²], positions [n, 2], content key) per image
    image_pos: list[int] = field(default_factory=list)  # prompt positions of the images' soft tokens, in order
    spans: tuple = ()  # (a, b) runs of one image's tokens that see each other (bidirectional configs)
    features: Any = None  # [len(image_pos), H]: the tower's output, made by the first pass that needs it
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
        """T_n at 0-based `step` of a block (n = N - step), computed when the step runs: a schedule as long as the
        step cap must never be built in one go."""
        from dgcli.sampling.rules import temperature  # (memoized: requests with the same settings share it)

        p = self.params
        return temperature(p.max_denoising_steps - step, p.max_denoising_steps, p.t_min, p.t_max)


# ---- the one check of ids and length -------------------------------------------------------------------------

PROMPT_FIX = "pass token ids (request.encode(session, text)) or use dgcli.generate for text"


def over_context(prompt_len: int, blocks: int, canvas_length: int, context: int) -> int | None:
    """The positions a prompt and `blocks` canvases need when more than `context` (past it they would run as
    noise); None when they fit."""
    need = prompt_len + blocks * canvas_length
    return need if need > context else None


def out_of_vocab(ids: list[int], vocab: int) -> int | None:
    """The index of the first id of `ids` (ints) outside [0, vocab), or None."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return None
    return next(n for n, i in enumerate(ids) if not 0 <= i < vocab)


def check_ids(ids: Any, vocab: int, what: str, fix: str = PROMPT_FIX) -> list[int]:
    """`ids` (ints, or a 1-D integer tensor or array) as a non-empty list of ints in [0, vocab), else one line
    naming `what` (the argument); `fix`: what to do with text."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise UserError(f"{what} is text, not token ids; {fix}")
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:  # a tensor or array: its dtype shows in the items
        ids = ids.tolist()
    try:
        out = list(ids)
    except TypeError:
        raise UserError(f"{what} is {kind(ids)}, not a list of token ids; {fix}") from None
    if not all(type(i) is int for i in out):  # the common case in one pass; otherwise name the first bad item
        for n, i in enumerate(out):
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise UserError(f"{what}[{n}] is {i!r}; token ids are ints, as a tokenizer gives them")
        out = [int(i) for i in out]
    if not out:
        raise UserError(f"{what} is empty; give at least one token id")
    n = out_of_vocab(out, vocab)
    if n is not None:
        raise UserError(f"{what}[{n}] = {out[n]} is outside the vocabulary [0, {vocab}); "
                        "was it tokenized for this model?")
    return out


def image_spans(ids: list[int], image_id: int | None) -> tuple:
    """The (a, b) runs of `image_id` in `ids`: each image's soft tokens, which see each other (the reference's
    `use_bidirectional_attention="vision"`: bidirectional inside each run of image tokens, on every layer)."""
    out, a = [], None
    for i, t in enumerate([*ids, None]):
        if t == image_id and a is None:
            a = i
        elif t != image_id and a is not None:
            out.append((a, i))
            a = None
    return tuple(out)


def kind(x: Any) -> str:
    return "None" if x is None else type(x).__name__
