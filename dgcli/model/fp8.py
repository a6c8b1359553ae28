"""FP8 weights in the model: compressed-tensors' FP8-dynamic layout (float8_e4m3fn `weight`, one `weight_scale`
[out, 1] per output channel, in the source weights' dtype) held at 1 byte per parameter. Experts are fused in our
layout (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]; scales [E, 2I, 1], [E, H, 1]).
Quantized modules are swapped into the model tree (`convert_`, also NVFP4's): the model calls them as it calls
nn.Linear and Experts. Must not: read or write files, know checkpoint names, or run the math (kernels/ does).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dgcli.kernels import dispatch
from dgcli.kernels.fp8 import FP8, FP8_MAX

# The linears a quantized DiffusionGemma stores in FP8 (what llm-compressor's FP8_DYNAMIC recipe quantizes:
# every Linear but the router, the self-conditioning MLP, lm_head and the vision tower).
QUANTIZED = re.compile(r"^layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (q float8_e4m3fn, scale [..., out, 1] in w.dtype), as compressed-tensors quantizes FP8
    channels: scale = absmax / 448 in w's dtype (0 -> the dtype's eps), q = clamp(w / scale, +-448) rounded to e4m3."""
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


def convert_(model: nn.Module, linears: set[str], experts: set[int], arg, kinds: tuple = (FP8Linear, FP8Experts)
             ) -> None:
    """Swap the named bias-free nn.Linear modules and the experts of the given layers for their quantized twins
    `kinds` = (linear class, experts class), built with `arg` (FP8: the scale dtype; NVFP4: `divide`) on the old
    module's device (the loader does it on meta, before any tensor exists)."""
    for name in sorted(linears):
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear) or old.bias is not None:
            raise ValueError(f"{name} is not a bias-free linear")
        with torch.device(old.weight.device):
            _set(model, name, kinds[0](old.in_features, old.out_features, arg))
    for i in sorted(experts):
        old = model.layers[i].experts
        e, two_i, h = old.gate_up_proj.shape
        with torch.device(old.gate_up_proj.device):
            model.layers[i].experts = kinds[1](e, h, two_i // 2, arg)


def quantized_names(model: nn.Module, kinds: tuple = (FP8Linear, FP8Experts)) -> set[str]:
    """State-dict names of the `kinds` modules' buffers (kept as stored: never cast or drawn as plain weights)."""
    return {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, kinds)
            for b, _ in m.named_buffers(recurse=False)}


def is_fp8(model: nn.Module, kinds: tuple = (FP8Linear, FP8Experts)) -> bool:
    return any(isinstance(m, kinds) for m in model.modules())


def targets(model: nn.Module) -> tuple[set[str], set[int]]:
    """The linears and expert layers a quantized DiffusionGemma stores in FP8 (or NVFP4)."""
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
