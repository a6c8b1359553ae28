"""Sampler and run settings: the two flat dataclasses, presets, and the precedence that fills them.

Owns: `DiffusionEbParams` (the entropy-bound sampler's knobs), `RunSettings` (device, dtype, token
budget, prompt set, thinking), reading presets (`presets/*.yaml`), mapping a checkpoint's
`generation_config.json`, resolving built-in defaults < checkpoint < preset < flags with the source
of every value, the block count rule, and sweep-grid value parsing.

Must not: import torch, touch a device, read checkpoints (callers pass the parsed
generation_config.json), or print. Errors the user can fix are `UserError` naming the key and the fix.
Unknown keys in presets and flags are errors (a typo must not silently change a benchmark); unknown
keys in generation_config.json are ignored (the checkpoint is not ours).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

import yaml

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

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class SettingsError(UserError):
    """A bad setting; `key` names it so `resolve` can add where the value came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _fix(key: str) -> str:
    flag = CLI_FLAG.get(key)
    return f"{key} ({flag})" if flag else key


# ---------------------------------------------------------------------------------------------
# Type coercion. YAML, flags and JSON hand us loosely typed values: PyYAML reads `5e-3` as a
# *string* (YAML 1.1 wants `5.0e-3`) and JSON may give 16.0 for 16, so numeric strings and integral
# floats are accepted; anything else ("abc", true for a number, nan) is an error naming the key.
# ---------------------------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """(int, True) for `int | None`; (kind, False) otherwise."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None)), True
    return kind, False


def _coerce(key: str, value: Any, kind: Any, origin: str) -> Any:
    kind, optional = _unwrap_optional(kind)
    if optional and value is None:
        return None
    where = f" (from {origin})" if origin else ""
    if kind is float:
        v = value
        if isinstance(v, str):
            try:
                v = float(v.strip())
            except ValueError:
                pass
        if not _is_number(v) or not math.isfinite(v):
            raise SettingsError(key, f"{key}={value!r}{where}: expected a finite number; set {_fix(key)} to e.g. 0.1")
        return float(v)
    if kind is int:
        v = value
        if isinstance(v, str):
            try:
                v = float(v.strip()) if any(c in v for c in ".eE") else int(v.strip())
            except ValueError:
                pass
        if isinstance(v, float) and math.isfinite(v) and v.is_integer():
            v = int(v)
        if not (isinstance(v, int) and not isinstance(v, bool)):
            raise SettingsError(key, f"{key}={value!r}{where}: expected a whole number; set {_fix(key)} to e.g. 16")
        return v
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise SettingsError(key, f"{key}={value!r}{where}: expected true or false; set {_fix(key)} to true or false")
    if kind is str:
        if not isinstance(value, str):
            raise SettingsError(key, f"{key}={value!r}{where}: expected text; quote it, e.g. {key}: \"...\"")
        return value
    raise TypeError(f"no coercion for {kind!r}")  # a new field type needs a rule above


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_type(obj: Any, key: str) -> None:
    """Strict type check for `validate()`: catches values set by direct construction, e.g. t_min="abc"."""
    value = getattr(obj, key)
    kind, optional = _unwrap_optional(_field_types(type(obj))[key])
    if optional and value is None:
        return
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: _is_number(value) and math.isfinite(value),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
    }[kind]
    if not ok:
        expected = {int: "a whole number", float: "a finite number", bool: "true or false", str: "text"}[kind]
        raise SettingsError(key, f"{key}={value!r}: expected {expected}; set {_fix(key)} accordingly")


def _build(cls: type, values: dict[str, Any], origin: str) -> Any:
    types = _field_types(cls)
    _reject_unknown(values, tuple(types), origin)
    obj = cls(**{k: _coerce(k, v, types[k], origin) for k, v in values.items()})
    obj.validate()
    return obj


# ---------------------------------------------------------------------------------------------
# The two dataclasses
# ---------------------------------------------------------------------------------------------


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
        return _build(cls, values, origin)

    def replace(self, **changes: Any) -> DiffusionEbParams:
        """A copy with `changes` applied (coerced and validated), e.g. for one sweep cell."""
        return _build(type(self), {**dataclasses.asdict(self), **changes}, "")

    def validate(self) -> None:
        """Raise `SettingsError` (a `UserError`) naming the first impossible value and the fix."""
        for key in _field_types(type(self)):
            _check_type(self, key)
        if self.max_denoising_steps < 1:
            raise SettingsError("max_denoising_steps", f"max_denoising_steps={self.max_denoising_steps}: a block needs at least one denoising step; set {_fix('max_denoising_steps')} to 1 or more")
        if self.t_min <= 0:
            raise SettingsError("t_min", f"t_min={self.t_min}: temperatures must be positive; set {_fix('t_min')} above 0 (default 0.4)")
        if self.t_min > self.t_max:
            raise SettingsError("t_min", f"t_min={self.t_min} is above t_max={self.t_max}: the temperature anneals from t_max down to t_min; set {_fix('t_min')} <= {_fix('t_max')}")
        if self.entropy_bound < 0:
            raise SettingsError("entropy_bound", f"entropy_bound={self.entropy_bound}: entropies are >= 0 so a negative bound is meaningless; set {_fix('entropy_bound')} to 0 or more (default 0.1)")
        if self.stability_threshold < 0:
            raise SettingsError("stability_threshold", f"stability_threshold={self.stability_threshold}: cannot compare with a negative number of previous steps; set {_fix('stability_threshold')} to 0 or more (default 1)")
        if self.confidence_threshold < 0:
            raise SettingsError("confidence_threshold", f"confidence_threshold={self.confidence_threshold}: must be >= 0 (0 = always run every step); set {_fix('confidence_threshold')} to 0 or more (default 0.005)")
        if not 0 <= self.seed < 2**63:
            # torch generators take a 64-bit seed; keep to the range every backend accepts.
            raise SettingsError("seed", f"seed={self.seed}: must be between 0 and 2**63-1; set {_fix('seed')} accordingly")
        if self.max_blocks < 0:
            raise SettingsError("max_blocks", f"max_blocks={self.max_blocks}: must be >= 0 (0 = derive from max_tokens); set {_fix('max_blocks')} to 0 or more")


@dataclass(frozen=True)
class RunSettings:
    """Run settings a preset may also carry (PRODUCT.md: device, dtype, prompt set)."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | bfloat16 | float32
    max_tokens: int | None = None  # None = the checkpoint's max_new_tokens, else one canvas
    prompt_set: str | None = None  # path of a prompt file (relative paths in a preset: to the preset's folder)
    thinking: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any], origin: str = "") -> RunSettings:
        """Build from loosely typed values (coerced), rejecting unknown keys; validated."""
        return _build(cls, values, origin)

    def validate(self) -> None:
        """Raise `SettingsError` (a `UserError`) naming the first impossible value and the fix."""
        for key in _field_types(type(self)):
            _check_type(self, key)
        if not _DEVICE_RE.match(self.device):
            raise SettingsError("device", f"device={self.device!r}: not a device; set {_fix('device')} to one of {', '.join(DEVICE_CHOICES)}")
        if self.dtype not in DTYPE_CHOICES:
            hint = _suggest(self.dtype, DTYPE_CHOICES)
            raise SettingsError("dtype", f"dtype={self.dtype!r}: unsupported{hint}; set {_fix('dtype')} to one of {', '.join(DTYPE_CHOICES)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SettingsError("max_tokens", f"max_tokens={self.max_tokens}: must be >= 1; set {_fix('max_tokens')} to 1 or more, or leave it out")
        if self.prompt_set is not None and not self.prompt_set.strip():
            raise SettingsError("prompt_set", "prompt_set is empty: give the path of a prompt file or leave it out")


PARAM_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DiffusionEbParams))
RUN_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunSettings))
ALL_KEYS: tuple[str, ...] = PARAM_KEYS + RUN_KEYS


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    """' (did you mean X?)' for the closest choice or alias, else ''."""
    norm = str(word).strip().lower().replace("-", "_").lstrip("_")
    if norm in _ALIASES and _ALIASES[norm] in choices:
        return f" (did you mean {_ALIASES[norm]}?)"
    pool = list(choices) + [a for a, k in _ALIASES.items() if k in choices]
    close = difflib.get_close_matches(norm, pool, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {_ALIASES.get(close[0], close[0])}?)"


def _reject_unknown(values: dict[Any, Any], valid: tuple[str, ...], origin: str) -> None:
    for key in values:
        if key not in valid:
            where = f" in {origin}" if origin else ""
            raise SettingsError(str(key), f"unknown setting {key!r}{where}{_suggest(str(key), valid)}; valid keys: {', '.join(valid)}")


# ---------------------------------------------------------------------------------------------
# generation_config.json (spec §2)
# ---------------------------------------------------------------------------------------------

_GEN_DIRECT = ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")
_EB_SAMPLER = "EntropyBoundSamplerConfig"


def from_generation_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Map a checkpoint's generation_config.json to our keys (values as found; `resolve` checks them).

    Returns DiffusionEbParams keys present in the file, plus `max_tokens` from `max_new_tokens` so
    "blocks derived from max tokens" can use the checkpoint's budget. `entropy_bound` is taken from
    `sampler_config` only when it is the entropy-bound sampler (or names no class): a bound of another
    sampler would mean something else. Keys we do not use (eos/pad ids, transformers_version) are ignored.
    """
    if not isinstance(raw, dict):
        raise UserError(f"generation_config.json must hold a JSON object, got {type(raw).__name__}; fix or remove the file")
    out: dict[str, Any] = {k: raw[k] for k in _GEN_DIRECT if raw.get(k) is not None}
    sampler = raw.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("_cls_name", _EB_SAMPLER) == _EB_SAMPLER:
        if sampler.get("entropy_bound") is not None:
            out["entropy_bound"] = sampler["entropy_bound"]
    if raw.get("max_new_tokens") is not None:
        out["max_tokens"] = raw["max_new_tokens"]
    return out


def stop_ids_from_generation_config(raw: dict[str, Any]) -> list[int]:
    """The end-of-generation ids (`eos_token_id`, an int or a list), deduplicated, in file order."""
    ids = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if ids is None:
        return []
    items = ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise UserError(f"generation_config.json: eos_token_id={ids!r} is not a token id or a list of ids; fix the checkpoint's generation_config.json")
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


def preset_dirs() -> list[Path]:
    """Where named presets live: the repository's top-level presets/ (a source checkout or editable
    install), then dgcli/presets/ (where pyproject's package-data puts them in a wheel)."""
    here = Path(__file__).resolve().parents[1]  # dgcli/
    return [here.parent / "presets", here / "presets"]


def list_presets() -> list[str]:
    """Names of the shipped presets (file stems), sorted, from the first preset folder found."""
    for d in preset_dirs():
        if d.is_dir():
            return sorted(p.stem for p in d.glob("*.yaml"))
    return []


def _preset_path(name_or_path: str) -> Path:
    text = str(name_or_path).strip()
    looks_like_path = text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text
    if looks_like_path:
        path = Path(text).expanduser()
        if not path.is_file():
            raise UserError(f"preset file {text!r} not found; pass an existing YAML file or a preset name ({', '.join(list_presets()) or 'none shipped'})")
        return path
    for d in preset_dirs():
        if (d / f"{text}.yaml").is_file():
            return d / f"{text}.yaml"
    available = ", ".join(list_presets()) or "none shipped"
    raise UserError(f"unknown preset {text!r}{_suggest(text, list_presets())}; available presets: {available} (or pass a path to a .yaml file)")


def load_preset(name_or_path: str) -> dict[str, Any]:
    """Read a preset by name (presets/NAME.yaml) or path: a flat mapping of DiffusionEbParams and
    RunSettings keys. Unknown keys, malformed YAML or a non-mapping are `UserError`s naming the file.
    Values are returned as written (`resolve` coerces and validates them), except that a relative
    `prompt_set` is made relative to the preset's folder, so a preset works from any directory."""
    path = _preset_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"preset {path}: malformed YAML{where}; fix the file (flat 'key: value' lines)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"preset {path}: cannot read it ({e}); check the path and permissions") from None
    if data is None:
        return {}  # an empty preset (comments only) changes nothing
    if not isinstance(data, dict):
        raise UserError(f"preset {path}: expected flat 'key: value' lines, found a {type(data).__name__}; fix the file")
    _reject_unknown(data, ALL_KEYS, f"preset {path}")
    ps = data.get("prompt_set")
    if isinstance(ps, str) and ps.strip() and not Path(ps).expanduser().is_absolute():
        data["prompt_set"] = str((path.parent / ps).resolve())
    return data


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """The settings a run uses, and where each value came from."""

    params: DiffusionEbParams
    run: RunSettings
    sources: dict[str, Source]
    preset: str | None = None  # path of the preset file used, if any

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: {"params": {...}, "run": {...}, "sources": {...}, "preset": path|None}."""
        return {
            "params": dataclasses.asdict(self.params),
            "run": dataclasses.asdict(self.run),
            "sources": dict(self.sources),
            "preset": self.preset,
        }

    def describe(self) -> str:
        """A plain-text table (key, value, source) for `--show-config`."""
        values = {**dataclasses.asdict(self.params), **dataclasses.asdict(self.run)}
        shown = {k: "(none)" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}
        kw = max(len("key"), *(len(k) for k in shown))
        vw = max(len("value"), *(len(v) for v in shown.values()))
        lines = [f"{'key':<{kw}}  {'value':<{vw}}  source", f"{'-' * kw}  {'-' * vw}  ------"]
        lines += [f"{k:<{kw}}  {shown[k]:<{vw}}  {self.sources[k]}" for k in ALL_KEYS]
        if self.preset:
            lines.append(f"preset: {self.preset}")
        return "\n".join(lines)


def resolve(generation_config: dict[str, Any] | None, preset: str | None, flags: dict[str, Any]) -> Resolved:
    """Resolve built-in defaults < checkpoint generation_config.json < preset < flags.

    `flags` maps preset keys to values; None means "not given". Unknown flag keys are an error (a
    misspelt key from a caller must not silently leave a default in place). Every value is coerced
    at its source, so a type error names where it came from; the final settings are validated and a
    range error also names the source of the offending value.
    """
    types = {**_field_types(DiffusionEbParams), **_field_types(RunSettings)}
    values: dict[str, Any] = {
        **dataclasses.asdict(DiffusionEbParams()),
        **dataclasses.asdict(RunSettings()),
    }
    sources: dict[str, Source] = {k: "default" for k in ALL_KEYS}
    origins: dict[str, str] = {k: "the built-in default" for k in ALL_KEYS}

    def apply(layer: dict[str, Any], source: Source, origin: str) -> None:
        for key, value in layer.items():
            if value is None:
                continue
            values[key] = _coerce(key, value, types[key], origin)
            sources[key], origins[key] = source, origin

    if generation_config is not None:
        apply(from_generation_config(generation_config), "checkpoint", "the checkpoint's generation_config.json")
    preset_path = None
    if preset is not None:
        preset_path = str(_preset_path(preset))
        apply(load_preset(preset_path), "preset", f"preset {preset_path}")
    _reject_unknown(flags, ALL_KEYS, "flags")
    apply(flags, "flag", "a command-line flag")

    try:
        params = DiffusionEbParams(**{k: values[k] for k in PARAM_KEYS})
        params.validate()
        run = RunSettings(**{k: values[k] for k in RUN_KEYS})
        run.validate()
    except SettingsError as e:
        raise SettingsError(e.key, f"{e} [{e.key} from {origins.get(e.key, 'unknown')}]") from None
    return Resolved(params=params, run=run, sources=sources, preset=preset_path)


def blocks_for(params: DiffusionEbParams, max_tokens: int | None, canvas_length: int) -> int:
    """How many blocks (canvases) to generate.

    `params.max_blocks` when it is > 0 (the default, 1, is one canvas whatever max_tokens says);
    when it is 0, `ceil(max_tokens / canvas_length)` — HF's rule (spec §7.1: 256 new tokens on a
    256 canvas = 1 block). `max_tokens` should be the resolved `RunSettings.max_tokens`, which
    defaults to the checkpoint's `max_new_tokens`; None means one canvas, i.e. 1 block.
    """
    if canvas_length < 1:
        raise ValueError(f"canvas_length must be >= 1, got {canvas_length}")
    if params.max_blocks > 0:
        return params.max_blocks
    if max_tokens is None:
        return 1
    if max_tokens < 1:
        raise SettingsError("max_tokens", f"max_tokens={max_tokens}: must be >= 1; set {_fix('max_tokens')} to 1 or more")
    return -(-max_tokens // canvas_length)


# ---------------------------------------------------------------------------------------------
# Sweep grids
# ---------------------------------------------------------------------------------------------

_GRID_SYNTAX = "comma list and/or inclusive ranges a-b+step, e.g. 8,16,32 or 8-48+8 or 0.05-0.2+0.05 or 4,8-16+4"
_NUM = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_RANGE_RE = re.compile(rf"^{_NUM}-{_NUM}\+{_NUM}$")
_MAX_GRID = 10_000  # a typo like 0-1e9+1 should be an error, not a sweep that never ends


def parse_grid_values(spec: str, kind: type) -> list:
    """Parse a sweep axis: `8,16,32`, `8-48+8` (inclusive), `0.05-0.2+0.05`, or mixes (`4,8-16+4`).

    `kind` is int, float or str (str: comma list only). Ranges are computed in decimal arithmetic so
    0.05-0.2+0.05 gives exactly [0.05, 0.1, 0.15, 0.2] with no float drift and the end included when
    the steps land on it. Duplicates are dropped, first occurrence kept. A bad spec is a `UserError`
    quoting it and showing the syntax.
    """
    def bad(why: str) -> UserError:
        return UserError(f"bad grid {spec!r}: {why}; use a {_GRID_SYNTAX}")

    if kind not in (int, float, str):
        raise TypeError(f"parse_grid_values: kind must be int, float or str, not {kind!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise bad("empty")
    out: list = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise bad("empty item between commas")
        if kind is str:
            out.append(item)
            continue
        m = _RANGE_RE.match(item)
        if m:
            a, b, step = (Decimal(g) for g in m.groups())
            if step <= 0:
                raise bad(f"step of {item!r} must be > 0")
            if b < a:
                raise bad(f"range {item!r} runs backwards (write the smaller number first)")
            count = int((b - a) / step) + 1
            if len(out) + count > _MAX_GRID:
                raise bad(f"range {item!r} has {count} values (limit {_MAX_GRID})")
            nums = [a + i * step for i in range(count)]
        else:
            try:
                nums = [Decimal(item)]
            except InvalidOperation:
                raise bad(f"{item!r} is neither a number nor a range") from None
            if not nums[0].is_finite():
                raise bad(f"{item!r} is not a finite number")
        for n in nums:
            if kind is int:
                if n != n.to_integral_value():
                    raise bad(f"{item!r} gives {n}, but this setting takes whole numbers")
                out.append(int(n))
            else:
                out.append(float(n))
    return list(dict.fromkeys(out))
