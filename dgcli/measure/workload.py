"""The bench and sweep workload: a prompt file (the bundled held-out set by default) or random token ids (with the
loud warning they need), `bench --image`'s images, the prompt-set hash of every row's provenance and the check of
the workload's counts. Must not: run the model or measure.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from dgcli.errors import UserError
from dgcli.text.prompts import read_prompt_file

BUNDLED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"
RANDOM_PROMPT_WARNING = (
    "WARNING: prompts are random token ids. Early stopping does not fire on random text the way it does "
    "on real text (one vendor under-reported throughput 3x this way): treat these numbers as fixed-work "
    "measurements only, and use --prompts FILE for real workloads.")


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # None for random token ids
    answer: str | None = None
    images: list = field(default_factory=list)  # the engine's (patches, positions, key) per image, in prompt order


def default_prompt_file() -> Path | None:
    """The bundled held-out prompt set (dgcli/data/prompts/*.jsonl), once it exists."""
    files = sorted(BUNDLED_PROMPTS.glob("*.jsonl")) if BUNDLED_PROMPTS.is_dir() else []
    return files[0] if files else None


def read_prompts(path: str | Path, num_prompts: int | None) -> list[Prompt]:
    """The first `num_prompts` rows of a prompt file as text prompts (not yet encoded)."""
    return [Prompt([], r["prompt"], r.get("answer")) for r in read_prompt_file(path)[:num_prompts]]


def random_prompts(vocab: int, n: int, length: int, seed: int, avoid: set[int] = frozenset()) -> list[Prompt]:
    """n prompts of `length` uniform token ids (stop ids avoided), reproducible from `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(Prompt([i if i not in avoid else (i + 1) % vocab for i in ids]))
    return out


def prompt_set_hash(prompts: list[Prompt], of: str = "ids") -> str:
    """sha256 of the prompts' token ids (the model sees ids: two tokenizers of one file hash differently), or of
    their texts (`of="text"`: what a remote bench sends)."""
    h = hashlib.sha256(json.dumps([getattr(p, of) for p in prompts], separators=(",", ":")).encode())
    return h.hexdigest()[:16]


def check_counts(*, num_prompts: int | None, runs: int, warmup: int, input_len: int) -> None:
    """Reject impossible counts before the model, the card and the peak measurement (seconds of work)."""
    if num_prompts is not None and num_prompts < 1:
        raise UserError(f"--num-prompts {num_prompts}: must be >= 1 (leave it out to use every prompt)")
    if runs < 1:
        raise UserError(f"--runs {runs}: must be >= 1 (timed passes over the prompts)")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be >= 0 (0 skips the warm-up)")
    if input_len < 1:
        raise UserError(f"--random-input-len {input_len}: must be >= 1")


def build_prompts(session: Any, *, prompts_file: str | None, random_ids: bool, num_prompts: int | None,
                  input_len: int, seed: int, warn: Callable[[str], None]) -> tuple[list[Prompt], str]:
    """The workload and its description ('file:PATH' or 'random-token-ids'); warns loudly on random ids."""
    from dgcli.runtime.request import check_context, encode

    check_counts(num_prompts=num_prompts, runs=1, warmup=0, input_len=input_len)  # [:num_prompts] needs >= 1
    cfg = session.config
    path = None if random_ids else (prompts_file or session.resolved.run.prompt_set or
                                    (default_prompt_file() if session.tokenizer is not None else None))
    if path is not None:
        if session.tokenizer is None:
            raise UserError(f"--prompts {path}: the model has no tokenizer.json to encode text prompts; "
                            "use --random-prompts (dummy weights and tokenizer-less checkpoints)")
        return [replace(p, ids=encode(session, p.text)) for p in read_prompts(path, num_prompts)], f"file:{path}"
    warn(RANDOM_PROMPT_WARNING)
    out = random_prompts(cfg.vocab_size, num_prompts or 4, input_len, seed, set(session.stop_ids))
    check_context(session, input_len)
    return out, "random-token-ids"


def with_images(session: Any, prompts: list[Prompt], images: list) -> list[Prompt]:
    """Every prompt with `images` before its text (a text prompt as `generate --image` builds it, random ids after
    the images' placeholder runs), keyed apart so every request runs them through the tower."""
    from dgcli.runtime.vision import engine_images, image_ids, prompt_ids

    marks = image_ids(session)
    spare = next(t for t in range(session.config.vocab_size) if t not in marks and t not in set(session.stop_ids))
    runs = [t for x in images for t in (marks[0], *[marks[1]] * x.soft_tokens, marks[2])]
    out = []
    for i, p in enumerate(prompts):
        ids = prompt_ids(session, p.text, images) if p.text is not None else runs + [
            spare if t in marks else t for t in p.ids]  # a random id that is an image mark would be a stray span
        out.append(replace(p, ids=ids, images=[(a, b, (key, i)) for a, b, key in engine_images(images)]))
    return out
