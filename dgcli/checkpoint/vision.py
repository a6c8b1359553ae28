"""The checkpoint's vision tower and projector (`VISION` keys), the model's `vision` (model/vision.py), in the model's
dtype, never quantized. Owns: `vision_config` (config.json -> VisionConfig and the image token ids) and `new_vision`.
Must not: do math, or read files (directory.py reads the tensors).
"""

from __future__ import annotations

import torch

from dgcli.errors import UserError
from dgcli.model.config import ModelConfig
from dgcli.model.vision import VisionConfig, VisionEncoder

VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def vision_config(cfg: ModelConfig, source: str = "config.json") -> VisionConfig | None:
    """The tower's shape from config.json's `vision_config` (None without one)."""
    raw, v = cfg.raw, cfg.raw.get("vision_config")
    if not isinstance(v, dict):
        return None
    try:
        rope = v.get("rope_parameters") or {}
        if v.get("use_clipped_linears"):
            raise UserError(f"{source}: vision_config.use_clipped_linears is true; dgemma runs unclipped towers")
        return VisionConfig(
            hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_hidden_layers=int(v["num_hidden_layers"]), num_attention_heads=int(v["num_attention_heads"]),
            num_key_value_heads=int(v.get("num_key_value_heads", v["num_attention_heads"])),
            head_dim=int(v.get("head_dim") or int(v["hidden_size"]) // int(v["num_attention_heads"])),
            patch_size=int(v.get("patch_size", 16)), pooling_kernel_size=int(v.get("pooling_kernel_size", 3)),
            position_embedding_size=int(v.get("position_embedding_size", 10240)),
            rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)), rope_theta=float(rope.get("rope_theta", 100.0)),
            standardize=bool(v.get("standardize", False)),
            soft_tokens=int(raw.get("vision_soft_tokens_per_image", v.get("default_output_length", 280))),
            text_hidden_size=cfg.hidden_size, image_token_id=int(raw.get("image_token_id", 258880)),
            bidirectional=(raw.get("text_config") or {}).get("use_bidirectional_attention") == "vision")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source}: vision_config is malformed ({e}); is the config complete?") from None


def image_token_ids(cfg: ModelConfig) -> tuple[int, int, int]:
    """(begin-of-image, image placeholder, end-of-image) ids from config.json."""
    r = cfg.raw
    return int(r.get("boi_token_id", 255999)), int(r.get("image_token_id", 258880)), int(r.get("eoi_token_id", 258882))


def new_vision(cfg: ModelConfig, source: str = "config.json") -> VisionEncoder | None:
    """The tower and projector config.json describes, on the meta device (None without a vision_config)."""
    from dgcli.checkpoint.meta import _no_init

    vc = vision_config(cfg, source)
    if vc is None:
        return None
    with torch.device("meta"), _no_init():
        return VisionEncoder(vc)
