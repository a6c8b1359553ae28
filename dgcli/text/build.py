"""Builds a small Gemma-4-style BPE tokenizer and writes it as checkpoint files.

Owns: training a byte-fallback BPE with the `tokenizers` library whose special tokens sit at their
real Gemma-4 ids (spec §8.1), and writing `tokenizer.json`, `tokenizer_config.json` and
`chat_template.jinja` into a checkpoint directory. Used by the random-checkpoint writer and the
tiny-model training script. Must not: know about models or torch, or be needed at inference time
(the runtime reads the files through `dgcli.text.tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Real Gemma-4 ids (spec §8.1); every other id below RESERVED_END becomes an <unused_N> placeholder
# so that these line up exactly with the real checkpoint's tokenizer.
GEMMA4_SPECIAL_IDS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
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


def _gemma_pipeline(tok: Tokenizer) -> None:
    """Attach the Gemma normaliser / pre-tokeniser / decoder (spec §8.1) to `tok`."""
    tok.normalizer = normalizers.Replace(" ", SPACE)
    # Normalisation runs first, so words are split at "▁"; merged_with_next keeps "▁word" pieces
    # (SentencePiece style), so no merge spans a word boundary. Newline runs stand alone so the
    # template's "role\n" always gives the "\n" token, as in the spec's worked example.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
            pre_tokenizers.Split(SPACE, behavior="merged_with_next"),
        ]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a Gemma-4-style byte-fallback BPE of exactly `vocab_size` tokens on `texts`.

    Layout: ids 0..106 reserved (Gemma-4 specials at their real ids, `<unused_N>` between),
    107 = "\\n", 108..363 = byte-fallback tokens `<0x00>`..`<0xFF>`, then learned tokens; if the
    corpus is too small to learn that many, the tail is padded with special `<unused_N>` tokens
    so that `get_vocab_size() == vocab_size` matches the model's embedding rows.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (specials + bytes), got {vocab_size}")
    reserved = reserved_tokens()

    # 1. Learn merges. The trainer's own vocab is reserved + alphabet + merges; the 256 byte
    # tokens are added afterwards, so its budget excludes them.
    trainer_budget = vocab_size - len(BYTE_TOKENS)
    scratch = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    _gemma_pipeline(scratch)
    trainer = BpeTrainer(
        vocab_size=trainer_budget,
        special_tokens=reserved,
        initial_alphabet=["\n"],
        # Rare characters beyond this fall back to bytes instead of overflowing the budget.
        limit_alphabet=trainer_budget - RESERVED_END,
        show_progress=False,
    )
    scratch.train_from_iterator(texts, trainer=trainer)
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
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in reserved + pad_tokens]
    )
    bos = GEMMA4_SPECIAL_IDS[2]
    # add_bos_token = true: encode(..., add_special_tokens=True) prepends <bos>, as Gemma does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, 2)]
    )
    return tok


def bundled_chat_template() -> str:
    """The project's Gemma-4-semantics chat template (`dgcli/data/chat_template.jinja`)."""
    path = resources.files("dgcli").joinpath("data").joinpath("chat_template.jinja")
    return path.read_text(encoding="utf-8")


def write_tokenizer_files(tok: Tokenizer, out_dir: str | Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        # Same keys as the real checkpoint's tokenizer_config.json, so transformers loads it too.
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": GEMMA4_SPECIAL_IDS[2],
        "eos_token": GEMMA4_SPECIAL_IDS[1],
        "pad_token": GEMMA4_SPECIAL_IDS[0],
        "unk_token": GEMMA4_SPECIAL_IDS[3],
        "mask_token": GEMMA4_SPECIAL_IDS[4],
        "add_bos_token": True,
        "add_eos_token": False,
        "padding_side": "left",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(bundled_chat_template(), encoding="utf-8")
