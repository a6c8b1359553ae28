"""Structured output on the canvas: a JSON schema compiled to a token-level automaton over the checkpoint's own
tokenizer, and one request's place in it.

Owns: `compile_schema` (schema -> `Automaton`: outlines-core builds the DFA, imported here only, when a request asks
for structure; the schema's limits and one-line errors) and `Constraint` (one request's automaton state across its
blocks). Must not: draw (joint.py draws a canvas under the automaton), decide which positions are accepted or when a
block stops (rules.py).

The automaton is held over token classes: tokens with the same move from every state share a class (on a 262,144-token
vocabulary a string state allows nearly every token, yet a schema's tokens fall in a few hundred classes), so what is
held, and what the edge limit counts, is (state, class) pairs, and the draw reads a class's mass, never a token's edge.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from dgcli.errors import UserError
from dgcli.sampling.params import over_limit

# --json / response_format json_object: any JSON object, as an object of scalars, arrays of scalars and flat objects
# (JSON Schema's bare {"type": "object"} compiles to outlines-core's any-JSON pattern: ~1,600 states, seconds to build).
_SCALAR = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}
ANY_OBJECT = {"type": "object", "additionalProperties": {"anyOf": [
    *_SCALAR["anyOf"], {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]}}
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
GROUP = 64  # a class's tokens in chunks of this many: the draw picks a chunk by its mass, then a token in it


@dataclass(eq=False)
class Automaton:
    """A DFA over token classes: states 0..n-1, plus `done` = n (reached from a final state by a stop id; it then
    takes any token). `cls` [V] each token's class (0..k-1; class `idle`: tokens only `done` takes); edges (src,
    kls, dst) [E] over classes, done's own included; `dist` [n+1]: fewest tokens to `done`."""

    n: int
    start: int
    k: int
    idle: int
    cls: torch.Tensor
    src: torch.Tensor
    kls: torch.Tensor
    dst: torch.Tensor
    dist: torch.Tensor
    moves: list  # host: moves[state] = {class: next state} (stop ids' moves included)
    _on: dict = field(default_factory=dict)

    def on(self, device: torch.device, vocab: int) -> dict:
        """The tensors the draw reads, on `device`, for a head of `vocab` rows (ids past the tokenizer's: idle):
        the edges, `dist`, `chunk` [vocab] each token's chunk, `chunk_cls` [K'] each chunk's class, `members`
        [K', GROUP] each chunk's tokens (-1: none). Built once per (device, vocab)."""
        if (device, vocab) not in self._on:
            cls = torch.cat((self.cls[:vocab], self.cls.new_full((max(0, vocab - len(self.cls)),), self.idle)))
            order = torch.argsort(cls, stable=True)  # [vocab]: by class, in id order within one
            size = torch.bincount(cls, minlength=self.k)  # [k]
            first = torch.cumsum(size, 0) - size  # [k]: the class's first place in `order`
            rank = torch.arange(vocab) - first[cls[order]]  # [vocab]: place within its class
            per = (size + GROUP - 1) // GROUP  # [k] chunks per class
            chunk = torch.empty(vocab, dtype=torch.long)
            chunk[order] = (torch.cumsum(per, 0) - per)[cls[order]] + rank // GROUP
            members = torch.full((int(per.sum()), GROUP), -1, dtype=torch.long)
            members[chunk[order], rank % GROUP] = order
            t = dict(src=self.src, kls=self.kls, dst=self.dst, dist=self.dist, chunk=chunk, members=members,
                     chunk_cls=torch.repeat_interleave(torch.arange(self.k), per))
            self._on[(device, vocab)] = {name: x.to(device) for name, x in t.items()}
        return self._on[(device, vocab)]


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
            self.state = a.moves[self.state].get(int(a.cls[t]) if t < len(a.cls) else a.idle, self.state)


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
    return _automaton(index, eos, stops, start if lead is None else index.get_next_state(start, lead),
                      tokenizer.vocab_size)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each entry of x (int64 arithmetic wraps: the bits of the unsigned original)."""
    srl = lambda x, k: (x >> k) & ((1 << (64 - k)) - 1)  # noqa: E731: a logical shift
    x = x + -7046029254386353131
    for k, mul in ((30, -4658895280553007687), (27, -7723592293110705685)):
        x = (x ^ srl(x, k)) * mul
    return x ^ srl(x, 31)


def _automaton(index: Any, eos: int, stops: tuple[int, ...], start: int, vocab: int) -> Automaton:
    trans = index.get_transitions()
    ids = sorted(trans.keys() | {start})  # no others are reached
    n = len(ids)
    names = torch.full((max(ids) + 1,), -1, dtype=torch.long)
    names[ids] = torch.arange(n)  # outlines-core's state ids -> 0..n-1
    count = sum(map(len, trans.values()))
    flat = lambda it: torch.from_numpy(np.fromiter(it, dtype=np.int64, count=count))  # noqa: E731
    t, d = flat(chain.from_iterable(trans.values())), flat(chain.from_iterable(r.values() for r in trans.values()))
    s = names[torch.tensor(list(trans)).repeat_interleave(torch.tensor(list(map(len, trans.values()))))]
    d = torch.where(d < len(names), names[d.clamp(max=len(names) - 1)], -1)
    keep = (t != eos) & (t < vocab) & (d >= 0)
    final = names[[f for f in index.get_final_states() if f in trans or f == start]]
    stop = torch.tensor([x for x in stops if x < vocab], dtype=torch.long)
    s = torch.cat((s[keep], final.repeat_interleave(len(stop))))  # the stop ids' moves: final -> done
    t = torch.cat((t[keep], stop.repeat(len(final))))
    d = torch.cat((d[keep], torch.full((len(final) * len(stop),), n)))
    # A token's class: the sum over its moves (s -> d) of a random 64-bit value per (s, d). Tokens with the same moves
    # share a sum; two different move sets collide with probability 2^-64. The extra id: a token with no move.
    sig = torch.zeros(vocab + 1, dtype=torch.long).index_add_(0, t, _mix(s * (n + 1) + d))
    _, cls = torch.unique(sig, return_inverse=True)
    k = int(cls.max()) + 1
    rep = torch.full((k,), vocab + 1).scatter_reduce(0, cls, torch.arange(vocab + 1), "amin")  # [k] a token each
    is_rep = torch.zeros(vocab + 1, dtype=torch.bool)
    is_rep[rep] = True
    edges = torch.cat((torch.stack((s, cls[t], d))[:, is_rep[t]],  # [3, E], done's own moves last
                       torch.stack((torch.full((k,), n), torch.arange(k), torch.full((k,), n)))), dim=1)
    msg = over_limit("automaton_edges", edges.shape[1], "give a smaller schema",
                     shown=f"json_schema's {edges.shape[1]} moves (state x token class)")
    if msg:
        raise UserError(msg)
    src, kls, dst = edges.tolist()
    dist = [math.inf] * n + [0]
    back: dict[int, list[int]] = {}
    for s, d in zip(src, dst):
        back.setdefault(d, []).append(s)
    queue = collections.deque([n])
    while queue:  # breadth-first from done along reversed edges
        d = queue.popleft()
        for s in back.get(d, ()):
            if dist[s] == math.inf:
                dist[s] = dist[d] + 1
                queue.append(s)
    if dist[int(names[start])] == math.inf:
        raise UserError("json_schema admits no document (e.g. minLength above maxLength, or no allowed value); fix it")
    live = torch.tensor([dist[d] < math.inf for d in dst])  # moves into states that can never close: never taken
    moves: list[dict[int, int]] = [{} for _ in range(n + 1)]
    for s, c, d in zip(src, kls, dst):
        moves[s][c] = d
    big = 1 << 40
    return Automaton(n, int(names[start]), k, int(cls[vocab]), cls[:vocab].clone(), *edges[:, live],
                     torch.tensor([d if d < math.inf else big for d in dist], dtype=torch.long), moves)


@functools.lru_cache(maxsize=2)  # 262,144 tokens take seconds to hand over: once per tokenizer
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
