"""GGML quantized weights in the model: `QuantLinear` and `QuantExperts` compute with the block formats GGUF files
store (Q8_0, Q4_K, Q6_K; Q4_0, Q5_0), kept quantized, swapped into the model tree as model/fp8.py's modules are.
Must not: read or write files, know tensor names, or hold the kernels (kernels/ggml_cpu.py) or the block layouts
and decoders (kernels/ggml_blocks.py, re-exported here); the encoders are dgcli/checkpoint/ggml_quants.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dgcli.kernels.ggml_blocks import (  # noqa: F401 (the block formats: re-exported)
    F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, BF16, NAMES, BLOCKS, QUANTIZED, row_bytes, fits, q4k_pack_scales,
    dequantize)
from dgcli.model import fp8


def _hold(module: nn.Module, prefix: str, p) -> None:
    """A prepared matrix's tensors as buffers (they follow .to() and count in memory reports), its metadata kept."""
    module.register_buffer(f"{prefix}_packed", p.packed)
    module.register_buffer(f"{prefix}_sz", p.sz)
    module._meta[prefix] = (p.kind, p.qtype, p.n, p.k)


def _prepare(raw, qtype: int, k: int, dtype: torch.dtype):
    """GGUF bytes -> the kernels' form; a form given already built (a mapped cache's: checkpoint/mapped.py) as is."""
    from dgcli.kernels import ggml_cpu

    return raw if isinstance(raw, ggml_cpu.Prepared) else ggml_cpu.prepare(raw, qtype, k, dtype)


def _held(module: nn.Module, prefix: str):
    """The prepared matrix over the module's current buffers, kept between calls (built again only where .to()
    or a state-dict load replaced a buffer): ~4 µs a call otherwise, ~200 calls a decoder pass."""
    packed, sz = module._buffers[prefix + "_packed"], module._buffers[prefix + "_sz"]
    p = module._prepared.get(prefix)
    if p is None or p.packed is not packed or p.sz is not sz:
        from dgcli.kernels.ggml_cpu import Prepared

        p = module._prepared[prefix] = Prepared(*module._meta[prefix], packed, sz)
    return p


def activation_path(model: nn.Module) -> str | None:
    """What a model's GGML weights are multiplied by here, for bench records: `activations_on`'s answer; None when no
    weight is GGML, or `model` holds no modules (a Ray driver's stand-in: dgcli/cluster/worker.py)."""
    if not isinstance(model, nn.Module) or not any(isinstance(m, _Quantized) for m in model.modules()):
        return None
    return activations_on(model.embed_weight.dtype, model.embed_weight.device)


def activations_on(dtype: torch.dtype, device: torch.device) -> str:
    """"int8" (bf16 activations on a CPU with the int8 kernel, kernels/ggml_q8.py: rounded per group of 32), else
    the activations' dtype name."""
    from dgcli.kernels import ggml_q8

    if dtype == torch.bfloat16 and device.type == "cpu" and ggml_q8.available():
        return "int8"
    return str(dtype).removeprefix("torch.")


class _Quantized(nn.Module):
    """What QuantLinear and QuantExperts share: the prepared matrices' metadata (`_hold`) and the ones `_held`
    keeps between calls, dropped when .to() / .float() / ... replaces the buffers (no old copy stays alive)."""

    def __init__(self):
        super().__init__()
        self._meta, self._prepared = {}, {}

    def _apply(self, fn, recurse=True):
        self._prepared.clear()
        return super()._apply(fn, recurse)


class QuantLinear(_Quantized):
    """A bias-free linear whose weight [out, in] is GGML blocks (`raw` uint8 [out, row_bytes]), held in the kernels'
    compute form built at load with scales in `dtype` (the activations' dtype); the raw bytes are not kept."""

    def __init__(self, raw: torch.Tensor, qtype: int, in_features: int, out_features: int,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        from dgcli.kernels import ggml_cpu

        if not isinstance(raw, ggml_cpu.Prepared) and tuple(raw.shape) != (out_features,
                                                                           row_bytes(qtype, in_features)):
            raise ValueError(f"{NAMES.get(qtype, qtype)} weight bytes {tuple(raw.shape)} for [{out_features}, "
                             f"{in_features}]")
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        _hold(self, "weight", _prepare(raw, qtype, in_features, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dgcli.kernels import ggml_cpu

        return ggml_cpu.linear(x, _held(self, "weight"))

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in float32, as the kernel sees it (tests, and converting back to a plain model)."""
        from dgcli.kernels import ggml_cpu

        return ggml_cpu.dequantize_prepared(_held(self, "weight"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {NAMES[self.qtype]}"


class QuantExperts(_Quantized):
    """`gemma.Experts` with GGML weights: gate_up [E, 2I, H] (gate rows first) and down [E, H, I], each in its own
    type (a Q4_K_M file mixes Q4_K and Q6_K)."""

    def __init__(self, gate_up: torch.Tensor, gate_up_type: int, down: torch.Tensor, down_type: int,
                 hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        from dgcli.kernels import ggml_cpu

        built = isinstance(gate_up, ggml_cpu.Prepared)  # forms from a mapped cache (checkpoint/mapped.py)
        e = gate_up.packed.shape[0] if built else gate_up.shape[0]
        if not built and (tuple(gate_up.shape) != (e, 2 * inter, row_bytes(gate_up_type, hidden)) or
                          tuple(down.shape) != (e, hidden, row_bytes(down_type, inter))):
            raise ValueError(f"expert weight bytes {tuple(gate_up.shape)}, {tuple(down.shape)} for E={e}, "
                             f"H={hidden}, I={inter}")
        self.num_experts, self.hidden, self.inter = e, hidden, inter
        self.types = (gate_up_type, down_type)
        _hold(self, "gate_up", _prepare(gate_up, gate_up_type, hidden, dtype))
        _hold(self, "down", _prepare(down, down_type, inter, dtype))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        from dgcli.kernels import ggml_cpu

        return ggml_cpu.experts(x, w, idx, _held(self, "gate_up"), _held(self, "down"), self.inter)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in float32, as the kernel sees them."""
        from dgcli.kernels import ggml_cpu

        return (ggml_cpu.dequantize_prepared(_held(self, "gate_up")),
                ggml_cpu.dequantize_prepared(_held(self, "down")))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"{NAMES[self.types[0]]}/{NAMES[self.types[1]]}")


quantized_names = functools.partial(fp8.quantized_names, kinds=(_Quantized,))
