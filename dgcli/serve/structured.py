"""Structured answers: `response_format` (`text`, `json_object`, `json_schema`) and `tools` + `tool_choice` (a forced
call, `required` or a named function, is drawn under {"name": const, "arguments": its parameters}; `auto` reads a
whole-answer call back), compiled to the sampler's automaton while the request is parsed; an answer's `tool_calls`.
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


@dataclass
class Format:
    """The automaton a request is drawn under (None: free text), where it must close, the tool mode and names."""

    automaton: Any
    room: int
    tool_mode: str | None = None  # "none", "auto", "required", "named"; None without tools
    tool_names: list[str] = field(default_factory=list)

    def constraint(self) -> Any:
        """A fresh place in the automaton, for one run of the request (None: free text)."""
        from dgcli.sampling.constrain import Constraint

        return None if self.automaton is None else Constraint(self.automaton, self.room)

    @property
    def forced(self) -> bool:
        return self.tool_mode in ("required", "named")

    def calls(self, content: str, finish: str) -> list[dict] | None:
        return tool_calls(content, self.tool_mode, self.tool_names) if finish == "stop" else None

    def reply(self, body: dict) -> dict:
        """A chat reply `body` (protocol.reply's) as a tool call's, when its answer is one."""
        choice = body["choices"][0]
        calls = self.calls(choice["message"]["content"], choice["finish_reason"])
        if calls:
            choice["message"] = {**choice["message"], "content": None, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
        return body

    def end_chunks(self, spec: Any, model: str, content: str, finish: str) -> list[dict] | None:
        """A forced call's stream end (its text was held back): the tool_calls chunk, then the finish chunk."""
        calls = self.calls(content, finish) if self.forced else None
        if not calls:
            return None
        head = {"id": spec.id, "object": "chat.completion.chunk", "created": spec.created, "model": model}
        return [{**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **calls[0]}]},
                                      "logprobs": None, "finish_reason": None}]},
                {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]}]


def answer_format(body: dict, chat: bool, ctx: Any, canvases: int, budget: int | None,
                  ignore_eos: bool) -> tuple[dict, Format | None]:
    """(the body, its messages led by the tools when the model may call them; its Format, None for free text)."""
    forced, functions, mode = tool_plan(body) if chat else (None, [], None)
    if functions and mode != "none" and isinstance(body.get("messages"), list):
        body = {**body, "messages": [tools_message(functions), *body["messages"]]}
    room = canvases if budget is None else min(budget, canvases)
    automaton = response_automaton(body, ctx.tokenizer, () if ignore_eos else ctx.stop_ids, room, forced)
    if automaton is None and mode is None:
        return body, None
    return body, Format(automaton, room, mode, [f["name"] for f in functions])


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


def tools_message(functions: list[dict]) -> dict:
    """The tools, told to the model in a system message (the bundled templates render no tools of their own)."""
    return {"role": "system", "content": "You can call these functions; to call one, answer with JSON "
            '{"name": NAME, "arguments": {...}} only.\n' + json.dumps(functions, ensure_ascii=False)}


def tool_calls(content: str, mode: str | None, names: list[str]) -> list[dict] | None:
    """The OpenAI tool_calls of an answer (forced, or under "auto" an answer that is a call as a whole); None: text."""
    if mode not in ("auto", "required", "named"):
        return None
    try:
        call = json.loads(content)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}]
