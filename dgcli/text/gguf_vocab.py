"""The tokenizer of a GGUF file: `tokenizer.ggml.*` (model `gemma4`) <-> a `tokenizers.Tokenizer` built as the
checkpoint's tokenizer.json is, plus `tokenizer.chat_template`.

Owns: the GGUF tokenizer keys both ways (`vocab_metadata` writes, `tokenizer_from_gguf` reads) and which GGUF tokens
become special added tokens: CONTROL, USER_DEFINED, UNKNOWN, and Gemma's `<unused_N>` placeholders (llama.cpp's
converter types them NORMAL, yet tokenizer.json matches them whole). Must not: import torch or read files.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dgcli.errors import UserError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf's TokenType
# Tokens llama.cpp's Gemma-4 converter types USER_DEFINED so that they are rendered (its chat parser reads them).
VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
SPACE = "\u2581"
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_PLACEHOLDER = re.compile(r"<unused_\d+>")
TOKENIZER_MODEL = "gemma4"


def vocab_metadata(tok: Any, chat_template: str | None) -> dict[str, Any]:
    """GGUF metadata for a checkpoint's `tokenizers.Tokenizer` (and its chat template)."""
    import numpy as np

    data = json.loads(tok.to_str())
    model = data["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise UserError("the checkpoint's tokenizer.json is not a byte-fallback BPE (Gemma-4's); dgemma writes "
                        "only that tokenizer into GGUF files")
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    if any(t is None for t in tokens):
        raise UserError("the checkpoint's tokenizer has gaps in its ids; GGUF needs one token per id")
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    unk = model.get("unk_token")
    types = [BYTE if _BYTE.fullmatch(t) else USER_DEFINED if t in VISIBLE else CONTROL if t in special or t == unk
             else NORMAL for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    ids = {name: tok.token_to_id(t) for name, t in (("bos", "<bos>"), ("eos", "<eos>"), ("unknown", unk or "<unk>"),
                                                      ("padding", "<pad>"), ("mask", "<mask>"), ("eot", "<turn|>"))}
    md: dict[str, Any] = {
        "tokenizer.ggml.model": TOKENIZER_MODEL,
        "tokenizer.ggml.tokens": tokens,
        # numpy arrays carry the GGUF element types: f32 scores (what llama.cpp's converter writes; BPE does not
        # use them), i32 token types
        "tokenizer.ggml.scores": np.full(len(tokens), -1000.0, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.merges": merges,
    }
    md.update({f"tokenizer.ggml.{name}_token_id": i for name, i in ids.items() if i is not None})
    md["tokenizer.ggml.add_space_prefix"] = False
    md["tokenizer.ggml.add_bos_token"] = True
    if chat_template:
        md["tokenizer.chat_template"] = chat_template
    return md


def _split_merge(m: str, vocab: dict[str, int]) -> list[str]:
    # "a b": the space that splits the pair into two vocabulary tokens whose join is one (a token may hold a space).
    for i in (j for j, c in enumerate(m) if c == " "):
        a, b = m[:i], m[i + 1:]
        if m.count(" ") == 1 or (a in vocab and b in vocab and a + b in vocab):
            return [a, b]
    a, _, b = m.partition(" ")
    return [a, b]


def tokenizer_json(md: dict[str, Any], source: str) -> dict:
    """The tokenizer.json object of a GGUF file's tokenizer keys."""
    kind = md.get("tokenizer.ggml.model")
    if kind != TOKENIZER_MODEL:
        raise UserError(f"{source}: tokenizer.ggml.model is {kind!r}; dgemma reads the Gemma-4 tokenizer "
                        f"({TOKENIZER_MODEL!r}) of DiffusionGemma files")
    tokens = md.get("tokenizer.ggml.tokens")
    merges = md.get("tokenizer.ggml.merges") or []  # gguf's writer leaves an empty list out
    if not tokens:
        raise UserError(f"{source}: the file has no tokenizer.ggml.tokens; convert it with its tokenizer")
    types = md.get("tokenizer.ggml.token_type")
    types = [NORMAL] * len(tokens) if types is None else [int(t) for t in types]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    bos_id = int(md.get("tokenizer.ggml.bos_token_id", 2))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True}
             for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (CONTROL, USER_DEFINED, UNKNOWN) or _PLACEHOLDER.fullmatch(t)]
    bos = tokens[bos_id]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": False},
            {"type": "Split", "pattern": {"String": SPACE}, "behavior": "MergedWithNext", "invert": False}]},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                                     {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[int(unk_id)] if unk_id is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": [_split_merge(m, vocab) for m in merges]},
    }


def tokenizer_from_gguf(md: dict[str, Any], source: str):
    """A `ChatTokenizer` from a GGUF file's metadata (its tokenizer and chat template)."""
    from tokenizers import Tokenizer

    from dgcli.text.tokenizer import ChatTokenizer

    try:
        tok = Tokenizer.from_str(json.dumps(tokenizer_json(md, source)))
    except UserError:
        raise
    except Exception as e:  # tokenizers raises bare Exceptions
        raise UserError(f"{source}: its tokenizer keys do not make a tokenizer ({e}); re-convert the file") from None
    return ChatTokenizer(tok, md.get("tokenizer.chat_template"), source=source)
