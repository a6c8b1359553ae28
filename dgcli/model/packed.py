"""A loaded model on CPU with its linear and expert weights prepacked: bf16 in oneDNN's blocked layout (same bits:
kernels/linear_cpu.py checks each weight shape against `F.linear` here and keeps it as stored where they differ),
fp32 as the C GEMM's panels (kernels/gemm_native.py: each output summed in k order, within fp32 rounding).

Owns: `pack_for_cpu(model)`, which swaps bf16 `nn.Linear` / `Experts` for `PackedLinear` / `PackedExperts` and fp32
ones for `NativeLinear` / `NativeExperts` (the stored weights dropped: no second copy), and says how many matrices
it packed; the embedding (the tied head) stays as stored. When: bf16 or fp32 sessions on CPU, eager (not
`--compile`, not DGEMMA_KERNELS=reference; fp32 only where the C GEMM is: not DGEMMA_KERNELS=torch).
Why: torch's bf16 GEMM re-lays the weight out on every call (costly for few rows: a ragged expert's), and MKL's
fp32 GEMM runs the bundled model's 16-128-row products at a third to two thirds of the core's rate
(benchmarks/RESULTS.md). Must not: touch FP8 modules. There is no way back: packed weights have no state_dict.
"""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as F

from dgcli.kernels import dispatch, gemm_native, linear_cpu, moe_cpu
from dgcli.model.gemma import Experts
from dgcli.model.ggml import _Quantized


class PackedLinear(nn.Module):
    """`nn.Linear` without bias whose weight [N, K] lives in oneDNN's blocked layout."""

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int):
        super().__init__()
        self.packed, self.in_features, self.out_features = packed, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_cpu.linear(x, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed (oneDNN)"


class PackedExperts(nn.Module):
    """`Experts` with expert e's gate_up [2I, H] and down [H, I] matrices packed one by one."""

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], inter: int):
        super().__init__()
        self.gate_up, self.down, self.inter = gate_up, down, inter

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return moe_cpu.experts_packed(x, w, idx, self.gate_up, self.down, self.inter)


class NativeLinear(nn.Module):
    """fp32 `nn.Linear` without bias whose weight [N, K] lives as the C GEMM's panels; a buffer, so `.to()` moves it
    (elsewhere, or with the kernel off: torch's GEMM on the weight unpacked per call)."""

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._buffers["packed"]  # not nn.Module.__getattr__ (~0.6 µs; ~35 of these a step)
        y = gemm_native.linear(x, packed, self.out_features)
        return F.linear(x, gemm_native.unpack(packed, self.out_features)) if y is None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed (C panels)"


class NativeExperts(nn.Module):
    """fp32 `Experts` with gate_up_proj [E, 2I, H] and down_proj [E, H, I] as the C GEMM's panels."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, hidden: int, inter: int):
        super().__init__()
        self.register_buffer("gate_up", gate_up, persistent=False)
        self.register_buffer("down", down, persistent=False)
        self.hidden, self.inter = hidden, inter

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        y = None
        gate_up, down = self._buffers["gate_up"], self._buffers["down"]  # not nn.Module.__getattr__
        if x.dtype == gate_up.dtype:
            y = moe_cpu.experts_native(x, w, idx, gate_up, down, self.inter)
        if y is None:  # the stored layout back (copies): the device's own path
            y = dispatch.experts(x, w, idx, gemm_native.unpack(gate_up, 2 * self.inter),
                                 gemm_native.unpack(down, self.hidden))
        return y


def _packed_linear(m: nn.Linear) -> PackedLinear | NativeLinear | None:
    if m.bias is not None:
        return None
    if _native_fp32(m.weight):
        return NativeLinear(gemm_native.pack(m.weight), m.in_features, m.out_features)
    p = linear_cpu.pack(m.weight)
    return None if p is None else PackedLinear(p, m.in_features, m.out_features)


def _native_fp32(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and gemm_native.available()


def _packed_experts(m: Experts) -> PackedExperts | NativeExperts | None:
    if _native_fp32(m.gate_up_proj):
        return NativeExperts(gemm_native.pack(m.gate_up_proj), gemm_native.pack(m.down_proj), m.down_proj.shape[1],
                             m.down_proj.shape[2])
    gate_up, down = [], []
    for e in range(m.gate_up_proj.shape[0]):  # every expert the same shapes: the first refusal decides
        gate_up.append(linear_cpu.pack(m.gate_up_proj[e]))
        down.append(linear_cpu.pack(m.down_proj[e]))
        if gate_up[-1] is None or down[-1] is None:
            return None
    return PackedExperts(gate_up, down, m.down_proj.shape[2])


@torch.no_grad()
def pack_for_cpu(model: nn.Module) -> int:
    """Swap the bf16 and fp32 CPU linears and experts of `model` for packed ones, in place; the number of weight
    matrices packed (0: none applies here)."""
    if dispatch.implementation("linear", "cpu") != "cpu":  # DGEMMA_KERNELS=reference: torch's own ops
        return 0
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = _packed_linear(child)
                count = 1
            elif type(child) is Experts:
                new = _packed_experts(child)
                count = 2 * child.gate_up_proj.shape[0]
            else:
                continue
            if new is not None:
                setattr(parent, name, new)  # the stored weight goes with the old module
                packed += count
    if packed and not any(isinstance(m, _Quantized) for m in model.modules()):  # a GGUF model's weights stay
        _own_the_rest(model)  # mapped by design: paged from their files (checkpoint/mapped.py), never copied
    return packed


def _own_the_rest(model: nn.Module) -> None:
    """Copy the tensors left as loaded (embedding, norms, scalars) into memory of their own: while one view of the
    memory-mapped checkpoint lives, the whole mapping stays resident on top of the packed copies (RSS +324 MB on
    the 200 M config)."""
    for module in model.modules():
        if isinstance(module, (NativeLinear, NativeExperts)):  # their panels are new memory already
            continue
        for p in module.parameters(recurse=False):
            p.data = p.data.clone()
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = b.clone()
