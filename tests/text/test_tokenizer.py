"""Tests for dgcli.text.tokenizer (runtime) and dgcli.text.build (Gemma-4-style builder).

Ids and strings expected here come from spec §8 written out literally, not from the module's
own tables, so a wrong table fails.
"""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from dgcli.errors import UserError
from dgcli.text.tokenizer import ChatTokenizer, load_tokenizer
from dgcli.text.build import (
    FIRST_LEARNED_ID, build_tokenizer, crosses_special, retire_cross_special, write_tokenizer_files,
)

VOCAB = 600
CORPUS = [
    "Why is the sky blue? The sky is blue because air scatters blue light more than red light.",
    "The quick brown fox jumps over the lazy dog.\nThe dog sleeps; the fox runs away.",
    "user: what is two plus two?\nmodel: two plus two is four.\n\nThe answer is four.",
    "A thought is an idea. I think, therefore I am. Questions and answers, again and again.",
] * 20

# Spec §8.1 ids, written out here on purpose.
REAL_IDS = {
    "<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|tool>": 46, "<tool|>": 47,
    "<|tool_call>": 48, "<tool_call|>": 49, "<|tool_response>": 50, "<tool_response|>": 51,
    '<|"|>': 52, "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106,
}


@pytest.fixture(scope="module")
def built() -> Tokenizer:
    return build_tokenizer(CORPUS, VOCAB)


@pytest.fixture(scope="module")
def ckpt(built, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    write_tokenizer_files(built, out)
    return out


@pytest.fixture(scope="module")
def tok(ckpt) -> ChatTokenizer:
    return load_tokenizer(ckpt)


def enc(tok: ChatTokenizer, text: str) -> list[int]:
    ids = tok.encode_text(text)
    assert ids, f"{text!r} encoded to nothing"
    return ids


# ------------------------------------------------------------------ builder layout
def test_special_tokens_sit_at_real_gemma4_ids(built):
    for token, token_id in REAL_IDS.items():
        assert built.token_to_id(token) == token_id, token
    for i in range(107):
        if i not in REAL_IDS.values():
            assert built.id_to_token(i) == f"<unused_{i}>"
    assert built.token_to_id("\n") == 107
    byte_ids = [built.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    assert None not in byte_ids and min(byte_ids) >= 107
    assert built.get_vocab_size() == VOCAB


def test_chat_tokenizer_exposes_ids_by_name(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert (tok.turn_start_id, tok.turn_end_id) == (105, 106)
    assert (tok.channel_start_id, tok.channel_end_id, tok.think_id) == (100, 101, 98)
    assert tok.bos_token == "<bos>" and set(tok.stop_ids) == {1, 106}


def test_ids_are_looked_up_not_hard_coded():
    # A vocabulary with the same names at different ids: the ids must follow the vocab.
    names = ["<unk>", "<eos>", "<pad>", "<|turn>", "<bos>", "<turn|>"]
    names += ["<|channel>", "<channel|>", "<|think|>"]
    vocab = {n: i + 10 for i, n in enumerate(names)} | {"hello": 3}
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    raw.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    t = ChatTokenizer(raw, "{{ bos_token }}[{{ messages[0]['content'] }}]")
    assert (t.eos_id, t.pad_id, t.bos_id, t.turn_end_id) == (11, 12, 14, 15)
    assert t.encode_prompt("hello", raw=True) == [14, 3]


def test_missing_special_token_is_a_user_error():
    names = ["<unk>", "<pad>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]
    raw = Tokenizer(WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    with pytest.raises(UserError, match="<eos>"):
        ChatTokenizer(raw, None)


def test_build_is_fast_and_deterministic():
    import time

    t0 = time.perf_counter()
    a = build_tokenizer(CORPUS * 3, VOCAB)  # ~25 KB of text
    assert time.perf_counter() - t0 < 3.0
    assert a.to_str() == build_tokenizer(CORPUS * 3, VOCAB).to_str()
    with pytest.raises(ValueError):
        build_tokenizer(CORPUS, 200)


def _learned_and_merges(t: Tokenizer) -> tuple[dict[str, int], list[list[str]], list[str]]:
    data = json.loads(t.to_str())
    specials = [a["content"] for a in data["added_tokens"] if a["special"]]
    learned = {k: i for k, i in data["model"]["vocab"].items() if i >= FIRST_LEARNED_ID and k not in specials}
    return learned, data["model"]["merges"], specials


def test_crosses_special_rule():
    for token in ["<|", "<|turn", "<|turn>user", "<channel", ">th", "|>", ">thought", "t<turn|>", "a<"]:
        assert crosses_special(token), token
    for token in ["<", "|", "turn", "user", "channel", "thought", "a<z", "x>y", "x|y", "▁the"]:
        assert not crosses_special(token), token


def test_build_never_merges_across_specials():
    # Chat-templated texts, as the tiny model's corpus has them: specials glued to words on both sides.
    chats = []
    for i, q in enumerate(["Reverse: c a t", "Sort: 7 2 9 2", "Count from 7 to 31.", "Why is the sky blue?"]):
        think = "<|turn>system\n<|think|><turn|>\n" if i % 2 else ""
        chats.append(f"<bos>{think}<|turn>user\n{q}<turn|>\n<|turn>model\n<|channel>thought\n<channel|>ok<turn|>")
    t = build_tokenizer((chats + ["<|turn>user\n", "<|tool_call>call:f{}<tool_call|>"]) * 50 + CORPUS, VOCAB)
    learned, merges, specials = _learned_and_merges(t)
    assert learned and merges
    for token in learned:
        assert not crosses_special(token, specials) and "<|" not in token and "|>" not in token, token
    for a, b in merges:
        assert not any(crosses_special(x, specials) for x in (a, b, a + b)), (a, b)
    # Nothing had to be retired: the trainer never saw the specials (placeholders only in the tail).
    tail = sorted(i for k, i in t.get_vocab().items() if i >= FIRST_LEARNED_ID and k.startswith("<unused_"))
    assert tail == list(range(VOCAB - len(tail), VOCAB))
    assert t.encode("<|turn>user\nhi", add_special_tokens=False).ids[:1] == [105]


def test_retire_cross_special_keeps_every_other_id():
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<|turn>", "a", "b", "<", "|", "ab", "<|"])}
    merges = [("a", "b"), ("<", "|")]
    from tokenizers.models import BPE

    raw = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<unk>", "<|turn>")])
    new, retired = retire_cross_special(raw, first_learned=3)  # this toy vocab learns from id 3
    assert retired == [8] and new.id_to_token(8) == "<unused_8>"
    assert {k: i for k, i in new.get_vocab().items() if i != 8} == {k: i for k, i in vocab.items() if i != 8}
    assert new.encode("ab<|x").tokens[:3] == ["ab", "<", "|"]


# ------------------------------------------------------------------ text round trips
@pytest.mark.parametrize(
    "text",
    ["The quick brown fox.", "  two  spaces and\ttab\nnewline", "héllo wörld — 日本語 🙂 €5"],
)
def test_round_trip(tok, text):
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text


def test_non_ascii_uses_byte_fallback(tok):
    ids = tok.encode_text("日本")
    pieces = [tok.tokenizer.id_to_token(i) for i in ids]
    assert len(pieces) == 6 and all(p.startswith("<0x") for p in pieces)
    assert 3 not in ids  # never <unk>


# ------------------------------------------------------------------ chat template
def test_thinking_off_matches_worked_example_shape(tok):
    ids = tok.encode_prompt("Why is the sky blue?")
    expected = (
        [2, 105] + enc(tok, "user") + [107] + enc(tok, "Why is the sky blue?") + [106, 107]
        + [105] + enc(tok, "model") + [107] + [100] + enc(tok, "thought") + [107, 101]
    )
    assert ids == expected
    assert tok.decode(ids, skip_special=False) == (
        "<bos><|turn>user\nWhy is the sky blue?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_thinking_on_adds_system_think_and_no_prefilled_channel(tok):
    ids = tok.encode_prompt("Why is the sky blue?", thinking=True)
    head = [2, 105] + enc(tok, "system") + [107, 98, 106, 107]
    tail = [105] + enc(tok, "model") + [107]
    assert ids[: len(head)] == head and ids[-len(tail):] == tail
    assert 100 not in ids and 101 not in ids


def test_system_prompt_without_thinking(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat(msgs)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )
    assert tok.encode_prompt(tok.chat_text(msgs), raw=True) == tok.encode_text(text)  # the server's path: one <bos>


def test_past_model_turn_is_model_role_without_thoughts(tok):
    msgs = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<|channel>thought\nsecret plan<channel|>A1"},
        {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
    ]
    text = tok.render_chat(msgs, add_generation_prompt=False)
    assert text == "<bos><|turn>user\nQ1<turn|>\n<|turn>model\nA1<turn|>\n<|turn>user\nQ2<turn|>\n"


def test_exactly_one_bos(tok):
    for ids in (
        tok.encode_prompt("hello", raw=True),
        tok.encode_prompt("<bos>hello", raw=True),
        tok.encode_prompt("hello"),
        tok.encode_prompt("hello", thinking=True),
    ):
        assert ids[0] == 2 and ids.count(2) == 1
    assert tok.encode_prompt("hello", raw=True) == [2] + enc(tok, "hello")
    # A template that forgets bos_token still yields one BOS.
    no_bos = ChatTokenizer(tok.tokenizer, "{{ messages[0]['content'] }}")
    assert no_bos.encode_prompt("hello") == [2] + enc(tok, "hello")


def test_raise_exception_helper(tok):
    t = ChatTokenizer(tok.tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(UserError, match="roles must alternate"):
        t.encode_prompt("hi")


def test_no_template_is_a_user_error(tok):
    with pytest.raises(UserError, match="^tokenizer has no chat template.*--raw"):
        ChatTokenizer(tok.tokenizer, None).encode_prompt("hi")
    assert ChatTokenizer(tok.tokenizer, None).encode_prompt("hi", raw=True)[0] == 2


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch {m}') }}",
        "{{ cycler.__init__.__globals__.os.system('touch {m}') }}",
        "{{ lipsum.__globals__['os'].popen('touch {m}').read() }}",
        "{{ '{0.__class__.__mro__}'.format(1) }}",
        "{{ messages.append(1) }}",
    ],
)
def test_malicious_template_is_refused_and_runs_nothing(tok, tmp_path, template):
    marker = tmp_path / "pwned"
    t = ChatTokenizer(tok.tokenizer, template.replace("{m}", str(marker)), source="evil-ckpt")
    with pytest.raises(UserError, match="chat template of evil-ckpt"):
        t.render_chat([{"role": "user", "content": "hi"}])
    assert not marker.exists()


# ------------------------------------------------------------------ loading
def test_template_fallback_to_tokenizer_config(ckpt, tmp_path):
    shutil.copy(ckpt / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    plain = cfg | {"chat_template": "S:{{ messages[0]['content'] }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(plain))
    assert load_tokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "S:x"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D:{{ bos_token }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": named}))
    assert load_tokenizer(tmp_path).render_chat([]) == "D:<bos>"
    # chat_template.jinja wins over the config.
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_tokenizer(tmp_path).render_chat([]) == "J"


def test_missing_tokenizer_names_the_file(tmp_path):
    with pytest.raises(UserError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_is_a_user_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_written_files(ckpt):
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    got = (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["add_bos_token"])
    assert got == ("<bos>", "<eos>", "<pad>", True)
    # Control tokens listed as special, as the real Gemma-4 tokenizer_config.json does.
    assert (cfg["sot_token"], cfg["eot_token"], cfg["think_token"]) == ("<|turn>", "<turn|>", "<|think|>")
    assert {"<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>"} <= set(cfg["extra_special_tokens"])
    assert cfg["added_tokens_decoder"]["105"] == {"content": "<|turn>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}
    assert "<|channel>thought" in (ckpt / "chat_template.jinja").read_text()


# ------------------------------------------------------------------ answer side
def test_answer_cuts_at_first_stop(tok):
    body = enc(tok, "Blue light scatters more.")
    assert tok.answer_text(body + [106] + enc(tok, "junk junk")) == "Blue light scatters more."
    assert tok.answer_text(body + [1, 106] + enc(tok, "junk")) == "Blue light scatters more."
    assert tok.answer_text(body) == "Blue light scatters more."
    custom = tok.answer_text(enc(tok, "four") + [0] + enc(tok, "x"), stop_ids=[0])
    assert custom == "four"


def test_answer_strips_thought_channel(tok):
    thought = [100] + enc(tok, "thought") + [107] + enc(tok, "two plus two") + [101]
    ids = thought + enc(tok, "The answer is four.") + [106, 0, 0]
    assert tok.answer_text(ids) == "The answer is four."
    shown = tok.answer_text(ids, show_thinking=True)
    assert shown == "<|channel>thought\ntwo plus two<channel|>The answer is four."
    assert tok.split_thinking(ids) == ("two plus two", "The answer is four.")


def test_unterminated_thought_is_the_answer(tok):
    ids = [100] + enc(tok, "thought") + [107] + enc(tok, "The answer is four.") + [106] + enc(tok, "x")
    assert tok.answer_text(ids) == "The answer is four."


def test_decode_and_token_strings(tok):
    ids = enc(tok, "the sky")
    assert "".join(tok.token_strings(ids)) == "the sky"
    lone_byte, ascii_byte = tok.tokenizer.token_to_id("<0xE6>"), tok.tokenizer.token_to_id("<0x41>")
    assert tok.token_strings([105, lone_byte, ascii_byte]) == ["<|turn>", "\ufffd", "A"]
    assert tok.decode(ids + [10**6]) == "the sky"  # out-of-vocab ids are dropped, not an error
    assert tok.decode([105] + ids, skip_special=False) == "<|turn>the sky"


# ------------------------------------------------------------------ transformers oracle
def test_transformers_agrees_on_ids_and_rendering(tok, ckpt):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue? 日本"},
    ]
    for thinking in (False, True):
        ours = tok.encode_prompt(tok.chat_text(msgs, thinking=thinking), raw=True)  # the server's path
        rendered = tok.render_chat(msgs, thinking=thinking)
        assert fast(rendered, add_special_tokens=False)["input_ids"] == ours
    auto = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    hf_text = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert hf_text == tok.render_chat(msgs)
    hf_think = auto.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert hf_think == tok.render_chat(msgs, thinking=True)
    assert auto("hello")["input_ids"] == tok.encode_prompt("hello", raw=True)  # add_bos_token honoured
    assert {"<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"} <= set(auto.all_special_tokens)
