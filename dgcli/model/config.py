"""The model's configuration: one flat dataclass with the derived per-layer geometry (spec §1), and the
quantization a checkpoint's weights carry (dgcli/checkpoint/config.py reads config.json into them).

Owns: `ModelConfig`, `LayerGeometry`, `RopeSpec`, `Quantization`, the layer kinds. Must not: read files, touch torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SLIDING = "sliding_attention"
FULL = "full_attention"


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
class Quantization:
    """A `quantization_config` dgemma runs (FP8 runs weight-only unless asked: DGEMMA_FP8, --fp8-activations)."""

    scheme: str  # "FP8_DYNAMIC", "FP8 weight-only", "NVFP4" (W4A4, run as W4A16), "NVFP4A16"
    ignore: tuple[str, ...] = ()
    layout: str = "compressed-tensors"  # NVFP4: or "modelopt" (`weight`, `weight_scale_2`; experts only)

    @property
    def nvfp4(self) -> bool:
        return self.scheme.startswith("NVFP4")


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
    eos_token_ids: tuple[int, ...] = (1,)
    dtype: str = "bfloat16"
    name: str = "diffusion_gemma"
    quantization: Quantization | None = None  # None: unquantized weights
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

