"""Sampler settings: `DiffusionEbParams` (the entropy-bound sampler's knobs) and its ONE validator, plus the
value typing every settings source goes through (flags, presets, generation_config.json, sweep cells,
request fields).

Owns: the field types (validated by pydantic: lax at a source, strict for direct construction) and ranges,
and the one-line errors that name the key and the fix (`SettingsError`). The ranges follow the reference's
`DiffusionGemmaGenerationConfig.validate`: t_min >= 0 and t_max > t_min (t_min itself is never used as a
temperature, so 0 is fine), steps >= 1. The loop calls `DiffusionEbParams.check` on whatever it is given,
so there is no second validator. Must not: import torch, read files or know where a value came from
(runtime/settings.py adds the source to the message).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
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
    """A bad setting; `key` names it so `resolve` can add where the value came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def fix(key: str) -> str:
    flag = CLI_FLAG.get(key)
    return f"{key} ({flag})" if flag else key


# ---------------------------------------------------------------------------------------------
# Value types, validated by pydantic (lax mode at a source, strict for direct construction). YAML, flags
# and JSON hand us loosely typed values: PyYAML reads `5e-3` as a *string* (YAML 1.1 wants `5.0e-3`) and
# JSON may give 16.0 for 16, so numeric strings and integral floats pass; `true` for a number, nan, inf,
# 4.5 for a whole number or 0 for text do not. The messages stay ours: one line, key, source and fix.
# ---------------------------------------------------------------------------------------------


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):  # pydantic's lax int/float take booleans; a YAML `true` is no number
        raise ValueError("a boolean is not a number")
    return v


_TYPES: dict[type, tuple[TypeAdapter, str, str]] = {  # field type -> (validator, expected, example)
    float: (TypeAdapter(Annotated[FiniteFloat, BeforeValidator(_not_bool)]), "a finite number", "to e.g. 0.1"),
    int: (TypeAdapter(Annotated[int, BeforeValidator(_not_bool)]), "a whole number", "to e.g. 16"),
    bool: (TypeAdapter(bool), "true or false", "to true or false"),
    str: (TypeAdapter(Annotated[str, Strict()]), "text", "to a quoted string"),
}


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """(int, True) for `int | None`; (kind, False) otherwise."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None)), True
    return kind, False


def coerce(key: str, value: Any, kind: Any, origin: str, *, strict: bool = False) -> Any:
    """`value` as the field type `kind`, or a `SettingsError` naming the key, where it came from and the fix."""
    kind, optional = _unwrap_optional(kind)
    if optional and value is None:
        return None
    adapter, expected, example = _TYPES[kind]  # a new field type needs a row above
    try:
        return adapter.validate_python(value, strict=strict)
    except ValidationError:
        where = f" (from {origin})" if origin else ""
        raise SettingsError(key, f"{key}={value!r}{where}: expected {expected}; set {fix(key)} {example}") from None


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_type(obj: Any, key: str) -> None:
    """Strict type check for `validate()`: catches values set by direct construction, e.g. t_min="abc"."""
    coerce(key, getattr(obj, key), field_types(type(obj))[key], "", strict=True)


def build(cls: type, values: dict[str, Any], origin: str) -> Any:
    types = field_types(cls)
    reject_unknown(values, tuple(types), origin)
    obj = cls(**{k: coerce(k, v, types[k], origin) for k, v in values.items()})
    obj.validate()
    return obj


def suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    """' (did you mean X?)' for the closest choice or alias, else ''."""
    norm = str(word).strip().lower().replace("-", "_").lstrip("_")
    if norm in _ALIASES and _ALIASES[norm] in choices:
        return f" (did you mean {_ALIASES[norm]}?)"
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
    max_blocks: int = 1  # 0 = derive from max_tokens (see `blocks_for`)

    @classmethod
    def from_dict(cls, values: dict[str, Any], origin: str = "") -> DiffusionEbParams:
        """Build from loosely typed values (coerced), rejecting unknown keys; validated."""
        return build(cls, values, origin)

    def replace(self, **changes: Any) -> DiffusionEbParams:
        """A copy with `changes` applied (coerced and validated), e.g. for one sweep cell."""
        return build(type(self), {**dataclasses.asdict(self), **changes}, "")

    @classmethod
    def check(cls, params: Any) -> DiffusionEbParams:
        """`params` (this class, or any object with these fields, e.g. a test's namespace) validated;
        fields it lacks take the defaults. The loop calls this, so every path has the one validator."""
        if not isinstance(params, cls):
            params = cls(**{k: getattr(params, k) for k in field_types(cls) if hasattr(params, k)})
        params.validate()
        return params

    def validate(self) -> None:
        """Raise `SettingsError` (a `UserError`) naming the first impossible value and the fix."""
        for key in field_types(type(self)):
            check_type(self, key)
        if self.max_denoising_steps < 1:
            raise SettingsError("max_denoising_steps", f"max_denoising_steps={self.max_denoising_steps}: a block needs at least one denoising step; set {fix('max_denoising_steps')} to 1 or more")
        if self.t_min < 0:
            raise SettingsError("t_min", f"t_min={self.t_min}: temperatures cannot be negative; set {fix('t_min')} to 0 or more (default 0.4)")
        if self.t_max <= self.t_min:
            # The reference rejects t_max <= t_min too: the schedule anneals from t_max towards t_min.
            raise SettingsError("t_min", f"t_min={self.t_min} is not below t_max={self.t_max}: the temperature anneals from t_max down towards t_min; set {fix('t_min')} < {fix('t_max')}")
        if self.entropy_bound < 0:
            raise SettingsError("entropy_bound", f"entropy_bound={self.entropy_bound}: entropies are >= 0 so a negative bound is meaningless; set {fix('entropy_bound')} to 0 or more (default 0.1)")
        if self.stability_threshold < 0:
            raise SettingsError("stability_threshold", f"stability_threshold={self.stability_threshold}: cannot compare with a negative number of previous steps; set {fix('stability_threshold')} to 0 or more (default 1)")
        if self.confidence_threshold < 0:
            raise SettingsError("confidence_threshold", f"confidence_threshold={self.confidence_threshold}: must be >= 0 (0 = always run every step); set {fix('confidence_threshold')} to 0 or more (default 0.005)")
        if not 0 <= self.seed < 2**63:
            # torch generators take a 64-bit seed; keep to the range every backend accepts.
            raise SettingsError("seed", f"seed={self.seed}: must be between 0 and 2**63-1; set {fix('seed')} accordingly")
        if self.max_blocks < 0:
            raise SettingsError("max_blocks", f"max_blocks={self.max_blocks}: must be >= 0 (0 = derive from max_tokens); set {fix('max_blocks')} to 0 or more")


