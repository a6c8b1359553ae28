"""GGML quantized weights in the model: the block formats GGUF files store (Q8_0, Q4_K, Q6_K; Q4_0, Q5_0) and
the modules that compute with them kept quantized.

Owns: `QuantLinear` and `QuantExperts` (swapped into the model tree as `fp8.py`'s modules are: the model's math calls them as it calls
nn.Linear and `gemma.Experts`). Must not: read or write files (dgcli/checkpoint/gguf.py does), know tensor
names, or hold the kernels (kernels/ggml_cpu.py does). The encoders (llama.cpp's reference quantizers, random
blocks, whole-model quantize / dequantize for tests and dummy weights) are dgcli/checkpoint/ggml_quants.py.
The block layouts and their decoders: kernels/ggml_blocks.py (re-exported here).
"""

from __future__ import annotations

import torch
from torch import nn

from dgcli.kernels.ggml_blocks import (  # noqa: F401 (the block formats: re-exported)
    F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, BF16, NAMES, BLOCKS, QUANTIZED, row_bytes, fits, _blocks, _f16,
    q4k_scale_min, q4k_pack_scales, q4k_nibbles, q40_values, q50_high, q6k_values, dequantize)


def _hold(module: nn.Module, prefix: str, p) -> None:
    """Register a prepared matrix's tensors as buffers (they follow .to() and count in memory reports) and
    remember its metadata."""
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
    """What a model's GGML weights are multiplied by on this machine, for bench records: "int8" (bf16 activations
    on a CPU with the int8 kernel: rounded per group of 32, kernels/ggml_q8.py; 1-2-row single-plane products
    stay bf16), else the activations' dtype name; None when no weight is GGML, or `model` holds no modules (a Ray
    driver's stand-in: dgcli/cluster/worker.py)."""
    if not isinstance(model, nn.Module) or not any(isinstance(m, _Quantized) for m in model.modules()):
        return None
    return activations_on(model.embed_weight.dtype, model.embed_weight.device)


def activations_on(dtype: torch.dtype, device: torch.device) -> str:
    """What GGML weights are multiplied by in a model of `dtype` on `device` (activation_path's rule)."""
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
    """A bias-free linear whose weight [out, in] stays in a GGML block format (`raw` uint8 [out, row_bytes]).
    forward(x [..., in]) -> [..., out] in x.dtype; the weight stays in its quantized form (a call dequantizes
    at most a tile of it into reused scratch, on the GEMM path for many rows: kernels/ggml_cpu.py).
    The compute form (kernels/ggml_cpu.py) is built here, at load, with scales in `dtype` (the activations'
    dtype: bf16 runs torch's int4 kernel); the raw bytes are not kept."""

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
    type (a Q4_K_M file mixes Q4_K and Q6_K). forward(x [N, H], w [N, k] fp32, idx [N, k]) -> [N, H] with
    `Experts.forward`'s semantics; only the routed experts' weights are touched."""

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


# llama.cpp's fallback where a row is not a multiple of 256 (llama_tensor_get_type's incompatible-shape switch)
FALLBACK = {Q4_K: Q5_0, Q6_K: Q8_0}


def type_for(qtype: int, k: int) -> int | None:
    """The type a row of k values gets when `qtype` is asked for: qtype, llama.cpp's fallback, or None."""
    for t in (qtype, FALLBACK.get(qtype)):
        if t is not None and fits(t, k):
            return t
    return None


def quantized_names(model: nn.Module) -> set[str]:
    """State-dict names of the GGML modules' buffers (not plain weights: randomize and cast must skip them)."""
    return {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))
            for b, _ in m.named_buffers(recurse=False)}


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers hold (quantized forms included)."""
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
