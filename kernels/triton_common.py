"""Small Triton helpers shared by the kernels in this folder.

Owns: `interpreting` (TRITON_INTERPRET=1: the CPU interpreter computes bf16 dots wrongly, so the kernels keep
bf16 operands out of tl.dot there) and `round_bf16` (round-to-nearest-even to bfloat16, returned as float32).
Why `round_bf16`: the kernels mirror the reference's intermediate roundings to the storage dtype, and the
Triton interpreter (the CPU test path) breaks ties when casting float32 to bfloat16 differently from the GPU
and torch (RTNE); doing the rounding on the bits gives the same answer everywhere. Must not: hold kernels.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, IS_BF16: tl.constexpr):
    """Round float32 x to the storage dtype (bfloat16 when IS_BF16, else leave float32)."""
    if IS_BF16:
        return round_bf16(x)
    return x
