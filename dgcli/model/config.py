"""Model configuration: parse a checkpoint's `config.json` into one flat dataclass with the derived
per-layer geometry (spec §1). Unknown keys are ignored (the checkpoint is not ours); structure is never
derived from absent flags (K = V on full layers and MoE in every layer are always on).

Owns: reading config.json. Must not: read weights, touch torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgcli.errors import UserError

SLIDING = "sliding_attention"
FULL = "full_attention"
# The released checkpoint's rope_parameters (spec §1.2), also transformers' DiffusionGemmaConfig
# default; used when config.json has none, and written by `make_config`.
RELEASED_ROPE_PARAMETERS: dict[str, dict] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type. `rotary_pairs` of the head_dim/2 frequency pairs rotate; the rest pass
    through (proportional RoPE keeps the exponent denominator at the full head dim, spec §5.5)."""

    theta: float
    head_dim: int
    rotary_pairs: int  # the frequencies themselves: dgcli.model.gemma.inv_freq_for (fp32, as the reference)


@dataclass(frozen=True)
class LayerGeometry:
    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    window: int | None  # sliding window incl. self; None on full layers
    rope: RopeSpec
    has_v_proj: bool  # full layers take V from the raw K projection


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_global_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_experts: int
    top_k_experts: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    final_logit_softcapping: float | None
    canvas_length: int
    self_conditioning_size: int
    max_position_embeddings: int
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    dtype: str = "bfloat16"
    name: str = "diffusion_gemma"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def layer(self, i: int) -> LayerGeometry:
        if self.layer_types[i] == FULL:
            return LayerGeometry(FULL, self.global_head_dim, self.num_global_key_value_heads, None,
                                 self.rope_full, has_v_proj=False)
        return LayerGeometry(SLIDING, self.head_dim, self.num_key_value_heads, self.sliding_window,
                             self.rope_sliding, has_v_proj=True)

    @property
    def layers(self) -> list[LayerGeometry]:
        return [self.layer(i) for i in range(self.num_hidden_layers)]


def _rope(params: dict, head_dim: int, what: str) -> RopeSpec:
    kind = params.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise UserError(f"config.json: rope_type {kind!r} for {what} is not supported (default|proportional)")
    factor = float(params.get("partial_rotary_factor", 1.0))
    pairs = int(factor * head_dim // 2)
    return RopeSpec(theta=float(params.get("rope_theta", 10000.0)), head_dim=head_dim, rotary_pairs=pairs)


def _default_layer_types(n: int) -> list[str]:
    return [SLIDING if (i + 1) % 6 else FULL for i in range(n)]


def parse_config(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Flatten a DiffusionGemma `config.json` (top level + nested `text_config`)."""
    if raw.get("model_type") != "diffusion_gemma":
        raise UserError(
            f"{source}: model_type is {raw.get('model_type')!r}, not 'diffusion_gemma'; "
            "point --model at a DiffusionGemma checkpoint"
        )
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{source}: missing the nested 'text_config' object of a DiffusionGemma config")
    try:
        n_layers = int(text["num_hidden_layers"])
        head_dim = int(text.get("head_dim", 256))
        n_kv = int(text["num_key_value_heads"])
        layer_types = list(text.get("layer_types") or _default_layer_types(n_layers))
        # The reference forces the last layer to full attention.
        layer_types[-1] = FULL
        if len(layer_types) != n_layers or any(t not in (SLIDING, FULL) for t in layer_types):
            raise UserError(f"{source}: layer_types must list {n_layers} of {SLIDING!r}/{FULL!r}")
        # Two spellings exist: the released checkpoint's `global_head_dim`/`num_global_key_value_heads`,
        # and transformers' save_pretrained `per_layer_config` (full-layer overrides by index).
        global_head_dim = int(text.get("global_head_dim", 512))
        n_global_kv = text.get("num_global_key_value_heads")
        overrides = text.get("per_layer_config") or {}
        for idx, ov in overrides.items():
            if layer_types[int(idx)] == FULL:
                global_head_dim = int(ov.get("head_dim", global_head_dim))
                n_global_kv = ov.get("num_key_value_heads", n_global_kv)
        n_global_kv = int(n_global_kv) if n_global_kv is not None else n_kv
        if text.get("use_bidirectional_attention") == "all":
            raise UserError(f"{source}: use_bidirectional_attention='all' is not supported (text models use 'vision')")
        rope = text.get("rope_parameters") or RELEASED_ROPE_PARAMETERS
        eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
        eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        n_heads = int(text["num_attention_heads"])
        for kv in (n_kv, n_global_kv):
            if n_heads % kv:
                raise UserError(f"{source}: num_attention_heads {n_heads} is not a multiple of kv heads {kv}")
        return ModelConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            num_global_key_value_heads=n_global_kv,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_experts=int(text["num_experts"]),
            top_k_experts=int(text["top_k_experts"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            sliding_window=int(text.get("sliding_window", 1024)),
            layer_types=tuple(layer_types),
            rope_sliding=_rope(rope[SLIDING], head_dim, SLIDING),
            rope_full=_rope(rope[FULL], global_head_dim, FULL),
            final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
            canvas_length=int(raw.get("canvas_length", 256)),
            # No such key in the released checkpoint: the SC MLP width is intermediate_size (spec §1.1).
            self_conditioning_size=int(raw.get("self_conditioning_size", text["intermediate_size"])),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            pad_token_id=int(text.get("pad_token_id", 0) or 0),
            bos_token_id=int(text.get("bos_token_id", 2)),
            eos_token_ids=eos_ids,
            dtype=str(raw.get("dtype") or text.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            raw=raw,
        )
    except KeyError as e:
        raise UserError(f"{source}: text_config lacks the key {e.args[0]!r}") from None


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; a DiffusionGemma checkpoint directory needs it") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); re-download or fix the file") from None


def load_config(path: str | Path) -> ModelConfig:
    """`path` is a checkpoint directory or a config.json file."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such checkpoint directory; pass --model DIR holding config.json and *.safetensors")
    cfg_path = p / "config.json" if p.is_dir() else p
    return parse_config(read_json(cfg_path), source=str(cfg_path))


def load_generation_config(path: str | Path) -> dict | None:
    """The raw generation_config.json of a checkpoint directory, or None when it has none."""
    p = Path(path) / "generation_config.json"
    return read_json(p) if p.exists() else None


PACKAGED = Path(__file__).resolve().parents[1] / "data"


def real_config_path() -> Path:
    """The released 26B-A4B config.json shipped with dgemma (for --dummy and info)."""
    return PACKAGED / "diffusiongemma-26B-A4B" / "config.json"
