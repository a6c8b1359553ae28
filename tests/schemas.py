"""Generated JSON schemas for the structured-output tests: strings with lengths, bounded integers, booleans,
enums, arrays with maxItems, nested objects and required fields, small enough that a document fits in a few
16-token canvases of the bundled model."""

import json
import random

WORDS = ["a", "b", "cat", "dog", "x1", "red", "go"]


def value(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 1 else []))
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 3)}
    if kind == "integer":
        lo = rng.randint(-20, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 120)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": rng.choice([{"type": "boolean"}, {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}]),
                "maxItems": rng.randint(1, 3)}
    return obj(rng, depth + 1, 2)


def obj(rng: random.Random, depth: int = 0, most: int = 3) -> dict:
    names = rng.sample(["id", "name", "ok", "n", "tags", "kind"], rng.randint(1, most))
    props = {k: value(rng, depth) for k in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [obj(rng) for _ in range(n)]


def string_schemas(n: int, seed: int = 0) -> list[dict]:
    """Objects as `schemas` makes them, each with a string of maxLength 8 to 24 and some with an array of strings:
    on a 262,144-token vocabulary a string state allows most tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = obj(rng)
        s["properties"]["text"] = {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(8, 24)}
        if rng.random() < 0.5:
            s["properties"]["notes"] = {"type": "array", "items": {"type": "string", "maxLength": 6},
                                        "maxItems": rng.randint(1, 3)}
        s["required"] = [*s["required"], "text"]
        out.append(s)
    return out


def _nested(depth):
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


# Refused at once: one line (the CLI), a 400 (the server), before anything compiles or runs.
HOSTILE = {
    "not JSON": "[1",
    "not an object": "[1, 2]",
    "recursive $ref": json.dumps({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                                  "$ref": "#/$defs/n"}),
    "deeply nested": json.dumps(_nested(200)),
    "huge": json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(5000)}}),
    "invalid": json.dumps({"type": "objectt"}),
    "remote $ref": json.dumps({"$ref": "https://example.com/s.json"}),
    "long string": json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}}),
    "long pattern": json.dumps({"type": "string", "pattern": "[a-z]{2,5000}"}),
}
WORDS_OF = {"not JSON": "not JSON", "not an object": "JSON object", "recursive $ref": "recursive",
            "deeply nested": "levels", "huge": "characters", "invalid": "cannot be compiled", "remote $ref": "not local",
            "long string": "repeats", "long pattern": "repeats"}
