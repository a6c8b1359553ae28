"""Run settings and the precedence that fills them: built-in defaults < the checkpoint's generation_config.json <
preset < flags (or a request's fields), with the source of every value, and the block count rule.

Owns: `RunSettings` (device, dtype, token budget, prompt set, thinking), presets (`presets/*.yaml`), mapping a
checkpoint's generation_config.json, `resolve`. The sampler's knobs and their validator are `DiffusionEbParams`'s.
Unknown keys in presets and flags are errors (a typo must not silently change a benchmark); unknown keys in
generation_config.json are ignored (the checkpoint is not ours).
Must not: import torch, touch a device, read checkpoints (callers pass the parsed JSON), or print.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dgcli.errors import UserError
from dgcli.sampling.params import (
    DiffusionEbParams, SettingsError, check_limits, check_type, coerce, field_types, hint,
    reject_unknown, suggest,
)

Source = Literal["default", "checkpoint", "preset", "flag"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


@dataclass(frozen=True)
class RunSettings:
    """Run settings a preset may also carry."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | bfloat16 | float32
    # The token budget: answers are cut there and, while max_blocks is 0, it sets the block count; None: no budget.
    # `example` is what a hint suggests instead.
    max_tokens: int | None = field(default=None, metadata={"example": 256})
    # Path of a prompt file (relative paths in a preset: to the preset's folder).
    prompt_set: str | None = field(default=None, metadata={"what": "the path of a prompt file"})
    thinking: bool = False

    def validate(self) -> None:
        """Raise `SettingsError` (a `UserError`) naming the first impossible value and the fix."""
        for key in field_types(type(self)):
            check_type(self, key)
        check_limits(self)
        if not _DEVICE_RE.match(self.device):
            raise SettingsError("device", f"device={self.device!r}: not a device (one of {', '.join(DEVICE_CHOICES)}); {hint(RunSettings, 'device')}")
        if self.dtype not in DTYPE_CHOICES:
            close = suggest(self.dtype, DTYPE_CHOICES)
            raise SettingsError("dtype", f"dtype={self.dtype!r}: unsupported{close} (one of {', '.join(DTYPE_CHOICES)}); {hint(RunSettings, 'dtype')}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SettingsError("max_tokens", f"max_tokens={self.max_tokens}: must be >= 1; {hint(RunSettings, 'max_tokens')}")
        if self.prompt_set is not None and not self.prompt_set.strip():
            raise SettingsError("prompt_set", f"prompt_set={self.prompt_set!r}: empty; {hint(RunSettings, 'prompt_set')}")


PARAM_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DiffusionEbParams))
RUN_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunSettings))
ALL_KEYS: tuple[str, ...] = PARAM_KEYS + RUN_KEYS


# ---- generation_config.json (spec §2) ----

_GEN_DIRECT = ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")
_EB_SAMPLER = "EntropyBoundSamplerConfig"


def from_generation_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's generation_config.json in our keys, values as found (`resolve` checks them): the sampler's,
    and `max_tokens` from `max_new_tokens`. `entropy_bound` only from the entropy-bound sampler's `sampler_config`
    (another sampler's bound would mean something else)."""
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


# ---- presets ----


def preset_dirs() -> list[Path]:
    """Where named presets live: the checkout's presets/, then dgcli/presets/ (a wheel's package data)."""
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
        if path.exists() and not (path.is_file() or path.is_fifo()):  # /dev/null, a folder: there, but no preset
            what = "a folder" if path.is_dir() else "not a regular file"
            raise UserError(f"preset file {text!r} is {what}; pass a YAML file of 'key: value' lines or a preset name "
                            f"({', '.join(list_presets()) or 'none shipped'})")
        if not path.exists():
            raise UserError(f"preset file {text!r} not found; pass an existing YAML file or a preset name ({', '.join(list_presets()) or 'none shipped'})")
        return path
    for d in preset_dirs():
        if (d / f"{text}.yaml").is_file():
            return d / f"{text}.yaml"
    available = ", ".join(list_presets()) or "none shipped"
    raise UserError(f"unknown preset {text!r}{suggest(text, list_presets())}; available presets: {available} (or pass a path to a .yaml file)")


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset by name (presets/NAME.yaml) or path: flat settings keys, values as written (`resolve` checks them),
    but a relative `prompt_set` read from the preset's folder. A bad file is one `UserError` naming it."""
    import yaml  # here, not at import: most runs read no preset (start-up time)

    path = _preset_path(name_or_path)

    class Strict(yaml.SafeLoader):  # a key set twice is an error: the later line must not silently win
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise UserError(f"preset {path}: '{key}' is set twice (again at line {key_node.start_mark.line + 1}); "
                                    "keep one line")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=Strict)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"preset {path}: malformed YAML{where}; fix the file (flat 'key: value' lines)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"preset {path}: cannot read it ({e}); check the path and permissions") from None
    if data is None:  # an empty file (or comments only) is a preset that was never filled in, or a wrong file
        raise UserError(f"preset {path}: the file is empty; write the settings as flat 'key: value' lines "
                        "(e.g. max_denoising_steps: 24)")
    if not isinstance(data, dict):
        raise UserError(f"preset {path}: expected flat 'key: value' lines, found a {type(data).__name__}; fix the file")
    reject_unknown(data, ALL_KEYS, f"preset {path}")
    ps = data.get("prompt_set")
    if isinstance(ps, str) and ps.strip() and not Path(ps).expanduser().is_absolute():
        data["prompt_set"] = str((path.parent / ps).resolve())
    if isinstance(ps, str) and ps.strip() and not Path(data["prompt_set"]).expanduser().is_file():
        raise UserError(f"preset {path}: prompt_set {ps}: no such file (a relative path is read from the preset's "
                        f"folder, {path.parent}); fix the path or drop the line")
    return data


# ---- resolution ----


@dataclass(frozen=True)
class Resolved:
    """The settings a run uses, and where each value came from."""

    params: DiffusionEbParams
    run: RunSettings
    sources: dict[str, Source]
    preset: str | None = None  # path of the preset file used, if any
    # (tokens, source) of a budget a higher-ranked max_blocks lifted (see `resolve`), for `blocks` to say so.
    lifted_budget: tuple[int, Source] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"params": dataclasses.asdict(self.params), "run": dataclasses.asdict(self.run),
                "sources": dict(self.sources), "preset": self.preset}

    def blocks(self, canvas_length: int) -> dict[str, Any]:
        """The block count, its source and the rule in words, e.g. {"value": 4, "source": "checkpoint", "rule":
        "ceil(max_tokens 64 / canvas 16)"}."""
        n = blocks_for(self.params, self.run.max_tokens, canvas_length)
        if self.params.max_blocks > 0:
            rule = f"max_blocks {n}"
            if self.lifted_budget:
                rule += f" (outranks the {self.lifted_budget[1]}'s {self.lifted_budget[0]}-token budget, which no longer cuts)"
            return {"value": n, "source": self.sources["max_blocks"], "rule": rule}
        if self.run.max_tokens is None:
            return {"value": n, "source": "default", "rule": "no token budget anywhere: one canvas"}
        rule = f"ceil(max_tokens {self.run.max_tokens} / canvas {canvas_length})"
        return {"value": n, "source": self.sources["max_tokens"], "rule": rule}

    def describe(self, canvas_length: int | None = None) -> str:
        """The `--show-config` table (key, value, source); with the canvas length, a last row for the block count."""
        values = {**dataclasses.asdict(self.params), **dataclasses.asdict(self.run)}
        shown = {k: "(none)" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}
        srcs = dict(self.sources)
        keys = list(ALL_KEYS)
        if canvas_length is not None:
            b = self.blocks(canvas_length)
            shown["blocks"], srcs["blocks"] = str(b["value"]), f"{b['source']}: {b['rule']}"
            keys.append("blocks")
        kw = max(len("key"), *(len(k) for k in shown))
        vw = max(len("value"), *(len(v) for v in shown.values()))
        lines = [f"{'key':<{kw}}  {'value':<{vw}}  source", f"{'-' * kw}  {'-' * vw}  ------"]
        lines += [f"{k:<{kw}}  {shown[k]:<{vw}}  {srcs[k]}" for k in keys]
        if self.preset:
            lines.append(f"preset: {self.preset}")
        return "\n".join(lines)


def resolve(generation_config: dict[str, Any] | None, preset: str | None, flags: dict[str, Any]) -> Resolved:
    """Resolve built-in defaults < checkpoint generation_config.json < preset < flags (preset keys; None: not
    given; an unknown key is an error). Every value is coerced at its source and every error names the sources of
    the values its rule involves."""
    owner = {**{k: DiffusionEbParams for k in PARAM_KEYS}, **{k: RunSettings for k in RUN_KEYS}}
    values: dict[str, Any] = {
        **dataclasses.asdict(DiffusionEbParams()),
        **dataclasses.asdict(RunSettings()),
    }
    sources: dict[str, Source] = {k: "default" for k in ALL_KEYS}
    origins: dict[str, str] = {k: "the built-in default" for k in ALL_KEYS}

    wrong_type: list[tuple[str, Any, str]] = []  # (key, value, origin) of values that are not of their type

    def apply(layer: dict[str, Any], source: Source, origin: str) -> None:
        for key, value in layer.items():
            if value is None:
                continue
            try:
                values[key] = coerce(owner[key], key, value, origin)
            except SettingsError:
                wrong_type.append((key, value, origin))
                continue
            sources[key], origins[key] = source, origin

    if generation_config is not None:
        apply(from_generation_config(generation_config), "checkpoint", "the checkpoint's generation_config.json")
    preset_path = None
    if preset is not None:
        # absolute ("./fast" stays the file, not the name) but not resolved: `--preset <(...)` is /dev/fd/N, whose
        # target (/proc/PID/fd/pipe:[...]) cannot be opened by name
        preset_path = str(_preset_path(preset).absolute())
        apply(load_preset(preset_path), "preset", f"preset {preset_path}")
    reject_unknown(flags, ALL_KEYS, "flags")
    apply(flags, "flag", "a command-line flag")
    if wrong_type:
        # Raised once every layer is in, so the hint fits the other settings (t_min="x" with --t-max 0.3).
        key, value, origin = wrong_type[0]
        coerce(owner[key], key, value, origin, current=values)  # raises the SettingsError again, with that hint

    # A block count from a higher layer than the token budget wins over it whole: `--blocks 8` on a checkpoint
    # whose max_new_tokens is 64 means 8 canvases of answer, not 8 canvases cut at 64 tokens. A budget from
    # the same layer or above (--blocks 8 --max-tokens 50) still cuts.
    lifted = None
    rank = {"default": 0, "checkpoint": 1, "preset": 2, "flag": 3}
    blocks = values["max_blocks"]
    if (isinstance(blocks, int) and blocks > 0 and values["max_tokens"] is not None
            and rank[sources["max_blocks"]] > rank[sources["max_tokens"]]):
        lifted = (values["max_tokens"], sources["max_tokens"])
        values["max_tokens"], sources["max_tokens"] = None, sources["max_blocks"]

    try:
        params = DiffusionEbParams(**{k: values[k] for k in PARAM_KEYS})
        params.validate()
        run = RunSettings(**{k: values[k] for k in RUN_KEYS})
        run.validate()
    except SettingsError as e:
        where = ", ".join(f"{k} from {origins.get(k, 'unknown')}" for k in e.keys)
        raise SettingsError(e.key, f"{e} [{where}]", also=e.keys[1:]) from None
    return Resolved(params=params, run=run, sources=sources, preset=preset_path, lifted_budget=lifted)


def blocks_for(params: DiffusionEbParams, max_tokens: int | None, canvas_length: int) -> int:
    """How many blocks (canvases) to generate: `params.max_blocks` when > 0, else ceil(max_tokens / canvas_length)
    (HF's rule, spec §7.1), else (no budget anywhere) 1. A `max_blocks` from a higher layer than the budget lifts
    the budget whole (`resolve`); `Resolved.blocks` says which applied."""
    if canvas_length < 1:
        raise ValueError(f"canvas_length must be >= 1, got {canvas_length}")
    if params.max_blocks > 0:
        return params.max_blocks
    if max_tokens is None:
        return 1
    if max_tokens < 1:
        raise SettingsError("max_tokens", f"max_tokens={max_tokens}: must be >= 1; {hint(RunSettings, 'max_tokens')}")
    return -(-max_tokens // canvas_length)


def token_budget(max_tokens: int | None, num_blocks: int, canvas_length: int) -> int:
    """The most answer tokens a run can give: its blocks' canvases, cut at max_tokens when that is lower."""
    room = num_blocks * canvas_length
    return room if max_tokens is None else min(max_tokens, room)
