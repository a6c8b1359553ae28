"""An int4 form (kernels/ggml_cpu.py) times bf16 x through int8 dot products (AVX-512 VNNI `vpdpbusd`), the way
llama.cpp runs its quants: x quantized per row and group of 32 to int8, the nibbles multiplied as they are (a
two-plane form's nibbles joined into its 8-bit weight first).

Owns: `available`, `product` (int4 forms) and `q6k_product` (Q6_K's GGUF bytes, its weights d·sc·(q − 32)); the C
is kernels/csrc/ggml_q8.c, built through kernels/native.py. Must not: know GGUF types (the caller names a two-plane
form's offset), or be needed: both return None without VNNI.
Numerics (not the torch paths' bits; DGEMMA_KERNELS=torch keeps those): per group of 32, dx = max|x|/127 and
xq = round(x/dx) in int8 (nearest even); then the exact product of the weights with dx·xq, integer sums per group,
the rest in fp32, rounded once to bf16: |y − x·Wᵀ| ≤ 2⁻⁸|x·Wᵀ| + Σ_g ½·dx_g·Σ_k |w_k| (tests check it). Relative
RMS error 5-6e-3 on random x, a twelfth of Q4_K weights' own (7e-2).
"""

from __future__ import annotations

import ctypes

import torch

from . import native


_P, _N, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURE = {"q8_ok": [], "q8_gemm": [_P] * 4 + [_N] * 3 + [_I, _I], "q6k_gemm": [_P] * 3 + [_N] * 4 + [_I]}


def _load():
    """The library (built at first use), or None: no compiler, no AVX-512 VNNI + VBMI here, or
    DGEMMA_KERNELS=torch|reference."""
    return native.library("ggml_q8", _SIGNATURE)


def available() -> bool:
    return _load() is not None


def product(x2: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor | None:
    """x2 [M, k] bf16 @ W.T -> [M, Np] bf16 for the int4 form `packed` [Np, k/2], `sz` [k/32, Np, 2], or with
    `offset` > 0 for a two-plane form ([Np, k], [2k/32, Np, 2]) of weights d·(16a + b − offset), d plane b's scale
    (Q8_0: 128, Q5_0: 16); the numerics above. None where it does not apply (no library, not bf16, K not a
    multiple of 32, or the form's shape not K's)."""
    if x2.dtype != torch.bfloat16 or sz.dtype != torch.bfloat16 or k % 32 or x2.shape[-1] != k \
            or packed.shape[-1] * (1 if offset else 2) != k or packed.shape[-2] % 64 \
            or sz.shape != ((2 if offset else 1) * k // 32, packed.shape[-2], 2) \
            or not (packed.is_contiguous() and sz.is_contiguous()):
        return None
    lib = _load()
    if lib is None:
        return None
    x2 = x2.contiguous()
    np_ = packed.shape[-2]
    out = torch.empty(x2.shape[0], np_, dtype=torch.bfloat16)
    if x2.shape[0] and not lib.q8_gemm(x2.data_ptr(), packed.data_ptr(), sz.data_ptr(), out.data_ptr(),
                                       x2.shape[0], k, np_, torch.get_num_threads(), offset):
        return None
    return out


def q6k_product(x2: torch.Tensor, raw: torch.Tensor, k: int, n: int) -> torch.Tensor | None:
    """x2 [M, k] bf16 @ W.T -> [M, n rounded up to 64] bf16 for Q6_K rows `raw` [n, k/256·210] (GGUF bytes), the
    numerics above with weights d·sc·(q − 32); None where it does not apply."""
    if x2.dtype != torch.bfloat16 or k % 256 or x2.shape[-1] != k or raw.shape != (n, k // 256 * 210) \
            or raw.dtype != torch.uint8 or not raw.is_contiguous():
        return None
    lib = _load()
    if lib is None:
        return None
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], -(-n // 64) * 64, dtype=torch.bfloat16)
    if x2.shape[0] and not lib.q6k_gemm(x2.data_ptr(), raw.data_ptr(), out.data_ptr(), x2.shape[0], k, n,
                                        out.shape[1], torch.get_num_threads()):
        return None
    return out
