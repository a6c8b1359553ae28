"""The bundled model's data recipe: task answers are right, the split holds, blocks end as documented."""

import json
import random
from pathlib import Path

import pytest

from dgcli.train import tasks
PROMPTS = Path(tasks.__file__).resolve().parents[1] / "data" / "prompts" / "heldout.jsonl"


@pytest.mark.parametrize("family", tasks.FAMILIES + tasks.EXTRA_FAMILIES)
def test_answers_are_correct_for_their_prompts(family):
    rng = random.Random(0)
    for _ in range(200):
        ex = tasks.MAKERS[family](rng)
        body = ex.prompt.split(":", 1)[1].split() if family != "count" else None
        if family in ("reverse", "reverse_long"):
            assert ex.answer.split() == body[::-1]
            assert (3 <= len(body) <= 8) if family == "reverse" else (17 <= len(body) <= 32)
        elif family == "sort":
            assert ex.answer.split() == sorted(body)
        else:
            words = ex.prompt.rstrip(".").split()
            a, b = int(words[2]), int(words[4])
            assert ex.answer.split() == [str(i) for i in range(a, b + 1)]
            assert 8 <= b - a + 1 <= 40 and b <= 99


def test_training_stream_never_yields_a_heldout_prompt():
    weights = {"reverse": 1, "sort": 1, "count": 1, "text": 1}
    verses = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light."]
    stream = tasks.training_stream(0, weights, verses)
    seen = [next(stream) for _ in range(3000)]
    assert not any(tasks.is_heldout(ex.prompt) for ex in seen)
    assert {ex.family for ex in seen} == set(weights)


def test_heldout_rule_reserves_about_ten_percent():
    rng = random.Random(1)
    prompts = {tasks.make_reverse(rng).prompt for _ in range(5000)}
    share = sum(map(tasks.is_heldout, prompts)) / len(prompts)
    assert 0.07 < share < 0.13


def test_heldout_set_is_deterministic_distinct_and_heldout():
    a = tasks.heldout_set(5, per_family=10)
    b = tasks.heldout_set(5, per_family=10)
    n = 10 * len(tasks.FAMILIES)
    assert a == b and len(a) == n and len({e.prompt for e in a}) == n
    assert all(tasks.is_heldout(e.prompt) for e in a)


def test_answer_blocks_end_with_turn_end_then_pad():
    blocks = tasks.answer_blocks([7] * 20, canvas=16, turn_end_id=106, pad_id=0)
    assert [len(b) for b in blocks] == [16, 16]
    assert blocks[1][:5] == [7, 7, 7, 7, 106] and blocks[1][5:] == [0] * 11
    # An answer of exactly C-1 ids: <turn|> is the canvas's last id, and no empty block follows.
    assert tasks.answer_blocks([5] * 15, 16, 106, 0) == [[5] * 15 + [106]]


def test_multi_block_families_span_several_canvases():
    from dgcli.text.build import build_tokenizer

    rng = random.Random(2)
    corpus = tasks.tokenizer_corpus(0, 3000, ["And God said"])
    tok = build_tokenizer(corpus, 512)

    def lengths(maker):  # answer ids + <turn|>
        return [len(tok.encode(maker(rng).answer, add_special_tokens=False).ids) + 1 for _ in range(300)]

    count = lengths(tasks.MAKERS[tasks.MULTI_BLOCK_FAMILY])
    assert min(count) <= 16 < 2 * 16 < max(count)  # count answers take 1 to 3 canvases
    long = lengths(tasks.make_reverse_long)
    assert min(long) > 16 and max(long) > 2 * 16  # always 2 canvases of 16, sometimes 3


def test_bundled_prompt_file_format():
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    fams = {r["family"] for r in rows}
    assert set(tasks.FAMILIES) <= fams and tasks.TEXT_FAMILY in fams
    for r in rows:
        assert isinstance(r["prompt"], str) and tasks.is_heldout(r["prompt"])
        assert (r["answer"] is None) == (r["family"] == tasks.TEXT_FAMILY)
    assert tasks.read_prompt_file(PROMPTS)[0].prompt == rows[0]["prompt"]


def test_check_answer_is_exact_after_strip():
    assert tasks.check_answer(" 1 2 3\n", "1 2 3")
    assert not tasks.check_answer("1 2 3 4", "1 2 3")
