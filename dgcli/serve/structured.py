"""Structured answers: `response_format` (`text`, `json_object`, `json_schema`) and `tools` + `tool_choice` (a forced
call, `required` or a named function, is drawn under {"name": const, "arguments": its parameters}; under `auto` the
answer keeps the checkpoint's tool-call tokens and its calls are read back: `parse_calls`), compiled to the sampler's
automaton while the request is parsed; an answer's `tool_calls`.
Must not: run anything, or know how the draw uses the automaton.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from dgcli.errors import UserError
from dgcli.sampling.params import LIMITS
from dgcli.serve.errors import ApiError

_SCHEMA_KEYS = ("name", "schema", "strict", "description")
# Gemma-4's tool-call syntax (its chat template's): <|tool_call>call:NAME{key:value,...}<tool_call|>, strings
# between <|"|> tokens; the model then writes <|tool_response> (a stop id) and waits for the results.
CALL, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'


@dataclass
class Format:
    """The automaton a request is drawn under (None: free text), where it must close, the tool mode and names."""

    automaton: Any
    room: int
    tool_mode: str | None = None  # "none", "auto", "required", "named"; None without tools
    tool_names: list[str] = field(default_factory=list)
    tools: list[dict] | None = None  # what the chat template declares (None: no tools)
    keep: frozenset[int] = frozenset()  # the tool-call tokens an `auto` answer keeps in its text
    single: bool = False  # parallel_tool_calls false: an answer's first call only

    def constraint(self) -> Any:
        """A fresh place in the automaton, for one run of the request (None: free text)."""
        from dgcli.sampling.constrain import Constraint

        return None if self.automaton is None else Constraint(self.automaton, self.room)

    @property
    def forced(self) -> bool:
        return self.tool_mode in ("required", "named")

    def answer(self, content: str, finish: str) -> tuple[str | None, list[dict]] | None:
        """(the content outside the calls or None, the OpenAI tool_calls) of an answer that calls; None: text."""
        got = tool_calls(content, self.tool_mode, self.tool_names) if finish == "stop" else None
        return (got[0], got[1][:1]) if got and self.single else got

    def reply(self, body: dict) -> dict:
        """A chat reply `body` (protocol.reply's) as a tool call's, when its answer is one."""
        choice = body["choices"][0]
        got = self.answer(choice["message"]["content"], choice["finish_reason"])
        if got:
            choice["message"] = {**choice["message"], "content": got[0], "tool_calls": got[1]}
            choice["finish_reason"] = "tool_calls"
        return body

    def hold(self, held: list[str], text: str) -> str:
        """The part of a streamed `text` to send now; the rest joins `held`: a forced answer, or from an `auto`
        answer's first call on (sent by `end_chunks`)."""
        at = 0 if self.forced or held else text.find(CALL) if self.tool_mode == "auto" else -1
        if at >= 0:
            held.append(text[at:])
        return text if at < 0 else text[:at]

    def end_chunks(self, spec: Any, model: str, held: str, finish: str) -> list[dict] | None:
        """The held text's stream end when it calls: its content chunk if any, the tool_calls chunk, the finish
        chunk; None when it does not (the text goes out as content)."""
        got = self.answer(held, finish) if held else None
        if not got:
            return None
        head = {"id": spec.id, "object": "chat.completion.chunk", "created": spec.created, "model": model}
        delta = lambda d, end=None: {**head, "choices": [{"index": 0, "delta": d, "logprobs": None,  # noqa: E731
                                                          "finish_reason": end}]}
        return ([delta({"content": got[0]})] if got[0] else []) + [
            delta({"tool_calls": [{"index": i, **c} for i, c in enumerate(got[1])]}), delta({}, "tool_calls")]


def answer_format(body: dict, chat: bool, ctx: Any, canvases: int, budget: int | None,
                  ignore_eos: bool) -> Format | None:
    """The request's Format: None for free text."""
    forced, functions, mode = tool_plan(body) if chat else (None, [], None)
    room = canvases if budget is None else min(budget, canvases)
    automaton = response_automaton(body, ctx.tokenizer, () if ignore_eos else ctx.stop_ids, room, forced)
    if automaton is None and mode is None:
        return None
    declared = [{"type": "function", "function": f} for f in functions] if mode not in (None, "none") else None
    vocab = ctx.tokenizer.tokenizer
    keep = frozenset(vocab.token_to_id(t) for t in (CALL, CALL_END, QUOTE)) - {None} if mode == "auto" else frozenset()
    return Format(automaton, room, mode, [f["name"] for f in functions], declared, keep,
                  body.get("parallel_tool_calls") is False)


def response_automaton(body: dict, tokenizer: Any, stop_ids: Any, room: int, forced: dict | None = None) -> Any:
    """The Automaton `response_format` (or `forced`: a forced tool call's schema) asks for, None for none; a 400
    naming the problem (one whose shortest document does not fit in `room` tokens too)."""
    rf = body.get("response_format")
    if forced is not None:
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise ApiError(400, "a forced tool call (tool_choice required or a function) is its own format: "
                           "leave response_format out", param="response_format")
        rf = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": forced}}
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise ApiError(400, "response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       param="response_format")
    from dgcli.sampling.constrain import ANY_OBJECT, Constraint, compile_schema

    schema = ANY_OBJECT
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict) or set(spec) - set(_SCHEMA_KEYS):
            raise ApiError(400, "response_format.json_schema must be {\"name\", \"schema\": {...}, \"strict\", "
                           "\"description\"} with schema a JSON object", param="response_format")
        schema = spec["schema"]
    try:
        automaton = compile_schema(tokenizer, schema, stop_ids)
        Constraint(automaton, room)  # fits, or the one line
        return automaton
    except UserError as e:
        raise ApiError(400, str(e), param="response_format") from None


# ---- tools ---------------------------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FIX = 'tools is a list of {"type": "function", "function": {"name", "description", "parameters"}}'


def tool_plan(body: dict) -> tuple[dict | None, list[dict], str | None]:
    """(the schema a forced call follows or None, the tools' functions, the mode: None without tools, "none",
    "auto", "required" or "named")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if tools is None:
        if choice is not None:
            raise ApiError(400, "tool_choice needs tools: give tools, or leave tool_choice out", param="tool_choice")
        return None, [], None
    most = LIMITS["tools"].bound
    if not isinstance(tools, list) or not tools or len(tools) > most:
        raise ApiError(400, f"{_FIX}, 1 to {most} of them", param="tools")
    functions = []
    for n, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]) or \
                not isinstance(f.get("parameters", {}), dict) or set(f) - {"name", "description", "parameters", "strict"}:
            raise ApiError(400, f"tools[{n}]: {_FIX}; a name of 1-64 letters, digits, _ or -; parameters a JSON "
                           "Schema object", param="tools")
        functions.append(f)
    names = [f["name"] for f in functions]
    if choice is None or choice in ("none", "auto", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in names:
        mode, functions = "named", [functions[names.index(choice["function"]["name"])]]
    else:
        raise ApiError(400, f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                       f'{{"name": NAME}}}} with NAME one of {", ".join(names)}', param="tool_choice")
    if mode not in ("required", "named"):
        return None, functions, mode
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}), functions, mode


def past_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as the chat template takes them (arguments an object); a 400 else."""
    if calls is None:
        return []
    fix = (f'{where}.tool_calls must be a list of {{"id", "type": "function", "function": {{"name", "arguments"}}}} '
           "with arguments a JSON object in a string, as this server's replies give them")
    if not isinstance(calls, list) or len(calls) > LIMITS["tools"].bound:
        raise ApiError(400, fix, param="messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        try:
            name, arguments = f.get("name"), json.loads(f.get("arguments") or "{}")
        except (AttributeError, TypeError, ValueError, RecursionError):
            raise ApiError(400, fix, param="messages") from None
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(arguments, dict):
            raise ApiError(400, fix, param="messages")
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else None, "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out


def tool_calls(content: str, mode: str | None, names: list[str]) -> tuple[str | None, list[dict]] | None:
    """(the content outside the calls or None, OpenAI's tool_calls) of an answer that calls a tool in `names`: a
    forced answer's JSON {"name", "arguments"}, or under "auto" the calls in the checkpoint's syntax; None: text."""
    if mode in ("required", "named"):
        try:
            call = json.loads(content)
        except ValueError:
            return None
        found, outside = [call] if isinstance(call, dict) else [], None
    elif mode == "auto":
        found, outside = parse_calls(content) or ([], "")
    else:
        return None
    if not found or not all(c.get("name") in names and isinstance(c.get("arguments"), dict) for c in found):
        return None
    return (outside if outside and outside.strip() else None), [
        {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}} for c in found]


_SCALAR = re.compile(r"(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null|None)(?![A-Za-z0-9_])")
_KEY = re.compile(r"[^:,{}\[\]<]+")  # the template writes keys bare
_WORDS = {"true": True, "false": False, "null": None, "None": None}  # None: how Python's None renders in the template


def parse_calls(text: str) -> tuple[list[dict], str] | None:
    """([{"name", "arguments"}], the text outside them) of the calls in `text`, in Gemma-4's syntax
    (`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,on:true,list:[...],obj:{...}}<tool_call|>`, one after another; the
    last may end the text unclosed); None when one is malformed (the answer is then plain text)."""
    calls, outside, at = [], [], 0
    while (start := text.find(CALL, at)) >= 0:
        outside.append(text[at:start])
        head = _NAME.match(text, start + len(CALL) + 5)
        if not text.startswith("call:", start + len(CALL)) or head is None:
            return None
        try:
            arguments, at = _value(text, head.end())
        except (ValueError, RecursionError):  # (nesting deeper than Python's stack: no call)
            return None
        if not isinstance(arguments, dict) or not (text.startswith(CALL_END, at) or at == len(text)):
            return None
        calls.append({"name": head.group(), "arguments": arguments})
        at += len(CALL_END) if at < len(text) else 0
    return calls, "".join(outside) + text[at:]


def _value(text: str, at: int, key: bool = False) -> tuple[Any, int]:
    """The value (`key`: an object's key, bare or quoted) in Gemma-4's syntax at `at` and the position after it;
    ValueError when there is none."""
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if not key and text.startswith(("{", "["), at):
        obj, close, items, at = text[at] == "{", "}" if text[at] == "{" else "]", [], at + 1
        while not text.startswith(close, at):
            if items:
                if not text.startswith(",", at):
                    raise ValueError
                at += 1
            if obj:
                name, at = _value(text, at, key=True)
                if not text.startswith(":", at):
                    raise ValueError
                at += 1
            value, at = _value(text, at)
            items.append((name, value) if obj else value)
        return (dict(items) if obj else items), at + 1
    m = (_KEY if key else _SCALAR).match(text, at)
    if m is None:
        raise ValueError
    word = m.group()
    return (word if key else _WORDS[word] if word in _WORDS else json.loads(word)), m.end()
