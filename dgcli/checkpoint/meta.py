"""The DiffusionGemma module tree on the meta device: what every checkpoint format builds first and then fills
(assigned from files, drawn at random, or converted), so no second full copy of the weights is ever made; and its
inverse, a quantized model as a plain one. Must not: read files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from dgcli.model.config import ModelConfig
from dgcli.model.gemma import DiffusionGemma

# torch.nn.init functions the modules' constructors call; skipped on the meta device (see `meta_model`).
_INIT_FNS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "ones_", "zeros_",
             "constant_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    saved = {n: getattr(nn.init, n) for n in _INIT_FNS}
    try:
        for n in _INIT_FNS:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def meta_model(cfg: ModelConfig) -> DiffusionGemma:
    """The module tree on the meta device, parameter init skipped: init ops on meta tensors go through
    torch._refs, which imports torch._dynamo (~1 s of start-up), and every value is assigned later anyway."""
    with torch.device("meta"), _no_init():
        return DiffusionGemma(cfg)


@torch.no_grad()
def dequantize_model(model: DiffusionGemma, dtype: torch.dtype | None = None) -> DiffusionGemma:
    """A plain model holding the weights the quantized modules compute with (FP8: e4m3 x scale, compressed-tensors'
    dequantize; GGML: as the kernels see them), in `dtype` (default: the embedding's): what they must equal."""
    from dgcli.kernels.fp8 import FP8, dequantize
    from dgcli.model.ggml import QuantExperts, QuantLinear, quantized_names

    dtype = dtype or model.embed_tokens.weight.dtype
    full, skip, state = model.state_dict(), quantized_names(model), {}
    for name, t in full.items():
        if name in skip or name.endswith("_scale") and full.get(name.removesuffix("_scale"), t).dtype == FP8:
            continue  # a GGML module's (below) or an FP8 weight's scale: `name + "_scale"` of its weight
        state[name] = dequantize(t, full[name + "_scale"], dtype) if t.dtype == FP8 else t.to(dtype)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            state[f"{name}.weight"] = m.dequantized().to(dtype)
        elif isinstance(m, QuantExperts):
            state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"] = (w.to(dtype) for w in m.dequantized())
    plain = meta_model(model.config)
    plain.load_state_dict(state, strict=True, assign=True)
    return plain.eval()
