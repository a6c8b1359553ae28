"""NVFP4 weights in the model, kept at 4 bits: the modules swapped in for quantized linears and experts (as
model/fp8.py's are: its `convert_`), held in kernels/nvfp4.py's form (codes packed two a byte, one e4m3 scale per
16 values, a per-row fp32 global scale, `divide` saying how it applies), and compressed-tensors' NVFP4 quantizer.
Must not: read or write files, know checkpoint names, or run the math (kernels/ does).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dgcli.kernels import dispatch
from dgcli.kernels.nvfp4 import E2M1, GROUP
from dgcli.model import fp8


class NVFP4Linear(nn.Module):
    """A bias-free linear with NVFP4 weights: weight_packed uint8 [out, in/2], weight_scale e4m3 [out, in/16],
    weight_global fp32 [out]."""

    def __init__(self, in_features: int, out_features: int, divide: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.divide = in_features, out_features, divide
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // GROUP, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_global", torch.empty(out_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global, self.divide)


class NVFP4Experts(nn.Module):
    """`gemma.Experts` with NVFP4 weights: gate_up_proj [E, 2I, H/2] (gate rows first), down_proj [E, H, I/2], their
    `_scale` (e4m3, one per 16 inputs) and `_global` (fp32 per row) buffers."""

    def __init__(self, num_experts: int, hidden: int, inter: int, divide: bool = True):
        super().__init__()
        self.divide, self.hidden, self.inter = divide, hidden, inter
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            self.register_buffer(name, torch.empty(num_experts, rows, cols // 2, dtype=torch.uint8))
            self.register_buffer(name + "_scale", torch.empty(num_experts, rows, cols // GROUP,
                                                              dtype=torch.float8_e4m3fn))
            self.register_buffer(name + "_global", torch.empty(num_experts, rows, dtype=torch.float32))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, H], routing weights w [N, k] fp32, expert ids idx [N, k] -> [N, H]."""
        return dispatch.nvfp4_experts(x, w, idx, (self.gate_up_proj, self.gate_up_proj_scale, self.gate_up_proj_global),
                                      (self.down_proj, self.down_proj_scale, self.down_proj_global), self.divide)


KINDS = (NVFP4Linear, NVFP4Experts)
quantized_names = functools.partial(fp8.quantized_names, kinds=KINDS)
is_nvfp4 = functools.partial(fp8.is_fp8, kinds=KINDS)


def quantize_rows(w: torch.Tensor, per_row_global: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., n, k] -> (packed uint8 [..., n, k/2], scale e4m3 [..., n, k/16], global fp32 [..., n], a divisor),
    compressed-tensors' NVFP4 (generate_gparam, calculate_qparams, quantize) with one global per matrix [n, k]
    (`per_row_global`: given per row instead, e.g. gate and up of a fused expert each their own)."""
    wf = w.float()
    if per_row_global is None:
        amax = wf.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        g = torch.nan_to_num(448.0 * 6.0 / amax, nan=1.0, posinf=1.0, neginf=1.0).squeeze(-1)  # [..., 1]
        g = g.expand(*w.shape[:-1])
    else:
        g = per_row_global
    grp = wf.unflatten(-1, (-1, GROUP))  # [..., n, k/16, 16]
    s = (grp.abs().amax(-1) / 6.0) * g.unsqueeze(-1)  # compressed-tensors: global · (absmax / 6)
    s = s.clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.where(s.float() == 0, torch.tensor(torch.finfo(torch.float8_e4m3fn).eps).to(s.dtype), s)
    v = (grp / (s.float() / g.unsqueeze(-1)).unsqueeze(-1)).clamp(-6, 6)  # [..., n, k/16, 16]
    table = torch.tensor(E2M1)
    a = v.abs().unsqueeze(-1)
    # nearest E2M1 value, ties to the even code (torch.bucketize-free: count the midpoints passed, ties stay low
    # where the lower code is even)
    mids = (table[1:] + table[:-1]) / 2  # [7]
    even_low = torch.tensor([i % 2 == 0 for i in range(7)])
    code = ((a > mids) | ((a == mids) & ~even_low)).sum(-1).to(torch.uint8)  # [..., n, k/16, 16] in 0..7
    code = code | (torch.signbit(v).to(torch.uint8) << 3)
    code = code.flatten(-2)
    return code[..., 0::2] | (code[..., 1::2] << 4), s, g.contiguous()
