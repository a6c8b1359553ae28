"""The bundled checkpoint (dgcli/data/tiny) in the released layout, as outside tools read it.

Chat prompts give the same ids through dgemma, the bare `tokenizers` library and transformers'
AutoTokenizer (thinking on and off); no learned token or merge crosses a special token (a tool that
does not split specials first, like llama.cpp, would otherwise get other ids); tokenizer_config.json
names the control tokens as special; config.json has rope_parameters for both layer types.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import dgcli
from dgcli.text.build import FIRST_LEARNED_ID, crosses_special
from dgcli.text.tokenizer import load_tokenizer

BUNDLED = Path(dgcli.__file__).parent / "data" / "tiny"
# Spec §8.1 ids of the chat control tokens, written out on purpose.
CONTROL = {"<|turn>": 105, "<turn|>": 106, "<|channel>": 100, "<channel|>": 101, "<|think|>": 98,
           "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48, "<tool_call|>": 49,
           "<|tool_response>": 50, "<tool_response|>": 51, '<|"|>': 52}
CHATS = [
    [{"role": "user", "content": "Reverse: c a t"}],
    [{"role": "user", "content": "Count from 7 to 31."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: 7 2 9 2"}],
    [{"role": "user", "content": "Continue: And God said"},
     {"role": "assistant", "content": "<|channel>thought\nverse<channel|>Let there be light"},
     {"role": "user", "content": "Reverse: a b"}],
    [{"role": "user", "content": "x|>y <channel a<b héllo 🙂"}],  # literal fragments: split, never merged
]


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED)


@pytest.fixture(scope="module")
def auto():
    transformers = pytest.importorskip("transformers")  # the test extra
    return transformers.AutoTokenizer.from_pretrained(str(BUNDLED))


def dgemma_ids(tok, chat: list[dict], thinking: bool) -> list[int]:
    if len(chat) == 1:  # generate's path: one user turn
        return tok.encode_prompt(chat[0]["content"], thinking=thinking)
    return tok.encode_prompt(tok.chat_text(chat, thinking=thinking), raw=True)  # the server's path


@pytest.mark.parametrize("thinking", [False, True])
def test_tokenizers_library_gives_dgemma_ids(tok, raw, thinking):
    for chat in CHATS:
        rendered = tok.render_chat(chat, thinking=thinking)
        assert raw.encode(rendered, add_special_tokens=False).ids == dgemma_ids(tok, chat, thinking)


@pytest.mark.parametrize("thinking", [False, True])
def test_transformers_auto_tokenizer_gives_dgemma_ids(tok, auto, thinking):
    for chat in CHATS:
        ids = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                       enable_thinking=thinking)["input_ids"]
        assert ids == dgemma_ids(tok, chat, thinking)
    assert set(CONTROL) <= set(auto.all_special_tokens)
    assert all(auto.added_tokens_decoder[i].special for i in CONTROL.values())


def test_prompt_ids_match_spec_shape(tok):
    ids = tok.encode_prompt("Reverse: c a t")
    user, model, thought = (tok.encode_text(w) for w in ("user", "model", "thought"))
    assert ids[:2] == [2, 105] and ids[2:2 + len(user)] == user
    assert ids[-(len(model) + len(thought) + 5):] == [105, *model, 107, 100, *thought, 107, 101]


def test_no_learned_token_or_merge_crosses_a_special(raw):
    data = json.loads(raw.to_str())
    specials = [t["content"] for t in data["added_tokens"] if t["special"]]
    for token, i in data["model"]["vocab"].items():
        if i >= FIRST_LEARNED_ID and token not in specials:
            assert not crosses_special(token, specials), (i, token)
            assert "<|" not in token and "|>" not in token, (i, token)
    for a, b in data["model"]["merges"]:
        assert not any(crosses_special(t, specials) for t in (a, b, a + b)), (a, b)
    # The retired cross-special tokens stay as placeholders at their ids, so the weights still fit.
    assert raw.get_vocab_size() == 1024 and raw.id_to_token(470) == "<unused_470>"
    assert raw.encode("<|turn>user", add_special_tokens=False).ids[0] == 105


def test_tokenizer_config_lists_control_tokens_as_special():
    cfg = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    decoder = cfg["added_tokens_decoder"]
    for token, i in CONTROL.items():
        assert decoder[str(i)]["content"] == token and decoder[str(i)]["special"] is True
    for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]):
        assert decoder[str(i)] == {"content": token, "lstrip": False, "normalized": False,
                                   "rstrip": False, "single_word": False, "special": True}
    assert set(CONTROL) == set(cfg["extra_special_tokens"])
    # Gemma-4's own names for them (google/gemma-4 tokenizer_config.json).
    assert (cfg["sot_token"], cfg["eot_token"], cfg["soc_token"], cfg["eoc_token"], cfg["think_token"]) == (
        "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>")


def test_config_has_released_rope_parameters():
    from dgcli.checkpoint.load import load_config

    text = json.loads((BUNDLED / "config.json").read_text())["text_config"]
    assert text["rope_parameters"] == {  # spec §1.2, the values the bundled model was trained with
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }
    cfg = load_config(BUNDLED)
    assert (cfg.rope_sliding.theta, cfg.rope_sliding.rotary_pairs) == (10000.0, cfg.head_dim // 2)
    assert (cfg.rope_full.theta, cfg.rope_full.rotary_pairs) == (1e6, int(0.25 * cfg.global_head_dim) // 2)
