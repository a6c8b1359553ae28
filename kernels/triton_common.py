"""Small Triton helpers shared by the kernels in this folder. Must not: hold kernels.

`interpreting`: TRITON_INTERPRET=1. Its CPU interpreter keeps bf16 as uint16 bits and multiplies those in tl.dot:
importing this module under it makes bf16 dot operands their fp32 values (exact), so the kernels' bf16
tensor-core branches run there as on a GPU (fp32 accumulation). `round_bf16` rounds on the bits because the
interpreter breaks float32 -> bfloat16 ties differently from the GPU and torch (RTNE); the kernels mirror the
reference's roundings to the storage dtype.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _bf16_dots() -> None:
    from triton.runtime import interpreter as ti

    dot = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        a, b = (ti.TensorHandle(self.cast_impl(x, tl.float32).data, tl.float32) if x.dtype.scalar == tl.bfloat16
                else x for x in (a, b))
        return dot(self, a, b, d, *args)

    ti.InterpreterBuilder.create_dot = create_dot


if interpreting():
    _bf16_dots()


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


@triton.jit
def tanh(y):
    return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """This program's (row block, column block) of an [M, N] output: GROUP row blocks walk the same column blocks
    back to back, so a weight tile stays in L2."""
    pid = tl.program_id(0)
    per_group = GROUP * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def gelu_mul_rounded(gate, up, IS_BF16: tl.constexpr):
    """gelu_tanh(gate) * up with torch's two roundings to the storage dtype."""
    th = tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate))  # tanh(√(2/π)(z + 0.044715 z³))
    return round_to(round_to(0.5 * gate * (1.0 + th), IS_BF16) * up, IS_BF16)
