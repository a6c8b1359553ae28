"""Tool calls in the checkpoint's own syntax: the tools and a multi-turn tool conversation rendered as Gemma-4's chat
template renders them; calls in an answer read back into OpenAI's `tool_calls` (crafted texts through `parse_calls`;
through the real server and the `openai` client, whole and streamed, a decoder scripted to write them, as in
test_server_scripted.py)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

import dgcli
from dgcli.runtime.session import open_session
from dgcli.serve.structured import parse_calls
from dgcli.text.tokenizer import load_tokenizer
from server_proc import Scripted, in_process

Q = '<|"|>'
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "City"}}, "required": ["city"]}}}
FLIP = {"type": "function", "function": {"name": "flip", "parameters": {
    "type": "object", "properties": {"heads": {"type": "boolean"}, "n": {"type": "integer"}}}}}
CALLED = [{"role": "user", "content": "Plan"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
# What Gemma-4's chat_template.jinja renders for CALLED with the WEATHER tool, thinking off (its copy in
# vllm-project/vllm, examples/tool_chat_template_gemma4.jinja, run on these messages).
RENDERED = ('<bos><|turn>system\n<|tool>declaration:weather{description:<|"|>Weather<|"|>,parameters:{properties:{city:'
            '{description:<|"|>City<|"|>,type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}'
            '<tool|><turn|>\n<|turn>user\nPlan<turn|>\n<|turn>model\n<|tool_call>call:weather{city:<|"|>Paris<|"|>}'
            '<tool_call|><|tool_response>response:weather{value:<|"|>sunny<|"|>}<tool_response|>')
ANSWERED = CALLED + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]


def as_template_takes(messages):
    """The messages with each call's arguments as an object (the server parses the JSON string)."""
    def parsed(c):
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    return [{**m, "tool_calls": list(map(parsed, m["tool_calls"]))} if m.get("tool_calls") else m for m in messages]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(Path(dgcli.__file__).parent / "data" / "tiny")


def test_tools_and_a_tool_conversation_render_as_gemma4s_template(tok):
    assert tok.render_chat(as_template_takes(CALLED), tools=[WEATHER]) == RENDERED  # the model goes on in its turn
    assert tok.render_chat(as_template_takes(ANSWERED), tools=[WEATHER]) == (
        RENDERED + "Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    args = {"s": 'say "hi", {ok}', "n": -3, "x": 2.5, "on": True, "list": [1, {"deep": [False, "a"]}], "o": {}}
    call = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": args}}]}]
    text = tok.render_chat(call, tools=[FLIP])
    assert '<|tool>declaration:flip{description:<|"|><|"|>,parameters:{properties:{heads:{type:<|"|>BOOLEAN<|"|>},' \
           'n:{type:<|"|>INTEGER<|"|>}},type:<|"|>OBJECT<|"|>}}<tool|>' in text
    assert text.endswith('<|tool_call>call:f{list:[1,{deep:[false,<|"|>a<|"|>]}],n:-3,o:{},on:true,s:<|"|>say "hi", '
                         '{ok}<|"|>,x:2.5}<tool_call|><|tool_response>')  # keys sorted, strings quoted by the token
    assert parse_calls(text[text.index("<|tool_call>"):-len("<|tool_response>")]) == (
        [{"name": "f", "arguments": args}], "")  # what the template writes, the parser reads back


@pytest.mark.parametrize("text, calls, outside", [
    (f"<|tool_call>call:weather{{city:{Q}Paris{Q}}}<tool_call|>", [("weather", {"city": "Paris"})], ""),
    (f"Let me see. <|tool_call>call:a{{}}<tool_call|>\n<|tool_call>call:b-2{{n:1e3,m:-0.5,z:0}}<tool_call|> ok",
     [("a", {}), ("b-2", {"n": 1000.0, "m": -0.5, "z": 0})], "Let me see. \n ok"),
    (f"<|tool_call>call:f{{o:{{in:{{x:[[],[1,[true,None,null]]]}}}},s:{Q}a{{b}}:[c],\"d\"{Q}}}<tool_call|>",
     [("f", {"o": {"in": {"x": [[], [1, [True, None, None]]]}}, "s": 'a{b}:[c],"d"'})], ""),
    (f"<|tool_call>call:f{{{Q}quoted key{Q}:false,bare key:{Q}{Q}}}", [("f", {"quoted key": False, "bare key": ""})],
     ""),  # the last call may end the text (the stop id came instead of <tool_call|>)
    ("no call here, just { text: [1, 2] }", [], "no call here, just { text: [1, 2] }"),
])
def test_calls_in_the_checkpoints_syntax_are_read(text, calls, outside):
    assert parse_calls(text) == ([{"name": n, "arguments": a} for n, a in calls], outside)


@pytest.mark.parametrize("text", [
    "<|tool_call>call:f{heads:tru}<tool_call|>", "<|tool_call>call:f{a:1,}<tool_call|>", "<|tool_call>call:f{a:1",
    "<|tool_call>call:f{a:1}} trailing", f"<|tool_call>call:f{{s:{Q}open}}<tool_call|>", "<|tool_call>call:f[1]",
    "<|tool_call>f{a:1}<tool_call|>", "<|tool_call>call:{a:1}<tool_call|>", "<|tool_call>call:f{a 1}<tool_call|>",
    "<|tool_call>call:f{a:1}<tool_call|><|tool_call>call:g{b:}<tool_call|>", "<|tool_call>call:f{a:Paris}",
    "<|tool_call>call:f{a:" + "[" * 100_000 + "]" * 100_000 + "}",  # deeper than Python's stack: text, no crash
    "<|tool_call>call:f{{a:1}:2}", "<|tool_call>call:f{a:007}",
])
def test_a_malformed_call_leaves_the_answer_text(text):
    assert parse_calls(text) is None


ASK = "What is the weather in Paris?"
CALLS = (f"Checking. <|tool_call>call:weather{{city:{Q}Paris{Q}}}<tool_call|><|tool_call>call:flip{{heads:true,n:3}}"
         "<tool_call|><|tool_response>")
BROKEN = "<|tool_call>call:flip{heads:tru}<tool_call|><|tool_response>"


@pytest.fixture(scope="module")
def base_url(tok):
    """A server whose decoder writes CALLS to ASK, BROKEN to ASK + "!", and "Sunny.<turn|>" after ANSWERED."""
    s = open_session(None, None, {})
    c = s.config.canvas_length
    script = {}
    for messages, answer in (([{"role": "user", "content": ASK}], CALLS), ([{"role": "user", "content": ASK + "!"}],
                             BROKEN), (as_template_takes(CALLED), "Sunny.<turn|>")):
        p = len(tok.encode_prompt(tok.render_chat(messages, tools=[WEATHER, FLIP]), raw=True))
        ids = tok.encode_text(answer)
        ids += [s.pad_id] * (-len(ids) % c)
        blocks = {p + k * c: torch.tensor(ids[k * c:(k + 1) * c]) for k in range(len(ids) // c)}
        assert not blocks.keys() & script.keys()  # one script per prompt
        script.update(blocks)
    s.model = Scripted(s.model, script)
    with in_process(s, slots=2) as (url, _):
        yield url + "/v1"


def test_an_auto_answers_calls_come_back_as_tool_calls_whole_and_streamed(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": ASK}], tools=[WEATHER, FLIP])
    want = [("weather", {"city": "Paris"}), ("flip", {"heads": True, "n": 3})]
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking. "
    assert [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls] == want
    assert all(t.type == "function" and t.id.startswith("call_") for t in whole.message.tool_calls)

    chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Checking. "
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, *want[0]), (1, *want[1])]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]

    one = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]  # at most one call
    assert [(t.function.name, json.loads(t.function.arguments)) for t in one.message.tool_calls] == want[:1]
    assert client.chat.completions.create(parallel_tool_calls=True, **kw).choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls must be true or false"):
        client.chat.completions.create(extra_body={"parallel_tool_calls": "yes"}, **kw)


def test_a_malformed_call_is_plain_content_and_a_tool_conversation_goes_on(base_url, tok):
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    for stream in (False, True):
        got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK + "!"}],
                                             tools=[WEATHER, FLIP], stream=stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in got if ch.choices) if stream else \
            got.choices[0].message.content
        assert text == BROKEN.removesuffix("<|tool_response>")
        assert stream or (got.choices[0].finish_reason == "stop" and got.choices[0].message.tool_calls is None)
    reply = client.chat.completions.create(model="tiny", messages=CALLED, tools=[WEATHER, FLIP])  # the results
    assert reply.choices[0].message.content == "Sunny." and reply.choices[0].finish_reason == "stop"
    rendered = tok.render_chat(as_template_takes(CALLED), tools=[WEATHER, FLIP])
    assert reply.usage.prompt_tokens == len(tok.encode_prompt(rendered, raw=True))  # the template's rendering
    for bad in ('{"city": ', "[1]"):  # the arguments of a past call must be a JSON object
        messages = [CALLED[0], {**CALLED[1], "tool_calls": [{**CALLED[1]["tool_calls"][0], "function": {
            "name": "weather", "arguments": bad}}]}, CALLED[2]]
        with pytest.raises(openai.BadRequestError, match="tool_calls must be a list"):
            client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, FLIP])
