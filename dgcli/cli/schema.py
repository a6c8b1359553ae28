"""`--json-schema FILE`, `--json` and a JSONL row's `json_schema`: the schema an answer must follow, read and
shape-checked before the model loads. Must not: import torch, or check or compile the schema itself
(dgcli.sampling.constrain does, at the request).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dgcli.errors import UserError

JsonSchema = Annotated[Optional[str], typer.Option("--json-schema", metavar="FILE", help=(
    "The answer is JSON valid under the JSON Schema in FILE, drawn under it on the canvas (needs "
    "pip install 'dgcli[json]'); a generate --input-jsonl row may carry its own \"json_schema\"."))]
JsonObject = Annotated[bool, typer.Option("--json", help="The answer is a JSON object (as --json-schema).")]

ANY = "object"  # `--json`: asks for sampling.constrain.ANY_OBJECT


def read_schema(path: str | None, any_object: bool) -> dict | str | None:
    """The schema of `--json-schema PATH` (a dict), ANY for `--json`, or None."""
    if path is not None and any_object:
        raise UserError("--json asks for any JSON object and --json-schema FILE for one schema; give one of them")
    if path is None:
        return ANY if any_object else None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--json-schema {path}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                        "give a JSON Schema file") from None
    try:
        return row_schema(json.loads(text), f"--json-schema {path}")
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema {path}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                        "give a JSON Schema object") from None


def row_schema(value: Any, what: str = "json_schema") -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{what}: a JSON Schema is a JSON object, e.g. {{\"type\": \"object\"}}; "
                        f"got {type(value).__name__}")
    return value


def resolve(schema: dict | str | None) -> dict | None:
    """The schema to compile (ANY: the sampler's any-object schema)."""
    if schema == ANY:
        from dgcli.sampling.constrain import ANY_OBJECT

        return ANY_OBJECT
    return schema


def provenance(path: str | None, schema: dict | str | None) -> dict | None:
    """A bench row's record of the schema its answers followed: {"name": the file's (or "any object"), "sha256"
    of its canonical JSON}; None without one."""
    if schema is None:
        return None
    text = json.dumps(resolve(schema), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return {"name": Path(path).name if path else "any object", "sha256": hashlib.sha256(text.encode()).hexdigest()}
