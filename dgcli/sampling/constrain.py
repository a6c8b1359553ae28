"""Structured output on the canvas: a JSON schema compiled to a token-level automaton over the checkpoint's own
tokenizer, and the joint draw of a canvas under it.

Owns: `compile_schema` (schema -> `Automaton`: outlines-core builds the DFA, imported here only, when a request asks
for structure; the schema's limits and one-line errors), `Constraint` (one request's automaton state across its
blocks) and `constrain` (a step's joint draw for the constrained rows). Must not: decide which positions are accepted
or when a block stops (rules.py), or touch other rows.

The draw, per constrained row and step: a dynamic program over canvas positions x automaton states, from the state
the committed blocks reached, ending in a state from which the document can still close in the blocks left (in the
last block: closed). Forward by log-sum-exp (the sample) or max (the argmax); backward, each position's token is
picked among the edges into the state chosen after it, by the row's own uniform (an exact joint draw from the
model's per-position distributions restricted to valid canvases) or by the max. The block's output is its last
argmax, so every committed block is a valid prefix and the last one closes the document.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dgcli.errors import UserError
from dgcli.sampling.params import over_limit

# --json / response_format json_object: any JSON object, as an object of scalars, arrays of scalars and flat objects
# (JSON Schema's bare {"type": "object"} compiles to outlines-core's any-JSON pattern: ~1,600 states, seconds to build).
_SCALAR = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}
ANY_OBJECT = {"type": "object", "additionalProperties": {"anyOf": [
    *_SCALAR["anyOf"], {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]}}
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(eq=False)
class Automaton:
    """A DFA over token ids: states 0..n-1, plus `done` = n (reached from a final state by a stop id; it then takes
    any token). Edges as tensors (src, tok, dst) [E]; `dist` [n+1]: fewest tokens to `done`."""

    n: int
    start: int
    src: torch.Tensor
    tok: torch.Tensor
    dst: torch.Tensor
    dist: torch.Tensor
    moves: dict  # host: {state: {token: next state}} (stop edges included)
    _on: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> Automaton:
        """This automaton's edge tensors on `device` (copied once per device)."""
        if device not in self._on:
            self._on[device] = [t.to(device) for t in (self.src, self.tok, self.dst, self.dist)]
        return self._on[device]


@dataclass(eq=False)
class Constraint:
    """One request's place in its automaton: the state its committed blocks reached. The document closes within
    `room` tokens (UserError when even its shortest cannot)."""

    automaton: Automaton
    room: int  # the answer's positions: its blocks' canvases, or its max_tokens cut when that is fewer
    state: int = -1

    def __post_init__(self) -> None:
        self.state = self.automaton.start if self.state < 0 else self.state
        shortest = int(self.automaton.dist[self.automaton.start])
        if shortest > self.room:
            raise UserError(f"json_schema's shortest document (with its end) takes {shortest} tokens; this answer has "
                            f"room for {self.room}: raise max_tokens (or max_blocks) or simplify the schema")

    def advance(self, tokens: list[int]) -> None:
        """A block committed: walk its tokens (a path the draw chose, so every move exists)."""
        a = self.automaton
        for t in tokens:
            if self.state == a.n:
                return
            self.state = a.moves[self.state].get(t, self.state)


# ---- the joint draw ---------------------------------------------------------------------------------------------


def constrain(out: Any, logits: Any, rows: list[tuple[int, Constraint, int]], uniform: torch.Tensor,
              end_uniform: torch.Tensor) -> None:
    """Replace rows k of `out.sample` and `out.argmax`, for each (k, constraint, block) in `rows`, by the joint draw
    and the most probable valid canvas. `logits(k)`: row k's processed logits [C, V]; `uniform` [b, C] the rows'
    draws, `end_uniform` [b] one more per row (the state the canvas ends in)."""
    for k, con, block in rows:
        logp = torch.log_softmax(logits(k), dim=-1)  # [C, V]
        c = logp.shape[0]
        room = con.room - block * c  # positions of this canvas and the ones after it that the answer keeps
        src, tok, dst, dist = con.automaton.on(logp.device)
        ends = dist <= max(room - c, 0)  # [n+1]: can still close in the canvases left
        for dst_out, u, u_end in ((out.sample, uniform[k], end_uniform[k]), (out.argmax, None, None)):
            dst_out[k] = _path(con.automaton.n, src, tok, dst, logp, con.state, ends, room, u, u_end)


def _only(a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`a` [n+1] kept where `keep`, unless that leaves nothing (then any live state: the answer is cut by length)."""
    kept = torch.where(keep, a, -math.inf)
    return torch.where(torch.isfinite(kept).any(), kept, a)


def _path(n: int, src: torch.Tensor, tok: torch.Tensor, dst: torch.Tensor, logp: torch.Tensor, start: int,
          ends: torch.Tensor, room: int, u: torch.Tensor | None, u_end: torch.Tensor | None) -> torch.Tensor:
    """One canvas [C] on the automaton, closed by position `room` when that is inside it: drawn at uniforms `u` [C]
    and `u_end`, or (u None) the max path."""
    c, v = logp.shape
    alpha = [logp.new_full((n + 1,), -math.inf)]
    alpha[0][start] = 0.0
    for i in range(c):  # forward: alpha[i+1][s'] = reduce over edges s -t-> s' of alpha[i][s] + logp[i][t]
        w = alpha[i][src] + logp[i][tok]  # [E]
        stay = alpha[i][n] + (torch.logsumexp(logp[i], 0) if u is not None else logp[i].max())  # done takes any
        a = _reduce(torch.cat((w, stay[None])), torch.cat((dst, dst.new_full((1,), n))), n + 1, u is None)
        alpha.append(_only(a, torch.arange(n + 1, device=a.device) == n) if i + 1 == room else a)  # closed
    s = _pick(_only(alpha[c], ends), u_end)
    ids, froms, every = [], torch.cat((src, src.new_full((v,), n))), torch.cat((tok, torch.arange(v, device=tok.device)))
    for i in reversed(range(c)):  # backward: the edge into s at position i
        w = torch.where(dst == s, alpha[i][src] + logp[i][tok], -math.inf)  # [E]
        wd = torch.where(s == n, alpha[i][n] + logp[i], -math.inf)  # [V]: done's own moves
        j = _pick(torch.cat((w, wd)), None if u is None else u[i])
        ids.append(every[j])
        s = froms[j]
    return torch.stack(ids[::-1])


def _reduce(w: torch.Tensor, dst: torch.Tensor, size: int, use_max: bool) -> torch.Tensor:
    """Per destination state: the max of `w` or its log-sum-exp."""
    m = w.new_full((size,), -math.inf).scatter_reduce(0, dst, w, "amax")
    if use_max:
        return m
    safe = torch.where(torch.isfinite(m), m, 0.0)
    total = w.new_zeros(size).scatter_add(0, dst, torch.exp(w - safe[dst]))
    return safe + torch.log(total)


def _pick(w: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """argmax of `w` (u None) or an inverse-CDF draw from softmax(w) at uniform u (float64, as the vocab pass)."""
    if u is None:
        return torch.argmax(w)
    cdf = torch.cumsum(torch.exp((w - w.max()).double()), 0)
    return torch.searchsorted(cdf, (u * cdf[-1])[None], right=True)[0].clamp(max=w.shape[0] - 1)


def processed_logits(model: Any, hidden: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """Row's processed logits [C, V] from its canvas hidden states [C, H], as the vocabulary pass makes them."""
    raw = F.linear(hidden, model.embed_weight).float()
    cap = model.config.final_logit_softcapping
    return (torch.tanh(raw / cap) * cap if cap else raw) / temp


# ---- schema -> automaton ------------------------------------------------------------------------------------------


def schema_error(schema: Any, what: str = "json_schema") -> str | None:
    """The one-line refusal of a schema before any compiling (type, size, depth, recursive or remote $ref), or None."""
    if not isinstance(schema, dict):
        return f"{what} must be a JSON object (a JSON Schema), got {type(schema).__name__}"
    n = len(json.dumps(schema))  # each bound before the next is computed: the walks are bounded by the first
    return (over_limit("schema_chars", n, "give a smaller schema", shown=f"{what} of {n} characters")
            or over_limit("schema_depth", d := _depth(schema), "flatten the schema",
                          shown=f"{what} nested {d} levels deep")
            or over_limit("schema_repeats", r := _repeats(schema), "lower maxLength / maxItems",
                          shown=f"{what} spanning {r} repeats")
            or _ref_error(schema, what))


def _repeats(x: Any) -> int:
    """How many counted repeats a schema spans (a string's maxLength, an array's maxItems times its items', summed
    over the rest): its automaton, and the compile, grow with it."""
    if isinstance(x, list):
        return sum(map(_repeats, x))
    if not isinstance(x, dict):
        return 0
    counts = [v for k in ("maxLength", "minLength", "maxItems", "minItems") if isinstance(v := x.get(k), int)]
    if isinstance(x.get("pattern"), str):  # a pattern's own counted repeats, {m,n}
        counts += [int(n) for n in re.findall(r"\{\s*(\d{1,9})\s*(?:,\s*(\d{0,9}))?", x["pattern"]) for n in n if n]
    inner = sum(_repeats(v) for k, v in x.items() if k != "items")
    items = max(1, _repeats(x.get("items")))
    return inner + (max(counts) * items if counts else items - 1 if "items" in x else 0)


def _depth(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + max(map(_depth, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(_depth, x), default=0)
    return 0


def _ref_error(schema: dict, what: str) -> str | None:
    def target(ref: str) -> Any:
        node = schema
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def refs(x: Any) -> list[str]:
        if isinstance(x, dict):
            return [*([x["$ref"]] if isinstance(x.get("$ref"), str) else []), *(r for v in x.values() for r in refs(v))]
        return [r for v in x for r in refs(v)] if isinstance(x, list) else []

    def visit(ref: str, path: tuple) -> str | None:
        if not (ref == "#" or ref.startswith("#/")):
            return f"{what}: $ref {ref!r} is not local; inline it or put it under $defs and refer as #/$defs/NAME"
        if ref in path:
            return f"{what}: $ref {ref!r} is recursive; structured output needs a finite schema: bound the nesting"
        node = target(ref)
        if node is None:
            return f"{what}: $ref {ref!r} points at nothing; fix the reference"
        return next((e for r in refs(node) if (e := visit(r, (*path, ref)))), None)

    return next((e for r in refs(schema) if (e := visit(r, ()))), None)


def compile_schema(tokenizer: Any, schema: dict, stop_ids: tuple[int, ...] | list[int] | set[int]) -> Automaton:
    """`schema` as an Automaton on `tokenizer` (the checkpoint's own); stop ids close the document. One-line
    UserError for a schema refused or that cannot be compiled."""
    err = schema_error(schema)
    if err:
        raise UserError(err)
    return _compile(tokenizer, json.dumps(schema), tuple(sorted(stop_ids)))


@functools.lru_cache(maxsize=8)  # a server's few schemas in use; each holds its edge tensors
def _compile(tokenizer: Any, text: str, stops: tuple[int, ...]) -> Automaton:
    try:
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        raise UserError("structured output needs outlines-core: pip install 'dgcli[json]'") from None
    holes: dict[str, str] = {}
    schema = _bounded_ints(json.loads(text), holes) or ANY_OBJECT["additionalProperties"]  # {}: any (narrowed)
    try:
        regex = build_regex_from_schema(json.dumps(schema))
        for name, rx in holes.items():
            regex = regex.replace(f'"{name}"', f"({rx})")
        msg = over_limit("schema_regex_chars", len(regex), "give a smaller schema (fewer, shorter alternatives)",
                         shown=f"json_schema's pattern of {len(regex)} characters")
        if msg:
            raise UserError(msg)
        vocab, eos, lead = _vocabulary(tokenizer, stops)
        # outlines-core builds an index whose pattern opens on a counted repetition (a top-level string with a
        # maxLength) in time exponential in the count; behind one literal token it is fast, so the pattern is
        # built behind the \x01 byte token and the automaton starts after it.
        index = Index(regex if lead is None else "\\x01" + regex, vocab)
    except UserError:
        raise
    except Exception as e:  # outlines-core's own words for what it does not support
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"json_schema cannot be compiled ({first[:200]}); use the supported JSON Schema subset") from None
    start = index.get_initial_state()
    return _automaton(index, eos, stops, start if lead is None else index.get_next_state(start, lead))


def _automaton(index: Any, eos: int, stops: tuple[int, ...], start: int) -> Automaton:
    trans = index.get_transitions()
    names = {s: i for i, s in enumerate(sorted(trans.keys() | {start}))}
    n = len(names)
    moves: dict[int, dict[int, int]] = {i: {} for i in range(n)}
    for s, row in trans.items():
        moves[names[s]] = {t: names[d] for t, d in row.items() if t != eos and d in names}
    for s in index.get_final_states():
        if s in names:
            moves[names[s]].update({t: n for t in stops})
    edges = [(s, t, d) for s, row in moves.items() for t, d in row.items()]
    msg = over_limit("automaton_edges", len(edges), "give a smaller schema", shown=f"json_schema's {len(edges)} token moves")
    if msg:
        raise UserError(msg)
    dist = [math.inf] * n + [0]
    back: dict[int, list[int]] = {}
    for s, _, d in edges:
        back.setdefault(d, []).append(s)
    queue = collections.deque([n])
    while queue:  # breadth-first from done along reversed edges
        d = queue.popleft()
        for s in back.get(d, ()):
            if dist[s] == math.inf:
                dist[s] = dist[d] + 1
                queue.append(s)
    edges = [e for e in edges if dist[e[2]] < math.inf]  # moves into states that can never close: never taken
    src, tok, dst = (torch.tensor([e[i] for e in edges], dtype=torch.long) for i in range(3))
    if dist[names[start]] == math.inf:
        raise UserError("json_schema admits no document (e.g. minLength above maxLength, or no allowed value); fix it")
    big = 1 << 40
    return Automaton(n, names[start], src, tok, dst,
                     torch.tensor([d if d < math.inf else big for d in dist], dtype=torch.long), moves)


def _vocabulary(tokenizer: Any, stops: tuple[int, ...]) -> tuple[Any, int, int | None]:
    """outlines-core's Vocabulary of the tokenizer's ordinary tokens as the bytes each stands for (specials and stop
    ids left out: they never occur inside the document), the eos id it is given, and the \x01 token (or None)."""
    from outlines_core import Vocabulary

    skip = set(tokenizer.special_ids) | set(stops)
    pieces: dict[bytes, list[int]] = {}
    for t, i in tokenizer.tokenizer.get_vocab().items():
        if i in skip:
            continue
        m = _BYTE.fullmatch(t)
        pieces.setdefault(bytes([int(m.group(1), 16)]) if m else t.replace("\u2581", " ").encode(), []).append(i)
    eos = min(skip) if skip else tokenizer.tokenizer.get_vocab_size()
    lead = pieces.get(b"\x01", [None])[0]
    return Vocabulary(eos, pieces), eos, lead


# ---- integer bounds: outlines-core's regex ignores minimum / maximum, so bounded integers get our own regex -------


def _bounded_ints(x: Any, holes: dict[str, str]) -> Any:
    if isinstance(x, list):
        return [_bounded_ints(v, holes) for v in x]
    if not isinstance(x, dict):
        return x
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    if x.get("type") == "integer" and any(isinstance(x.get(k), (int, float)) for k in keys):
        his = ([math.floor(x["maximum"])] if _num(x.get("maximum")) else []) + \
            ([math.ceil(x["exclusiveMaximum"]) - 1] if _num(x.get("exclusiveMaximum")) else [])
        lo = max(([math.ceil(x["minimum"])] if _num(x.get("minimum")) else []) +
                 ([math.floor(x["exclusiveMinimum"]) + 1] if _num(x.get("exclusiveMinimum")) else []), default=None)
        hi = min(his, default=None)
        if lo is not None and hi is not None and lo > hi:
            raise UserError(f"json_schema: an integer in [{lo}, {hi}] cannot exist; fix its minimum / maximum")
        name = f"dgcliint{len(holes)}"
        holes[name] = _int_regex(lo, hi)
        return {"const": name}
    x = {k: _bounded_ints(v, holes) for k, v in x.items()}
    if isinstance(x.get("properties"), dict):  # {} (any value) compiles to the any-JSON pattern too: narrowed
        x["properties"] = {k: v or ANY_OBJECT["additionalProperties"] for k, v in x["properties"].items()}
    for k in ("items", "additionalProperties"):
        if x.get(k) == {}:
            x[k] = ANY_OBJECT["additionalProperties"]
    # Free-form objects and arrays compile to outlines-core's any-JSON pattern (seconds): narrowed to ANY_OBJECT's
    # shapes, whose documents are valid under the original.
    if x.get("type") == "object" and "properties" not in x and "additionalProperties" not in x:
        x["additionalProperties"] = ANY_OBJECT["additionalProperties"]
    if x.get("type") == "array" and "items" not in x and "prefixItems" not in x:
        x["items"] = _SCALAR
    return x


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_regex(lo: int | None, hi: int | None) -> str:
    """A regex of the JSON integers in [lo, hi] (None: unbounded on that side)."""
    parts = []
    if lo is None or lo < 0:  # the negatives, as '-' and their magnitude in [-min(hi, -1), -lo]
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        mag_hi = None if lo is None else -lo
        if mag_hi is None or mag_lo <= mag_hi:
            parts.append(f"-({_naturals(mag_lo, mag_hi)})")
    if hi is None or hi >= 0:
        parts.append(_naturals(0 if lo is None else max(lo, 0), hi))
    return "|".join(parts)


def _naturals(lo: int, hi: int | None) -> str:
    """Integers in [lo, hi], 0 <= lo, without leading zeros."""
    width = len(str(lo))
    parts = []
    for n in range(width, (width if hi is None else len(str(hi))) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), 10**n - 1 if hi is None else min(hi, 10**n - 1)
        if a <= b:
            parts.append(_digits(str(a), str(b)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{width},}}")
    return "|".join(parts)


def _digits(a: str, b: str) -> str:
    """Digit strings of one length between a and b."""
    if not a:
        return ""
    n = len(a) - 1
    if a[1:] == "0" * n and b[1:] == "9" * n:  # every tail: no recursion (else the pattern grows as 2^digits)
        return (a[0] if a[0] == b[0] else f"[{a[0]}-{b[0]}]") + (f"[0-9]{{{n}}}" if n else "")
    if a[0] == b[0]:
        return a[0] + _digits(a[1:], b[1:])
    mid = f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + "[0-9]" * n if int(b[0]) - int(a[0]) > 1 else None
    return "(" + "|".join(p for p in (a[0] + _digits(a[1:], "9" * n), mid, b[0] + _digits("0" * n, b[1:])) if p) + ")"
