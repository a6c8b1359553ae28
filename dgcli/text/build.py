"""Builds a small Gemma-4-style BPE tokenizer (random checkpoints and training) and writes it as checkpoint files.

Owns: a byte-fallback BPE whose specials sit at their real Gemma-4 ids (spec §8.1) and that never merges across
a special token (`crosses_special`, enforced by `retire_cross_special`), and its tokenizer.json,
tokenizer_config.json and chat_template.jinja. Must not: know about models or torch, or be needed at run time.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Real Gemma-4 ids (spec §8.1); every other id below RESERVED_END becomes an <unused_N> placeholder
# so that these line up exactly with the real checkpoint's tokenizer.
GEMMA4_SPECIAL_IDS: dict[int, str] = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>",
    49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>",
    100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>"}
# Names the real Gemma-4 tokenizer_config.json gives its control tokens (transformers 5 exposes them
# as tokenizer attributes and counts them as special).
GEMMA4_NAMED_TOKENS: dict[str, str] = {
    "sot_token": "<|turn>", "eot_token": "<turn|>", "soc_token": "<|channel>", "eoc_token": "<channel|>",
    "think_token": "<|think|>", "escape_token": '<|"|>', "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>", "stc_token": "<|tool_call>", "etc_token": "<tool_call|>",
    "std_token": "<|tool>", "etd_token": "<tool|>",
}
RESERVED_END = 107  # ids [0, 107) are special or placeholder tokens
NEWLINE_ID = 107  # "\n" is 107 in Gemma-4 too; the chat template emits it after every role
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
FIRST_LEARNED_ID = NEWLINE_ID + 1 + len(BYTE_TOKENS)  # 364
MIN_VOCAB_SIZE = FIRST_LEARNED_ID + 16  # room for at least a small alphabet

SPACE = "\u2581"  # "▁", SentencePiece's visible space


def reserved_tokens() -> list[str]:
    """Token strings for ids 0..106: the Gemma-4 specials, `<unused_N>` in the gaps."""
    return [GEMMA4_SPECIAL_IDS.get(i, f"<unused_{i}>") for i in range(RESERVED_END)]


def crosses_special(token: str, specials: Iterable[str] | None = None) -> bool:
    """True if multi-character `token` holds a piece of a special token that reaches the special's
    start or end: the whole special, or a token ending in its opening / starting with its closing
    characters (`<|`, `<|turn>user`, `|>`, `>th`). Tokenizers split specials out first, so such a
    token can never come from a special and only misleads tools that do not split them (llama.cpp)."""
    if len(token) < 2:
        return False
    specials = tuple(reserved_tokens() if specials is None else specials)
    heads, tails = _edges(specials)
    ends = range(1, len(token) + 1)
    return (any(token[-j:] in heads for j in ends) or any(token[:j] in tails for j in ends)
            or any(s in token for s in specials))


@functools.lru_cache(maxsize=8)
def _edges(specials: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    # Proper prefixes and suffixes of the specials: the pieces a token could share across an edge.
    heads = frozenset(s[:k] for s in specials for k in range(1, len(s)))
    tails = frozenset(s[-k:] for s in specials for k in range(1, len(s)))
    return heads, tails


def retire_cross_special(tok: Tokenizer, first_learned: int = FIRST_LEARNED_ID) -> tuple[Tokenizer, list[int]]:
    """`tok` without learned tokens that cross a special (`crosses_special`) and the merges that make
    or use them; each such token becomes a special `<unused_ID>` at the same id, so every other id,
    and a model trained on `tok`, stays valid. Returns (new tokenizer, retired ids)."""
    data = json.loads(tok.to_str())
    model = data["model"]
    specials = [t["content"] for t in data["added_tokens"] if t["special"]]
    retired = sorted(i for t, i in model["vocab"].items() if i >= first_learned and crosses_special(t, specials))
    if not retired:
        return tok, []
    inv = {i: t for t, i in model["vocab"].items()}
    placeholders = {inv[i]: f"<unused_{i}>" for i in retired}
    model["merges"] = [m for m in model["merges"] if not any(p in placeholders for p in (m[0], m[1], m[0] + m[1]))
                       and not crosses_special(m[0] + m[1], specials)]
    model["vocab"] = {placeholders.get(t, t): i for t, i in model["vocab"].items()}
    out = Tokenizer.from_str(json.dumps(data))
    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in placeholders.values()])
    return out, retired


def _without_specials(texts: Iterable[str], specials: list[str]) -> Iterator[str]:
    # The BPE trainer does not split added tokens out of its input (tokenizers 0.23 even learns merges
    # inside them), so cut them out here: training then sees the same pieces that encoding does.
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    for text in texts:
        yield from (piece for piece in pattern.split(text) if piece)


def _gemma_pipeline(tok: Tokenizer) -> None:
    """Attach the Gemma normaliser / pre-tokeniser / decoder (spec §8.1) to `tok`."""
    tok.normalizer = normalizers.Replace(" ", SPACE)
    # Normalisation runs first, so words are split at "▁"; merged_with_next keeps "▁word" pieces
    # (SentencePiece style), so no merge spans a word boundary. Newline runs stand alone so the
    # template's "role\n" always gives the "\n" token, as in the spec's worked example.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
                                                 pre_tokenizers.Split(SPACE, behavior="merged_with_next")])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a Gemma-4-style byte-fallback BPE of exactly `vocab_size` tokens on `texts`: ids 0..106 reserved
    (specials, `<unused_N>` between), 107 = "\\n", 108..363 = `<0x00>`..`<0xFF>`, then learned tokens, the tail
    padded with special `<unused_N>` when the corpus is too small (the model's embedding rows must match)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (specials + bytes), got {vocab_size}")
    reserved = reserved_tokens()

    # 1. Learn merges. The trainer's own vocab is reserved + alphabet + merges; the 256 byte
    # tokens are added afterwards, so its budget excludes them.
    trainer_budget = vocab_size - len(BYTE_TOKENS)
    scratch = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    _gemma_pipeline(scratch)
    # Rare characters beyond limit_alphabet fall back to bytes instead of overflowing the budget.
    trainer = BpeTrainer(vocab_size=trainer_budget, special_tokens=reserved, initial_alphabet=["\n"],
                         limit_alphabet=trainer_budget - RESERVED_END, show_progress=False)
    scratch.train_from_iterator(_without_specials(texts, reserved), trainer=trainer)
    trained = json.loads(scratch.to_str())["model"]
    learned = [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    # 2. Lay the final vocabulary out at fixed ids.
    fixed = reserved + ["\n"] + BYTE_TOKENS
    taken = set(fixed)
    ordered = fixed + [t for t in learned if t not in taken]
    assert len(ordered) <= vocab_size, "trainer budget arithmetic is wrong"
    pad_tokens = [f"<unused_{i}>" for i in range(len(ordered), vocab_size)]
    vocab = {t: i for i, t in enumerate(ordered + pad_tokens)}

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    _gemma_pipeline(tok)
    # Every reserved and padding token is an added special token: matched whole in text, skipped
    # when decoding with skip_special_tokens. All already have vocab ids, so those ids are kept.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved + pad_tokens])
    bos = GEMMA4_SPECIAL_IDS[2]
    # add_bos_token = true: encode(..., add_special_tokens=True) prepends <bos>, as Gemma does.
    tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                       special_tokens=[(bos, 2)])
    # Specials were cut out of the training text, so this finds nothing unless the corpus itself
    # spells a fragment next to a special's edge (e.g. a literal "|>"); it keeps the guarantee anyway.
    return retire_cross_special(tok)[0]


def tokenizer_config(tok: Tokenizer) -> dict:
    """`tokenizer_config.json` for `tok`: the real Gemma-4 keys (named control tokens), the control
    tokens again as `extra_special_tokens`, and `added_tokens_decoder` for every added token, so
    transformers and converters that read only this file (llama.cpp) see them as special."""
    added = tok.get_added_tokens_decoder()
    control = [t for t in GEMMA4_NAMED_TOKENS.values() if tok.token_to_id(t) is not None]
    return {"tokenizer_class": "GemmaTokenizer", "backend": "tokenizers", "bos_token": GEMMA4_SPECIAL_IDS[2],
            "eos_token": GEMMA4_SPECIAL_IDS[1], "pad_token": GEMMA4_SPECIAL_IDS[0], "unk_token": GEMMA4_SPECIAL_IDS[3],
            "mask_token": GEMMA4_SPECIAL_IDS[4], **{name: t for name, t in GEMMA4_NAMED_TOKENS.items() if t in control},
            "extra_special_tokens": control, "add_bos_token": True, "add_eos_token": False, "padding_side": "left",
            "added_tokens_decoder": {
                str(i): {"content": a.content, "lstrip": a.lstrip, "normalized": a.normalized, "rstrip": a.rstrip,
                         "single_word": a.single_word, "special": a.special} for i, a in sorted(added.items())}}


def write_tokenizer_files(tok: Tokenizer, out_dir: str | Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n", encoding="utf-8")
    template = resources.files("dgcli") / "data" / "chat_template.jinja"  # the project's Gemma-4-semantics one
    (out / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
