"""FP8 weights in the model: compressed-tensors' FP8-dynamic layout (float8_e4m3fn `weight`, one
`weight_scale` [out, 1] per output channel, in the source weights' dtype) held at 1 byte per parameter.

A quantized checkpoint unfuses the experts into per-expert linears (`experts.{i}.gate_proj/up_proj/down_proj`,
llm-compressor's DiffusionGemma expert linearisation); in memory they are fused back into our layout
(gate_up_proj [E, 2I, H] with gate rows first, down_proj [E, H, I], scales [E, 2I, 1] and [E, H, 1]) so the
grouped expert kernels read them. Quantized linears and experts are modules swapped into the model tree
(`convert_`): the model's math calls them exactly as it calls nn.Linear and Experts.
Owns: `FP8Linear`, `FP8Experts`, `quantize_rows` (compressed-tensors' per-channel absmax quantization), the
per-expert <-> fused name map, the `quantization_config` dgemma writes, `quantize_model_`,
`dequantize_model` and `randomize_fp8_`. Must not: read or write files, or run the math (kernels/ does).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from dgcli.kernels import dispatch
from dgcli.kernels.fp8 import FP8, FP8_MAX, dequantize

# The linears a quantized DiffusionGemma stores in FP8 (what llm-compressor's FP8_DYNAMIC recipe quantizes:
# every Linear but the router, the self-conditioning MLP, lm_head and the vision tower).
QUANTIZED = re.compile(r"^layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
EXPERT_KEY = re.compile(r"^layers\.(\d+)\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale)$")
# Written as compressed-tensors writes it (0.20.0: module names of the unquantized Linears expanded);
# the vision tower's Linears by pattern, since dgemma never enumerates them.
CT_VERSION = "0.20.0"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (q float8_e4m3fn, scale [..., out, 1] in w.dtype), as compressed-tensors computes
    FP8 channel quantization (calculate_qparams + quantize): scale = absmax / 448 in w's dtype (0 -> the
    dtype's eps), q = clamp(w / scale, +-448) in w's dtype, rounded to e4m3."""
    absmax = w.abs().amax(dim=-1, keepdim=True)
    scale = absmax / torch.tensor(FP8_MAX, dtype=w.dtype, device=w.device)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype, device=w.device), scale)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class FP8Linear(nn.Module):
    """A bias-free linear with FP8 weights: weight [out, in] float8_e4m3fn, weight_scale [out, 1]."""

    def __init__(self, in_features: int, out_features: int, scale_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=scale_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_linear(x, self.weight, self.weight_scale)


class FP8Experts(nn.Module):
    """`gemma.Experts` with FP8 weights: gate_up_proj [E, 2I, H] and down_proj [E, H, I] float8_e4m3fn,
    one scale per output channel of each expert (gate_up_proj_scale [E, 2I, 1], down_proj_scale [E, H, 1])."""

    def __init__(self, num_experts: int, hidden: int, inter: int, scale_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        e, i, h = num_experts, inter, hidden
        self.register_buffer("gate_up_proj", torch.empty(e, 2 * i, h, dtype=FP8))
        self.register_buffer("gate_up_proj_scale", torch.empty(e, 2 * i, 1, dtype=scale_dtype))
        self.register_buffer("down_proj", torch.empty(e, h, i, dtype=FP8))
        self.register_buffer("down_proj_scale", torch.empty(e, h, 1, dtype=scale_dtype))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, H], routing weights w [N, k] fp32, expert ids idx [N, k] -> [N, H]."""
        return dispatch.fp8_experts(x, w, idx, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                    self.down_proj_scale)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def convert_(model: nn.Module, linears: set[str], experts: set[int], scale_dtype: torch.dtype) -> None:
    """Swap the named nn.Linear modules and the experts of the given layers for their FP8 twins (on the
    module's device: the loader does it on meta, before any tensor exists)."""
    for name in sorted(linears):
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear) or old.bias is not None:
            raise ValueError(f"{name} is not a bias-free linear")
        with torch.device(old.weight.device):
            _set(model, name, FP8Linear(old.in_features, old.out_features, scale_dtype))
    for i in sorted(experts):
        old = model.layers[i].experts
        e, two_i, h = old.gate_up_proj.shape
        with torch.device(old.gate_up_proj.device):
            model.layers[i].experts = FP8Experts(e, h, two_i // 2, scale_dtype)


def quantized_names(model: nn.Module) -> set[str]:
    """State-dict names of the FP8 tensors and their scales (kept as stored, never cast to the run dtype)."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, (FP8Linear, FP8Experts)):
            out |= {f"{name}.{b}" for b, _ in m.named_buffers(recurse=False)}
    return out


def is_fp8(model: nn.Module) -> bool:
    return any(isinstance(m, (FP8Linear, FP8Experts)) for m in model.modules())


# ---- per-expert checkpoint tensors <-> the fused layout ------------------------------------------------------


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


def unfused_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state under module names with FP8 experts unfused into per-expert linears."""
    state = {}
    for name, t in model.state_dict().items():
        head, _, leaf = name.rpartition(".experts.")
        if not head or leaf not in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
            state[name] = t
            continue
        if not isinstance(model.get_submodule(f"{head}.experts"), FP8Experts):
            state[name] = t
            continue
        suffix = "weight_scale" if leaf.endswith("_scale") else "weight"
        inter = t.shape[1] // 2
        for e in range(t.shape[0]):
            parts = {"gate": t[e, :inter], "up": t[e, inter:]} if leaf.startswith("gate_up") else {"down": t[e]}
            for part, v in parts.items():
                state[f"{head}.experts.{e}.{part}_proj.{suffix}"] = v
    return state


def quantization_config(num_layers: int, *, vision: bool = True) -> dict:
    """config.json's `quantization_config` for an FP8-dynamic DiffusionGemma, key for key as compressed-tensors
    writes FP8_DYNAMIC (ModelCompressor.update_config): per-channel e4m3 weights, per-token dynamic e4m3
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
    return {"config_groups": {"group_0": {"format": "float-quantized", "input_activations": act,
                                          "output_activations": None, "targets": ["Linear"], "weights": fp8}},
            "format": "float-quantized", "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "moe_sparsity_config": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": CT_VERSION}


# ---- whole models ----------------------------------------------------------------------------------------------


def targets(model: nn.Module) -> tuple[set[str], set[int]]:
    """The linears and expert layers a quantized DiffusionGemma stores in FP8."""
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and QUANTIZED.match(n)}
    return linears, set(range(len(model.layers)))


@torch.no_grad()
def quantize_model_(model: nn.Module) -> nn.Module:
    """Quantize a materialised unquantized model in place, module by module (scales in the weights' dtype)."""
    linears, experts = targets(model)
    for name in sorted(linears):
        old = model.get_submodule(name)
        q, s = quantize_rows(old.weight)
        new = FP8Linear(old.in_features, old.out_features, s.dtype).to(q.device)
        new.weight, new.weight_scale = q, s
        _set(model, name, new)
    for i in sorted(experts):
        old = model.layers[i].experts
        e, two_i, h = old.gate_up_proj.shape
        new = FP8Experts(e, h, two_i // 2, old.gate_up_proj.dtype).to(old.gate_up_proj.device)
        new.gate_up_proj, new.gate_up_proj_scale = quantize_rows(old.gate_up_proj)
        new.down_proj, new.down_proj_scale = quantize_rows(old.down_proj)
        model.layers[i].experts = new
    return model


@torch.no_grad()
def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """An unquantized model holding the dequantized weights (e4m3 x scale, compressed-tensors' dequantize)
    in `dtype` (default: the embedding's): what weight-only FP8 semantics must equal."""
    from dgcli.model.loader import meta_model

    dtype = dtype or model.embed_tokens.weight.dtype
    plain = meta_model(model.config)
    state, full = {}, model.state_dict()
    for name, t in full.items():
        if t.dtype == FP8:  # its scale is `name + "_scale"` (weight_scale, gate_up_proj_scale, down_proj_scale)
            t = dequantize(t, full[name + "_scale"], dtype)
        elif name.endswith("_scale") and full.get(name.removesuffix("_scale"), t).dtype == FP8:
            continue
        state[name] = t.to(dtype)
    plain.load_state_dict(state, strict=True, assign=True)
    return plain.eval()


@torch.no_grad()
def randomize_fp8_(model: nn.Module, generator, std: float | None = None) -> None:
    """Random FP8 weights for dummy models: each matrix (one expert's at a time) drawn ~ N(0, 1/fan_in) in
    fp32 on its device, then quantized (the scales in their buffers' dtype)."""
    for m in model.modules():
        pairs = ([(m.weight, m.weight_scale)] if isinstance(m, FP8Linear) else
                 [(m.gate_up_proj, m.gate_up_proj_scale), (m.down_proj, m.down_proj_scale)]
                 if isinstance(m, FP8Experts) else [])
        for q, s in pairs:
            for qe, se in zip(q.view(-1, *q.shape[-2:]), s.view(-1, *s.shape[-2:])):
                w = torch.empty(qe.shape, device=qe.device).normal_(0.0, std or 1 / math.sqrt(qe.shape[-1]),
                                                                    generator=generator(qe.device))
                qq, ss = quantize_rows(w)
                qe.copy_(qq)
                se.copy_(ss)
