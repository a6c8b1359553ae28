"""Sampler settings: `DiffusionEbParams` (the entropy-bound sampler's knobs) and its ONE validator, plus the
value typing every settings source goes through (flags, presets, generation_config.json, sweep cells,
request fields).

Owns: the field types (validated by pydantic: lax at a source, strict for direct construction) and ranges,
`LIMITS` (the one table of upper bounds on every number that sizes work), and the one-line errors that name
the key and the fix (`SettingsError`). The ranges follow the reference's
`DiffusionGemmaGenerationConfig.validate`; the upper bounds are ours. The loop calls `DiffusionEbParams.check`
on whatever it is given, so there is no second validator. Every fix a message suggests is a value that passes
validation given the other settings as they are (`hint`).
Must not: import torch, read files or know where a value came from (runtime/settings.py adds the source).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, FiniteFloat, Strict, TypeAdapter, ValidationError

from dgcli.errors import UserError

Source = Literal["default", "checkpoint", "preset", "flag"]

# The CLI flag for each key (PRODUCT.md), so error messages can say what to change.
CLI_FLAG: dict[str, str] = {
    "max_denoising_steps": "--diffusion-steps",
    "t_min": "--t-min",
    "t_max": "--t-max",
    "entropy_bound": "--entropy-bound",
    "stability_threshold": "--stability-threshold",
    "confidence_threshold": "--confidence-threshold",
    "seed": "--seed",
    "max_blocks": "--blocks",
    "device": "--device",
    "dtype": "--dtype",
    "max_tokens": "--max-tokens",
}

# Spellings people reach for (CLI flag names, HF names) -> the preset key; used only for suggestions,
# never accepted, so that one setting has one spelling in files.
_ALIASES: dict[str, str] = {
    "diffusion_steps": "max_denoising_steps",
    "steps": "max_denoising_steps",
    "denoising_steps": "max_denoising_steps",
    "blocks": "max_blocks",
    "diffusion_blocks": "max_blocks",
    "diffusion_seed": "seed",
    "max_new_tokens": "max_tokens",
}


class SettingsError(UserError):
    """A bad setting; `key` names it, and `keys` every setting its rule involves (t_min and t_max), so
    `resolve` can add where each value came from."""

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.keys = (key, *also)


def fix(key: str) -> str:
    flag = CLI_FLAG.get(key)
    return f"{key} ({flag})" if flag else key


# Value types. YAML, flags and JSON hand us loosely typed values: PyYAML reads `5e-3` as a *string* (YAML 1.1
# wants `5.0e-3`) and JSON may give 16.0 for 16, so numeric strings and integral floats pass; `true` for a
# number, nan, inf, 4.5 for a whole number or 0 for text do not. The messages stay ours.


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):  # pydantic's lax int/float take booleans; a YAML `true` is no number
        raise ValueError("a boolean is not a number")
    return v


_TYPES: dict[type, tuple[TypeAdapter, str]] = {  # field type -> (validator, expected)
    float: (TypeAdapter(Annotated[FiniteFloat, BeforeValidator(_not_bool)]), "a finite number"),
    int: (TypeAdapter(Annotated[int, BeforeValidator(_not_bool)]), "a whole number"),
    bool: (TypeAdapter(bool), "true or false"),
    str: (TypeAdapter(Annotated[str, Strict()]), "text"),
}


def coerce(cls: type, key: str, value: Any, origin: str, *, strict: bool = False,
           current: Mapping[str, Any] | None = None) -> Any:
    """`value` as the type of field `key` of `cls`, or a `SettingsError` naming the key, its origin and a fix."""
    kind = field_types(cls)[key]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `int | None`
        if value is None:
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    adapter, expected = _TYPES[kind]  # a new field type needs a row above
    try:
        return adapter.validate_python(value, strict=strict)
    except ValidationError:
        where = f" (from {origin})" if origin else ""
        raise SettingsError(key, f"{key}={value!r}{where}: expected {expected}; {hint(cls, key, current)}") from None


@functools.cache  # get_type_hints re-evaluates the annotations; validate() asks once per field, per request
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_type(obj: Any, key: str) -> None:
    """Strict type check: catches values set by direct construction, e.g. t_min="abc"."""
    coerce(type(obj), key, getattr(obj, key), "", strict=True, current=dataclasses.asdict(obj))


def build(cls: type, values: dict[str, Any], origin: str) -> Any:
    reject_unknown(values, tuple(field_types(cls)), origin)
    obj = cls(**{k: coerce(cls, k, v, origin, current=values) for k, v in values.items()})
    obj.validate()
    return obj


# Hints: "set KEY (FLAG) to e.g. VALUE (the default)". A suggested value must pass validation as the other
# settings stand (`--t-max 0.1` with t_min 0.4 must not be told "t_max to e.g. 0.1").


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _number(value: Any) -> float | None:
    """`value` if it is a finite number, else None: `current` may hold a value that is not yet coerced."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _short(x: float) -> float:
    # 3 significant digits reads well and moves x by < 0.5%: half of t_max stays below it, twice t_min above.
    return float(f"{x:.3g}")


def _fitting(cls: type, key: str, current: Mapping[str, Any]) -> tuple[Any, str] | None:
    """A value for `key` valid given the other fields' `current` values, and why it was picked; None where no
    value of `key` alone can (t_min when t_max <= 0)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    default = defaults[key]
    if key not in ("t_min", "t_max") or not {"t_min", "t_max"} <= defaults.keys():
        return default, "the default"
    other = "t_max" if key == "t_min" else "t_min"
    given = _number(current.get(other))
    bound = defaults[other] if given is None else given
    if key == "t_min":  # needs 0 <= t_min < t_max
        if default < bound:
            return default, "the default"
        return (_short(bound / 2), f"below t_max={bound}") if bound > 0 else None
    if default > bound:  # t_max needs t_max > t_min
        return default, "the default"
    above = _short(bound * 2)
    return (above, f"above t_min={bound}") if math.isfinite(above) else None


def _both_temperatures(cls: type) -> str:
    d = {f.name: f.default for f in dataclasses.fields(cls)}
    return f"set both: {fix('t_min')} to e.g. {_show(d['t_min'])} and {fix('t_max')} to e.g. {_show(d['t_max'])} (the defaults)"


def hint(cls: type, key: str, current: Mapping[str, Any] | None = None) -> str:
    """The fix for a bad `key` of `cls`: 'set KEY (FLAG) to e.g. V (the default)', V valid given `current`. An
    optional field says "or leave it out"; its metadata may give an `example` value, or `what` to give in words."""
    f = next(f for f in dataclasses.fields(cls) if f.name == key)
    if f.default is None:
        if "example" in f.metadata:
            return f"set {fix(key)} to e.g. {_show(f.metadata['example'])} or leave it out (the default)"
        return f"give {fix(key)} {f.metadata.get('what', 'a value')} or leave it out (the default)"
    fit = _fitting(cls, key, current or {})
    if fit is None:
        return _both_temperatures(cls)
    value, why = fit
    return f"set {fix(key)} to e.g. {_show(value)} ({why})"


def suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    """' (did you mean X?)' for the closest choice or alias, else ''."""
    norm = str(word).strip().lower().replace("-", "_").lstrip("_")
    pool = list(choices) + [a for a, k in _ALIASES.items() if k in choices]
    close = difflib.get_close_matches(norm, pool, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {_ALIASES.get(close[0], close[0])}?)"


def reject_unknown(values: dict[Any, Any], valid: tuple[str, ...], origin: str) -> None:
    for key in values:
        if key not in valid:
            where = f" in {origin}" if origin else ""
            raise SettingsError(str(key), f"unknown setting {key!r}{where}{suggest(str(key), valid)}; valid keys: {', '.join(valid)}")


# Upper bounds (README "Limits"): every number that sizes work or memory has one, checked before anything is
# allocated or looped over, so that no one setting or request can wedge a run or the server: far above any
# sensible setting, small enough that the work it allows is bounded. The model's context stays the real limit of
# blocks and tokens; their bounds only refuse absurd values before a checkpoint is loaded.


@dataclass(frozen=True)
class Limit:
    bound: int
    unit: str  # "at most {bound} {unit}"


LIMITS: dict[str, Limit] = {
    # 85x the real model's default of 48 steps per 256-position canvas (the schedule is computed step by step)
    "max_denoising_steps": Limit(4096, "steps per block"),
    # argmax canvases kept on the device per running request; the reference's default is 1, and more than a few
    # only approaches fixed work (confidence_threshold 0 does that)
    "stability_threshold": Limit(256, "previous canvases"),
    # 64x the real model's context in canvases, 4x in tokens: the context check is the real limit, these refuse
    # before the checkpoint is even loaded
    "max_blocks": Limit(65536, "blocks"),
    "max_tokens": Limit(1 << 20, "tokens"),
    # dgemma serve only: OpenAI's caps on a conversation's messages (rendered and tokenized before the context
    # check) and a request's tools; every block's text is compared with every prefix of each stop string
    "messages": Limit(2048, "messages per request"),
    "tools": Limit(128, "tools"),
    "stop": Limit(16, "stop strings"),
    "stop_chars": Limit(1024, "characters per stop string"),
    # Structured output: a schema is refused before it is compiled; its regex and automaton bound the compile
    # (well under a second) and the draw's work per position.
    "schema_chars": Limit(16384, "characters"),
    "schema_depth": Limit(32, "levels"),
    "schema_repeats": Limit(96, "repeats (maxLength, maxItems x items, summed)"),
    "schema_regex_chars": Limit(200_000, "characters"),
    "automaton_edges": Limit(500_000, "moves"),
}


def over_limit(key: str, value: Any, fix: str, *, shown: str | None = None) -> str | None:
    """'KEY=V: at most B UNIT; FIX' (`shown` for 'KEY=V') when `value` is above `LIMITS[key]`, else None."""
    limit = LIMITS[key]
    if value is None or value <= limit.bound:
        return None
    return f"{shown or f'{key}={value}'}: at most {limit.bound} {limit.unit}; {fix}"


def check_limits(obj: Any) -> None:
    """Raise `SettingsError` for the first field of settings `obj` above its bound in `LIMITS`."""
    current = dataclasses.asdict(obj)
    for key in field_types(type(obj)):
        if key in LIMITS:
            message = over_limit(key, getattr(obj, key), hint(type(obj), key, current))
            if message:
                raise SettingsError(key, message)


@dataclass(frozen=True)
class DiffusionEbParams:
    """Entropy-bound sampler settings (spec §7); names and defaults as PRODUCT.md's table."""

    max_denoising_steps: int = 48  # at most this many decoder passes per block
    t_min: float = 0.4  # asymptotic temperature; T_n = t_min + (t_max - t_min) * n / N
    t_max: float = 0.8  # temperature of the first step
    entropy_bound: float = 0.1  # accept positions while the sum of lower-ranked entropies <= bound
    stability_threshold: int = 1  # previous argmax canvases that must equal the current one
    confidence_threshold: float = 0.005  # mean entropy must be below this to stop; 0 = fixed work
    seed: int = 0
    # 0 = as many blocks as the token budget needs (the checkpoint's max_new_tokens, a preset's or the
    # --max-tokens flag), one block without a budget; > 0 (a preset or flag) wins. See `blocks_for`.
    max_blocks: int = 0

    @classmethod
    def from_dict(cls, values: dict[str, Any], origin: str = "") -> DiffusionEbParams:
        """Built from loosely typed values (coerced), unknown keys refused; validated."""
        return build(cls, values, origin)

    def replace(self, **changes: Any) -> DiffusionEbParams:
        """A copy with `changes` applied (coerced and validated), e.g. for one sweep cell."""
        return build(type(self), {**dataclasses.asdict(self), **changes}, "")

    @classmethod
    def check(cls, params: Any) -> DiffusionEbParams:
        """`params` (this class, or any object with these fields; those it lacks take the defaults) validated."""
        if not isinstance(params, cls):
            params = cls(**{k: getattr(params, k) for k in field_types(cls) if hasattr(params, k)})
        params.validate()
        return params

    def validate(self) -> None:
        """Raise `SettingsError` (a `UserError`) naming the first impossible value and the fix."""
        for key in field_types(type(self)):
            check_type(self, key)
        check_limits(self)
        current = dataclasses.asdict(self)
        for key, holds, why in _RANGES:
            if key == "t_max" and not holds(self):
                # As the reference, which anneals from t_max towards t_min; either may be the one to change.
                alone = [hint(type(self), k, current) for k in ("t_min", "t_max")
                         if _fitting(type(self), k, current) is not None]
                raise SettingsError("t_min", f"t_min={self.t_min} is not below t_max={self.t_max}: the temperature "
                                    f"anneals from t_max down towards t_min; "
                                    f"{', or '.join(alone) or _both_temperatures(type(self))}", also=("t_max",))
            if not holds(self):
                raise SettingsError(key, f"{key}={current[key]}: {why}; {hint(type(self), key, current)}")


_RANGES = (  # (key, the rule, why it fails) in the order checked
    ("max_denoising_steps", lambda p: p.max_denoising_steps >= 1, "a block needs at least one denoising step"),
    ("t_min", lambda p: p.t_min >= 0, "temperatures cannot be negative"),
    ("t_max", lambda p: p.t_max > p.t_min, ""),
    ("entropy_bound", lambda p: p.entropy_bound >= 0, "entropies are >= 0 so a negative bound is meaningless"),
    ("stability_threshold", lambda p: p.stability_threshold >= 0,
     "cannot compare with a negative number of previous steps"),
    ("confidence_threshold", lambda p: p.confidence_threshold >= 0, "must be >= 0 (0 = always run every step)"),
    ("seed", lambda p: 0 <= p.seed < 2**63, "must be between 0 and 2**63-1"),  # every backend takes 64-bit seeds
    ("max_blocks", lambda p: p.max_blocks >= 0, "must be >= 0 (0 = derive from max_tokens)"),
)
