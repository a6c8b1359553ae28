"""NVFP4 weights (E2M1 codes in groups of 16 with one E4M3 scale each, and a per-row fp32 global scale): the decode,
GGUF's block layout, and the CPU linear and routed experts, kept at 4 bits. Must not: read files, know tensor names.

The held form (dgcli/model/nvfp4.py), one for the three file formats: `packed` uint8 [..., n, k/2] (column 2j in the
low nibble; a code is sign bit 3 + an index into E2M1), `scale` float8_e4m3fn [..., n, k/16], `glob` fp32 [..., n]
(a fused gate_up holds the gate's and the up's), `divide`: the global is a divisor (compressed-tensors) or a
multiplier (ModelOpt, GGUF). The weight (`decode`): bf16(e2m1 x fp32(e4m3 / glob)), op for op compressed-tensors'
`decompress`, so a reference run equals the model holding the decompressed bf16 weights (gguf-py gives the same
numbers). Activations are never FP4 (W4A16). CPU matmul, bf16 x where the CPU has AVX-512 VNNI + VBMI: `product`
(kernels/csrc/nvfp4.c), e2m1 x 2 as integers times x rounded to int8 per row and group of 16 (dx = max|x|/127,
nearest even), each group's integer sum times e4m3 x (1/glob or glob) / 2 (within 2^-23 of `factors`) and dx in
fp32, summed in fp32, rounded once to bf16:
|y - x.W^T| <= 2^-8 |x.W^T| + sum_g dx_g/2 . sum_k|w_k| (W the decoded weights before their bf16 rounding; tests
check it), relative RMS error ~5e-3 on random x. Else (DGEMMA_KERNELS=torch, no compiler, fp32 x) the reference:
tiles of ~4 M weights decoded by torch ops, then torch's GEMM. Nothing decoded outlives a call.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .reference_ops import routed

GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GGUF_NVFP4, GGUF_BLOCK, GGUF_BYTES = 40, 64, 36  # ggml type id, values and bytes per block
TILE_VALUES = 1 << 22  # weights decoded per tile on the CPU path


def _half_bits(c: int) -> int:
    """A code's E2M1 value x 2^-14 as float16 bits, exactly: s.ee.m placed at float16's s.000ee.m000000000 (its
    subnormals continue E2M1's 0.5 step)."""
    return (c & 7) << 9 | (c & 8) << 12


# byte -> its two codes' float16 bits (low nibble in the low half: little-endian, so the pair reads as two values)
_PAIRS = torch.tensor([_half_bits(b & 15) | _half_bits(b >> 4) << 16 for b in range(256)]).to(torch.int32)  # wraps


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k/2] -> codes uint8 [..., k] (low nibble first)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def factors(scale: torch.Tensor, glob: torch.Tensor, divide: bool) -> torch.Tensor:
    """Each group's fp32 factor e4m3 / glob (or x glob): scale [..., n, k/16], glob [..., n] -> [..., n, k/16]."""
    from .fp8 import fp8_over_256  # e4m3 -> float by int16 ops: torch's float8 conversion is ~2.5x slower

    s, g = fp8_over_256(scale).float() * 256, glob.float().unsqueeze(-1)
    return s / g if divide else s * g


def _library():
    """kernels/csrc/nvfp4.c loaded, or None (no compiler, no VNNI here, DGEMMA_KERNELS=torch|reference)."""
    from . import native

    return native.library("nvfp4", {"nvfp4_ok": [], "nvfp4_gemm": [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p]
                                    + [ctypes.c_long] * 3 + [ctypes.c_int]})


def available() -> bool:
    return _library() is not None


def product(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor,
            divide: bool) -> torch.Tensor | None:
    """x2 [M, k] bf16 @ W.T -> [M, n] bf16 through kernels/csrc/nvfp4.c's int8 product (the numerics in the module
    docstring); None where it does not apply (no library or no VNNI here, not bf16 on the CPU, not one matrix)."""
    if x2.dtype != torch.bfloat16 or not x2.is_cpu or x2.dim() != 2 or packed.dim() != 2 \
            or x2.shape[1] != packed.shape[1] * 2:
        return None
    lib = _library()
    if lib is None:
        return None
    x2, p, s, g = x2.contiguous(), packed.contiguous(), scale.contiguous(), glob.float().contiguous()
    out = torch.empty(x2.shape[0], p.shape[0], dtype=torch.bfloat16)
    if x2.shape[0] and not lib.nvfp4_gemm(x2.data_ptr(), p.data_ptr(), s.data_ptr(), g.data_ptr(), int(divide),
                                          out.data_ptr(), x2.shape[0], x2.shape[1], p.shape[0], torch.get_num_threads()):
        return None
    return out


def decode(packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor, divide: bool,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weights [..., n, k] in dtype (see the module docstring): each byte becomes its two values x 2^-14 as
    float16 by one table lookup, and the multiply by factor x 2^14 runs in fp32 (float16 x fp32 promotes), rounded
    once into bf16: the same bits as e2m1 x factor in fp32 (a power of two apart)."""
    pairs = _PAIRS.to(packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    half = pairs.view(torch.float16).view(*packed.shape[:-1], -1, GROUP)  # [..., n, k/16, 16]
    w = torch.empty(half.shape, dtype=torch.bfloat16, device=packed.device)
    torch.mul(half, (factors(scale, glob, divide) * 16384).unsqueeze(-1), out=w)
    w = w.flatten(-2)
    return w if dtype == torch.bfloat16 else w.to(dtype)


def check(packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> str | None:
    """What is wrong with a held triple (shapes, dtypes, a non-finite or non-positive global), or None."""
    *lead, n, half = packed.shape
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        return f"dtypes {packed.dtype}/{scale.dtype}; NVFP4 holds uint8 codes and float8_e4m3fn scales"
    if (2 * half) % GROUP or tuple(scale.shape) != (*lead, n, 2 * half // GROUP):
        return f"scale shape {list(scale.shape)} for {2 * half} columns; expected one scale per {GROUP} columns"
    if not bool(torch.isfinite(glob).all() and (glob > 0).all()):
        return "global scale is not a finite positive number"
    return None


# ---- GGUF type 40 (llama.cpp ggml-common.h block_nvfp4) --------------------------------------------------------

def from_gguf_blocks(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF NVFP4 bytes [..., n, k/64·36] -> (packed [..., n, k/2], scale e4m3 [..., n, k/16]). The code index k of
    GGUF (kvalues {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ...} · ue4m3 / 2) is E2M1's code; the unsigned E4M3 scale is
    e4m3fn with the sign bit clear (0x7F, which gguf-py reads as 0, becomes 0)."""
    lead = raw.shape[:-1]
    b = raw.reshape(*lead, k // GGUF_BLOCK, GGUF_BYTES)
    d = b[..., :4] & 0x7F
    d = torch.where(d == 0x7F, torch.zeros_like(d), d)
    qs = b[..., 4:].reshape(*lead, k // GROUP, 8)
    codes = torch.stack((qs & 15, qs >> 4), dim=-2).flatten(-2)  # [..., k/16, 16]: values 0..7 then 8..15
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(*lead, k // 2), d.reshape(*lead, k // GROUP).view(torch.float8_e4m3fn)


def to_gguf_blocks(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `from_gguf_blocks`: -> uint8 [..., n, k/64·36]."""
    lead, k = packed.shape[:-1], packed.shape[-1] * 2
    codes = unpack(packed).reshape(*lead, k // GROUP, 2, 8)  # values 0..7, 8..15 of each sub-block
    qs = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(*lead, k // GGUF_BLOCK, 32)
    d = scale.view(torch.uint8).reshape(*lead, k // GGUF_BLOCK, 4)
    return torch.cat((d, qs), dim=-1).reshape(*lead, k // GGUF_BLOCK * GGUF_BYTES)


# ---- CPU linear and experts -----------------------------------------------------------------------------------

def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor,
           divide: bool) -> torch.Tensor:
    """x [..., k] @ decode(...).T -> [..., n] in x.dtype, over tiles of rows decoded one at a time."""
    n, k = packed.shape[0], packed.shape[1] * 2
    x2 = x.reshape(-1, k)
    step = max(1, TILE_VALUES // k)
    y = product(x2, packed, scale, glob, divide)  # the int8 product where there is one, else decoded tiles
    if y is None and step >= n:
        y = F.linear(x2, decode(packed, scale, glob, divide, x.dtype))
    elif y is None:
        y = torch.cat([F.linear(x2, decode(packed[r:r + step], scale[r:r + step], glob[r:r + step], divide, x.dtype))
                       for r in range(0, n, step)], dim=1)
    return y.reshape(*x.shape[:-1], n)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: tuple, down: tuple,
            divide: bool, linear=linear) -> torch.Tensor:
    """Routed experts x [N, H], w [N, k] fp32, idx [N, k] -> [N, H] (`reference_ops.experts_reference`'s math on
    the decoded weights); gate_up / down = (packed, scale, glob) stacks [E, ...]; only routed experts are decoded,
    each by `linear` (this module's, or the dispatch's: the Triton GEMM on CUDA)."""
    inter = down[0].shape[-1] * 2

    def mlp(e: int, tok: torch.Tensor) -> torch.Tensor:
        gu = linear(x[tok], *(t[e] for t in gate_up), divide)
        return linear(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], *(t[e] for t in down), divide)

    return routed(x, w, idx, gate_up[0].shape[0], mlp)
