"""`response_format` of a request: `text` (none), `json_object` (any JSON object) or `json_schema` ({"name", "schema",
"strict", "description"}), checked and compiled to the sampler's automaton (`sampling.constrain`) while the request is
parsed, off the engine's thread. Must not: run anything, or know how the draw uses the automaton.
"""

from __future__ import annotations

from typing import Any

from dgcli.errors import UserError
from dgcli.serve.errors import ApiError

_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def response_automaton(body: dict, tokenizer: Any, stop_ids: Any, room: int) -> Any:
    """The Automaton `response_format` asks for, None for none; ApiError(400) naming the problem (one whose shortest
    document does not fit in the answer's `room` tokens too)."""
    rf = body.get("response_format")
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
