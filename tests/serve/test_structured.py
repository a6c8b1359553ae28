"""`response_format` on `dgemma serve` (the bundled model, the official `openai` client): json_schema answers validate
over generated schemas sent together (one batch), json_object answers are objects, the plain answer is unchanged,
and hostile schemas are a 400 in under a second with the server still serving."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from schemas import HOSTILE, WORDS_OF, schemas
from server_proc import serve

PROMPTS = ["Reverse: c a t", "Sort: 7 2 9 2", "Count from 7 to 31."]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serve("--max-batch-size", "64", tmp_path=tmp_path_factory.mktemp("serve")) as s:
        yield openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=120)
        log = s.log()
    assert "Traceback" not in log, log


def ask(client, prompt, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=96, **kw)


@pytest.mark.parametrize("n", [10, pytest.param(50, marks=pytest.mark.slow)])
def test_json_schema_answers_validate_over_generated_schemas(client, n):
    sets = schemas(n, seed=1)
    fmt = [{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}}
           for i, s in enumerate(sets)]
    with ThreadPoolExecutor(n) as pool:  # sent together: they run as one batch
        replies = list(pool.map(lambda i: ask(client, PROMPTS[i % 3], response_format=fmt[i]), range(n)))
    for reply, schema in zip(replies, sets):
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_json_object_and_the_plain_answer(client):
    for prompt in PROMPTS:
        assert isinstance(json.loads(ask(client, prompt, response_format={"type": "json_object"})
                                     .choices[0].message.content), dict)
    assert ask(client, "Reverse: c a t").choices[0].message.content == "t a c"
    assert ask(client, "Reverse: c a t", response_format={"type": "text"}).choices[0].message.content == "t a c"


@pytest.mark.parametrize("name", [n for n in HOSTILE if n != "not JSON"] + ["bad type"])
def test_hostile_schemas_are_a_400_in_under_a_second(client, name):
    fmt = ({"type": "xml"} if name == "bad type" else
           {"type": "json_schema", "json_schema": {"name": "h", "schema": json.loads(HOSTILE[name])}})
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Reverse: c a t", response_format=fmt)
    assert time.perf_counter() - t0 < 1.0
    assert WORDS_OF.get(name, "text") in str(e.value) and "not supported" not in str(e.value)
    assert ask(client, "Reverse: c a t").choices[0].message.content == "t a c"  # still serving


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "flip", "parameters": {
             "type": "object", "properties": {"heads": {"type": "boolean"}}, "required": ["heads"]}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "flip"}}, "required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_has_valid_arguments_whole_and_streamed(client, choice):
    fast = {"extra_body": {"max_denoising_steps": 8}}  # any step count draws a valid call: fewer keep it quick
    reply = ask(client, "Reverse: c a t", tools=TOOLS, tool_choice=choice, **fast)
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == choice["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    chunks = list(ask(client, "Sort: 7 2 9 2", tools=TOOLS, tool_choice=choice, stream=True, **fast))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    assert len(deltas) == 1 and not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(deltas[0].function.arguments), PARAMS[deltas[0].function.name])


def test_tool_choice_none_answers_in_text_and_bad_choices_are_a_400(client):
    assert ask(client, "Reverse: c a t", tools=TOOLS, tool_choice="none").choices[0].message.content == "t a c"
    for body in ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 {"tool_choice": "required"}, {"tools": [{"type": "function", "function": {"name": "a b"}}]},
                 {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, "Reverse: c a t", **body)
        assert "tool" in str(e.value) and "not supported" not in str(e.value)
