"""Quantized weights times bf16 x through int8 dot products (AVX-512 VNNI `vpdpbusd`), the way llama.cpp runs its
quants: x quantized per row and group of 32 to int8, the weights' small integers multiplied as they are.

Owns: `available`, `product` (int4 forms, kernels/ggml_cpu.py) and `blocks_product` (GGUF rows used as stored:
Q5_0, Q8_0, Q6_K, each 64-row block decoded into a per-thread scratch of ~k·64 bytes); the C is
kernels/csrc/ggml_q8.c, built through kernels/native.py. Must not: be needed (both return None without VNNI).
Numerics (not the torch paths' bits; DGEMMA_KERNELS=torch keeps those): per group of 32, dx = max|x|/127 and
xq = round(x/dx) in int8 (nearest even); then the exact product of the weights with dx·xq, integer sums per group,
the rest in fp32, rounded once to bf16: |y − x·Wᵀ| ≤ 2⁻⁸|x·Wᵀ| + Σ_g ½·dx_g·Σ_k |w_k| (tests check it). Relative
RMS error 5-6e-3 on random x, a twelfth of Q4_K weights' own (7e-2).
"""

from __future__ import annotations

import ctypes

import torch

from . import native
from .ggml_blocks import Q5_0, Q6_K, Q8_0, row_bytes

_P, _N, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURE = {"q8_ok": [], "q8_gemm": [_P] * 4 + [_N] * 3 + [_I], "blocks_gemm": [_P] * 3 + [_N] * 4 + [_I, _I]}
BLOCK_TYPES = (Q5_0, Q8_0, Q6_K)  # what `blocks_product` runs


def _load():
    """The library (built at first use), or None: no compiler, no AVX-512 VNNI + VBMI here, or
    DGEMMA_KERNELS=torch|reference."""
    return native.library("ggml_q8", _SIGNATURE)


def available() -> bool:
    return _load() is not None


def product(x2: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, k: int) -> torch.Tensor | None:
    """x2 [M, k] bf16 @ W.T -> [M, Np] bf16 for the int4 form `packed` [Np, k/2], `sz` [k/32, Np, 2]; the
    numerics above. None where it does not apply (no library, not bf16, K not a multiple of 32, or the form's
    shape not K's)."""
    if x2.dtype != torch.bfloat16 or sz.dtype != torch.bfloat16 or k % 32 or x2.shape[-1] != k \
            or packed.shape[-1] * 2 != k or packed.shape[-2] % 64 or sz.shape != (k // 32, packed.shape[-2], 2) \
            or not (packed.is_contiguous() and sz.is_contiguous()):
        return None
    lib = _load()
    if lib is None:
        return None
    x2 = x2.contiguous()
    np_ = packed.shape[-2]
    out = torch.empty(x2.shape[0], np_, dtype=torch.bfloat16)
    if x2.shape[0] and not lib.q8_gemm(x2.data_ptr(), packed.data_ptr(), sz.data_ptr(), out.data_ptr(),
                                       x2.shape[0], k, np_, torch.get_num_threads()):
        return None
    return out


def blocks_product(x2: torch.Tensor, raw: torch.Tensor, qtype: int, k: int, n: int) -> torch.Tensor | None:
    """x2 [M, k] bf16 @ W.T -> [M, n rounded up to 64] bf16 for GGUF rows `raw` [n, row_bytes] of `qtype` (Q5_0
    d·(q − 16), Q8_0 d·q, Q6_K d·sc·(q − 32)), read where they lie (a file's map); the numerics above with those
    weights, exact in fp32. None where it does not apply."""
    if x2.dtype != torch.bfloat16 or qtype not in BLOCK_TYPES or k % (256 if qtype == Q6_K else 32) \
            or x2.shape[-1] != k or raw.shape != (n, row_bytes(qtype, k)) or raw.dtype != torch.uint8 \
            or not raw.is_contiguous():
        return None
    lib = _load()
    if lib is None:
        return None
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], -(-n // 64) * 64, dtype=torch.bfloat16)
    if x2.shape[0] and not lib.blocks_gemm(x2.data_ptr(), raw.data_ptr(), out.data_ptr(), x2.shape[0], k, n,
                                           out.shape[1], torch.get_num_threads(), qtype):
        return None
    return out
