"""`engine.output.Output`: one answer's text as its blocks commit, with the bundled tokenizer: append-only
deltas whose sum is the final answer, the thought channel kept out of the content (also when it spans
blocks), split UTF-8 sequences and stop-string prefixes held back, stop strings and max_tokens cuts."""

from __future__ import annotations

import random

import pytest

from dgcli.runtime.session import BUNDLED
from dgcli.engine import Output
from dgcli.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED)


def feed(out, blocks, stop_at=None):
    """Commit `blocks` (lists of ids); the last one carries a stop id at `stop_at` if given. Returns the
    deltas ((reasoning, content) per call, the finish call last)."""
    deltas = []
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        deltas.append(out.commit(block, stop_at if last else None))
        if out.finish_reason is not None:
            return deltas
    deltas.append(out.finish("length"))
    return deltas


def joined(deltas):
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def test_thought_channel_spanning_blocks_goes_to_reasoning_only(tok):
    ids = tok.encode_text("<|channel>thought\nfirst reverse it<channel|>t a c")
    out = Output(tok)
    d = feed(out, [ids[:5], ids[5:]], stop_at=len(ids) - 5)  # the stop id right after the answer
    assert d[0] == ("", "")  # the channel is still open after block 0: nothing is sent yet
    assert joined(d) == ("first reverse it", "t a c") == tok.split_thinking(ids)
    assert out.finish_reason == "stop"


def test_a_channel_never_closed_is_the_answer(tok):
    ids = tok.encode_text("<|channel>thought\nt a c")
    assert joined(feed(Output(tok), [ids[:3], ids[3:]])) == ("", tok.split_thinking(ids)[1]) == ("", "t a c")


def test_split_utf8_is_held_back_until_complete(tok):
    ids = tok.encode_text("naïve café 😀")
    for cut in range(1, len(ids)):
        d = feed(Output(tok), [ids[:cut], ids[cut:]])
        assert "\ufffd" not in d[0][1] and joined(d)[1] == "naïve café 😀", cut


def test_stop_string_across_blocks(tok):
    ids = tok.encode_text("7 8 9 10 11 12")
    for cut in range(1, len(ids)):
        out = Output(tok, stop_strings=[" 10", "zzz"])
        d = feed(out, [ids[:cut], ids[cut:]])
        assert joined(d)[1] == "7 8 9" and out.finish_reason == "stop", cut
        assert not d[0][1].endswith(" 1")  # a stop string's start is held back, never sent


def test_max_tokens_cuts_and_ends(tok):
    ids = tok.encode_text("7 8 9 10 11 12 13")
    out = Output(tok, max_tokens=4)
    d = feed(out, [ids[:3], ids[3:6], ids[6:]])
    assert len(d) == 2 and out.finish_reason == "length"  # ended at the second block: no third commit
    assert joined(d)[1] == tok.decode(ids[:4]) and out.completion_tokens == 4


def test_streamed_deltas_add_up_to_the_final_answer_on_random_ids(tok):
    rng = random.Random(0)
    specials = {tok.channel_start_id, tok.channel_end_id, *tok.stop_ids}
    pool = [i for i in range(tok.vocab_size) if i not in specials]
    for trial in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        if rng.random() < 0.5:  # a thought channel somewhere
            a = rng.randrange(len(ids))
            ids[a:a] = [tok.channel_start_id] + ids[a:a + 3] + ([tok.channel_end_id] if rng.random() < 0.7 else [])
        cuts = sorted(rng.sample(range(1, len(ids)), min(3, len(ids) - 1))) if len(ids) > 1 else []
        blocks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        out = Output(tok)
        reasoning, content = joined(feed(out, blocks))
        want_r, want_c = tok.split_thinking(ids, stop_ids=())
        assert (reasoning, content) == (want_r, want_c), (trial, ids, blocks)


def test_a_stop_id_past_the_max_tokens_cut_finishes_by_length(tok):
    """The cut comes first: "t a c" then the stop id, in one block, with max_tokens 1 (as `dgemma generate`)."""
    ids = tok.encode_text("t a c")
    for max_tokens, want in ((1, "length"), (2, "length"), (3, "stop"), (4, "stop")):
        out = Output(tok, max_tokens=max_tokens)
        d = feed(out, [ids + [tok.stop_ids[0]]], stop_at=len(ids))
        assert out.finish_reason == want and joined(d)[1] == tok.decode(ids[:max_tokens]), max_tokens
        assert out.completion_tokens == min(max_tokens, len(ids))


@pytest.mark.parametrize("stop,content,tokens", [
    ("9 10", "7 8 ", 3),  # the match starts inside " 9": its space is returned, so the token counts
    (" 9 1", "7 8", 2),   # the match ends inside " 10": neither it nor " 9" is returned
    (" 12", "7 8 9 10 11", 5), ("7", "", 0)])
def test_completion_tokens_count_the_text_returned_after_a_stop_string(tok, stop, content, tokens):
    ids = tok.encode_text("7 8 9 10 11 12 13")
    for cut in range(1, len(ids)):
        out = Output(tok, stop_strings=[stop])
        d = feed(out, [ids[:cut], ids[cut:]])
        assert joined(d)[1] == content and out.finish_reason == "stop", cut
        assert out.completion_tokens == tokens, cut


def test_completion_tokens_after_a_stop_string_count_the_thought_before_it(tok):
    ids = tok.encode_text("<|channel>thought\nfirst count<channel|>7 8 9 10")
    answer = len(tok.encode_text("7 8 9 10"))
    out = Output(tok, stop_strings=[" 10"])
    assert joined(feed(out, [ids])) == ("first count", "7 8 9")
    assert out.completion_tokens == len(ids) - 1 == len(ids) - answer + 3  # all but " 10"
