"""`serve.protocol.parse` without a server: strict types for the sampler's body fields, fields that do not
apply refused unless null or false (0 is a value), and `max_tokens` beside `max_completion_tokens`."""

from __future__ import annotations

import pytest

from dgcli.runtime.session import BUNDLED
from dgcli.sampling.params import DiffusionEbParams
from dgcli.serve.errors import ApiError
from dgcli.serve.protocol import NOT_APPLICABLE, Context, parse
from dgcli.text.tokenizer import load_tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ctx():
    return Context(load_tokenizer(BUNDLED), "tiny", DiffusionEbParams(), max_tokens=64, canvas_length=16,
                   context=4096)


def refused(ctx, body, *, chat=True) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse({"messages": HI, **body} if chat else {"prompt": "hi", **body}, chat=chat, ctx=ctx)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("key,value,wanted", [
    ("max_denoising_steps", "8", "a whole number"), ("max_denoising_steps", 8.0, "a whole number"),
    ("max_blocks", "200", "a whole number"), ("stability_threshold", "1", "a whole number"),
    ("max_blocks", True, "a whole number"), ("entropy_bound", "0.1", "a finite number"),
    ("t_max", "0.9", "a finite number"), ("t_min", "0.1", "a finite number"),
    ("confidence_threshold", "0", "a finite number"), ("confidence_threshold", False, "a finite number")])
def test_a_sampler_field_of_the_wrong_type_is_400_naming_it_and_the_type(ctx, key, value, wanted):
    e = refused(ctx, {key: value})
    assert e.param == key and e.message.startswith(f"{key}={value!r}: expected {wanted}"), e.message
    assert "(--" not in e.message  # a request has fields, not flags


def test_sampler_fields_of_the_right_type_are_taken(ctx):
    spec = parse({"messages": HI, "max_denoising_steps": 8, "t_max": 1, "entropy_bound": 0.2, "max_blocks": 2,
                  "confidence_threshold": 0, "stability_threshold": None}, chat=True, ctx=ctx)
    p = spec.params
    got = (p.max_denoising_steps, p.t_max, p.entropy_bound, p.max_blocks, p.confidence_threshold)
    assert got == (8, 1.0, 0.2, 2, 0)
    assert p.stability_threshold == ctx.params.stability_threshold and spec.num_blocks == 2


@pytest.mark.parametrize("key,value", [("temperature", 0), ("top_p", 0), ("top_p", 1.0), ("logprobs", 0),
                                       ("frequency_penalty", 0), ("presence_penalty", 0.0), ("top_k", 0),
                                       ("echo", 0), ("logprobs", True), ("functions", [])])
def test_a_field_that_does_not_apply_is_refused_even_when_0(ctx, key, value):
    e = refused(ctx, {key: value})  # 0 == False in Python: compared by value, temperature 0 slipped through
    assert e.param == key and e.code == "unsupported_parameter" and NOT_APPLICABLE[key] in e.message


def test_a_field_that_does_not_apply_may_be_null_or_false(ctx):
    for key in NOT_APPLICABLE:
        for value in (None, False):
            parse({"messages": HI, key: value}, chat=True, ctx=ctx)


@pytest.mark.parametrize("chat", [True, False])
def test_max_tokens_and_max_completion_tokens_are_both_checked(ctx, chat):
    for body, param, words in (({"max_completion_tokens": 5, "max_tokens": "x"}, "max_tokens", "an integer"),
                               ({"max_completion_tokens": "x", "max_tokens": 5}, "max_completion_tokens",
                                "an integer"),
                               ({"max_completion_tokens": 5, "max_tokens": 0}, "max_tokens", ">= 1"),
                               ({"max_completion_tokens": 5, "max_tokens": 10**12}, "max_tokens", "at most"),
                               ({"max_completion_tokens": 5, "max_tokens": 6}, "max_tokens", "send one of them")):
        e = refused(ctx, body, chat=chat)
        assert e.param == param and words in e.message, (body, e.message)
    for body in ({"max_completion_tokens": 5, "max_tokens": 5}, {"max_completion_tokens": 5, "max_tokens": None},
                 {"max_tokens": 5}, {"max_completion_tokens": 5}):
        spec = parse({"messages": HI, **body} if chat else {"prompt": "hi", **body}, chat=chat, ctx=ctx)
        assert spec.max_tokens == 5, body


def test_a_float_for_an_integer_field_says_how_to_write_one(ctx):
    """A seed of 1e30 (JSON reads it as a float) is told to be an integer, not "a whole number" (it is one)."""
    with pytest.raises(ApiError, match=r"seed=1e\+30: must be an integer >= 0 \(JSON with no point or exponent\)"):
        parse({"messages": HI, "seed": 1e30}, chat=True, ctx=ctx)
