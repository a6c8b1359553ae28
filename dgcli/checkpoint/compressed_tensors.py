"""Compressed-tensors checkpoints: their per-expert tensor names (`experts.{i}.gate_proj/up_proj/down_proj`,
llm-compressor's DiffusionGemma expert linearisation) <-> the model's fused layout, and the `quantization_config`
dgemma writes. Must not: run the math.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from dgcli.model.fp8 import FP8Experts

EXPERT_KEY = re.compile(r"^layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale)$")
# Written as compressed-tensors writes it (0.20.0: module names of the unquantized Linears expanded);
# the vision tower's Linears by pattern, since dgemma never enumerates them.
CT_VERSION = "0.20.0"


def expert_slot(name: str, inter: int) -> tuple[str, int, slice] | None:
    """A per-expert module key (`layers.L.experts.i.gate_proj.weight`, or `.weight_scale`) -> (the fused
    tensor's name, expert i, its rows there); None for any other name."""
    m = EXPERT_KEY.match(name)
    if m is None:
        return None
    layer, e, part, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    fused = "gate_up_proj" if part in ("gate", "up") else "down_proj"
    rows = slice(inter, 2 * inter) if part == "up" else slice(0, inter) if part == "gate" else slice(None)
    return f"layers.{layer}.experts.{fused}" + ("_scale" if kind == "weight_scale" else ""), e, rows


def expert_keys(layer: int, e: int, quantized: bool) -> list[str]:
    """The per-expert module keys of expert e of a layer (what one fused expert holds)."""
    kinds = ("weight", "weight_scale") if quantized else ("weight",)
    return [f"layers.{layer}.experts.{e}.{p}_proj.{k}" for p in ("gate", "up", "down") for k in kinds]


def per_expert(t: torch.Tensor, fused: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused expert tensor (`gate_up_proj` [E, 2I, ...] or `down_proj`, or its scale) as its per-expert linears'
    (`{e}.gate_proj`, rows), (`{e}.up_proj`, rows), ... (the inverse of `expert_slot`)."""
    inter = t.shape[1] // 2
    for e in range(t.shape[0]):
        parts = {"gate": t[e, :inter], "up": t[e, inter:]} if fused.startswith("gate_up") else {"down": t[e]}
        yield from ((f"{e}.{part}_proj", v) for part, v in parts.items())


def unfused_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state under module names with FP8 experts unfused into per-expert linears."""
    state = {}
    for name, t in model.state_dict().items():
        head, _, leaf = name.rpartition(".experts.")
        if leaf.removesuffix("_scale") in ("gate_up_proj", "down_proj") and isinstance(
                model.get_submodule(f"{head}.experts"), FP8Experts):
            suffix = "weight_scale" if leaf.endswith("_scale") else "weight"
            state.update((f"{head}.experts.{sub}.{suffix}", v) for sub, v in per_expert(t, leaf))
        else:
            state[name] = t
    return state


def quantization_config(num_layers: int, *, vision: bool = True, nvfp4: bool = False) -> dict:
    """config.json's `quantization_config` for an FP8-dynamic (or `nvfp4`: NVFP4A16) DiffusionGemma, key for key as
    compressed-tensors writes FP8_DYNAMIC (ModelCompressor.update_config): per-channel e4m3 weights, per-token dynamic e4m3
    activations, and the unquantized Linears in `ignore` (checkpoint module names)."""
    # transformers' module tree has the encoder's tied copies of the layers (model.encoder.language_model):
    # compressed-tensors lists their routers too, or a compressed load expects scales for them.
    ignore = ["lm_head"] + [f"model.{part}.layers.{i}.router.proj" for part in ("decoder", "encoder.language_model")
                            for i in range(num_layers)]
    ignore += [f"model.decoder.self_conditioning.{p}_proj" for p in ("gate", "up", "down")]
    if vision:
        ignore += ["model.encoder.embed_vision.embedding_projection", "re:.*vision_tower.*"]
    fp8 = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "channel", "symmetric": True,
           "type": "float"}
    act = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True,
           "type": "float"}
    fmt = "float-quantized"
    if nvfp4:  # NVFP4A16 (compressed_tensors.quantization.quant_scheme): e2m1 groups of 16, e4m3 scales, a global
        fp8, act, fmt = dict(fp8, num_bits=4, strategy="tensor_group", group_size=16), None, "nvfp4-pack-quantized"
    return {"config_groups": {"group_0": {"format": fmt, "input_activations": act,
                                          "output_activations": None, "targets": ["Linear"], "weights": fp8}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "moe_sparsity_config": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": CT_VERSION}
