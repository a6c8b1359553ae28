"""The GGML native code of kernels/ggml_cpu.py: small C functions (kernels/ggml_csrc.py) that unpack quantized row
blocks to bf16 straight into a oneDNN-packed weight (int4 forms: Q4_K, Q4_0; Q6_K from its GGUF bytes), so the
bf16 GEMM that follows runs at the prepacked rate without F.linear's per-call reorder, and a GEMV for few rows
that reads an int4 form's bytes once (no bf16 weight written).

Owns: the build (`_build_native`: the system's cc at first use, ~0.5 s, through kernels/native.py), the
per-thread packed tiles
(`_packed_tile`: oneDNN's layout [n/64][k/2][64][2] checked once per shape against a real `linear_cpu.pack`),
`tile_product` and `q6k_product` (the tile's weights: the torch unpacker's / dequantizer's bits, tests) and
`gemv` (the form's exact weights, fp32 sums: within the bound ggml_csrc.py states). Why C: torch's ops need ~6
passes over a tile (0.55-0.8 ns a weight here, Q6_K ~2.5); these are one (~0.065 ns, Q6_K ~0.15-0.2). Off (`NATIVE =
False`, DGEMMA_GGML_NATIVE=0 or DGEMMA_NATIVE=0), without a compiler or without oneDNN packing: each returns None and ggml_cpu's
torch paths run.
Must not: know GGUF types beyond the forms' layouts (ggml_cpu.py), or be needed: every path works without it.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from . import native
from .ggml_csrc import SOURCE as _NATIVE_SOURCE
from .linear_cpu import linear as packed_linear
from .linear_cpu import pack

NATIVE = True  # False: the torch unpacker (as DGEMMA_GGML_NATIVE=0)
PACKED_CACHE_BYTES = 192 << 20  # per thread: the packed tiles kept for reuse (26B-A4B: ~100 MB of distinct tiles)
_native_lib: list = []  # [the loaded library, or None]: filled at first use
_scratch = threading.local()  # per thread: {(rows, k, threads): (packed tile, its blocks' address) or None}


def _build_native():
    """`_NATIVE_SOURCE` built and loaded (kernels/native.py: cc -O3 -march=native [-fopenmp: binds to the libgomp
    torch loaded], cached per source, compiler and CPU). None where anything fails."""
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    return native.build("ggml_native", _NATIVE_SOURCE, {"int4_tile": [p] * 3 + [n] * 4 + [i],
                                                          "q6k_tile": [p] * 2 + [n] * 4 + [i],
                                                          "int4_gemv": [p] * 4 + [n] * 3 + [i]})


def _native():
    """The native unpacker (built at first use), or None: unavailable, NATIVE off, or DGEMMA_GGML_NATIVE=0."""
    if not NATIVE or not native.enabled("DGEMMA_GGML_NATIVE"):
        return None
    if not _native_lib:
        _native_lib.append(_build_native())
    return _native_lib[0]


def _packed_tile(tn: int, k: int, threads: int | None = None):
    """This thread's oneDNN-packed bf16 weight [tn, k] (linear_cpu.pack) and its blocks' address, or None where
    packing is unavailable or its layout is not [tn/64][k/2][64][2] (checked once per shape on a real packing).
    `threads`: torch.get_num_threads() where the caller has it."""
    tiles = _scratch.__dict__.setdefault("packed", {})
    key = (tn, k, torch.get_num_threads() if threads is None else threads)  # pack checks per count
    if key not in tiles:
        if sum(2 * a * b for a, b, _ in tiles) + 2 * tn * k > PACKED_CACHE_BYTES:
            tiles.clear()
        w = torch.randn(tn, k, generator=torch.Generator().manual_seed(tn + k)).bfloat16()
        with torch.inference_mode(False):
            pk, tiles[key] = pack(w), None
        if pk is not None and all(hasattr(torch.ops.mkldnn, op) for op in ("data_ptr", "_nbytes")) \
                and torch.ops.mkldnn._nbytes(pk) == w.nbytes:
            ptr = torch.ops.mkldnn.data_ptr(pk)
            blocks = torch.frombuffer((ctypes.c_char * w.nbytes).from_address(ptr), dtype=torch.bfloat16)
            if torch.equal(blocks, w.view(tn // 64, 64, k // 2, 2).transpose(1, 2).reshape(-1)):
                tiles[key] = (pk, ptr)
    return tiles[key]


def tile_product(x2: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, k: int, b0: int, b1: int, lib=None):
    """x2 [M, k] bf16 @ (row blocks b0..b1 of the int4 form `packed`, `sz`).T -> [M, (b1 - b0)·64], the tile
    unpacked natively into a packed weight; None where that does not apply (no native code or packing here, not
    bf16, odd k, non-contiguous form). `lib`: `_native()` where the caller has it (each lookup reads the
    environment: ~2 µs), else looked up here; the same holds for `gemv` and `q6k_product`."""
    if x2.dtype != torch.bfloat16 or sz.dtype != torch.bfloat16 or k % 2 \
            or not (packed.is_contiguous() and sz.is_contiguous()):
        return None
    lib = lib or _native()
    threads = torch.get_num_threads()
    tile = None if lib is None else _packed_tile((b1 - b0) * 64, k, threads)
    if tile is None:
        return None
    lib.int4_tile(packed.data_ptr(), sz.data_ptr(), tile[1], k, packed.shape[-2], b0, b1, threads)
    return packed_linear(x2, tile[0])


def gemv(x2: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, kp: int, lib=None):
    """x2 [M, kp] bf16 @ W.T -> [M, Np] bf16 for the int4 form `packed`, `sz` by `int4_gemv` (the form's exact
    weights, fp32 sums, one bf16 rounding); None where that does not apply (no native code, not bf16)."""
    if x2.dtype != torch.bfloat16 or sz.dtype != torch.bfloat16 or not (packed.is_contiguous() and sz.is_contiguous()):
        return None
    lib = lib or _native()
    if lib is None:
        return None
    x2 = x2.contiguous()
    np_ = packed.shape[-2]
    out = torch.empty(x2.shape[0], np_, dtype=torch.bfloat16)
    lib.int4_gemv(x2.data_ptr(), packed.data_ptr(), sz.data_ptr(), out.data_ptr(), x2.shape[0], kp, np_,
                  torch.get_num_threads())
    return out


def q6k_product(x2: torch.Tensor, raw: torch.Tensor, k: int, n: int, r0: int, r1: int, lib=None):
    """x2 [M, k] bf16 @ (Q6_K rows r0..r1 of `raw` [n, row bytes]).T -> [M, r1 - r0 rounded up to 64] (rows past n:
    0), the rows unpacked natively (`q6k_tile`) into a packed weight; None where that does not apply."""
    if x2.dtype != torch.bfloat16 or k % 256 or not raw.is_contiguous():
        return None
    lib = lib or _native()
    tn, threads = -(-(r1 - r0) // 64) * 64, torch.get_num_threads()
    tile = None if lib is None else _packed_tile(tn, k, threads)
    if tile is None:
        return None
    # rows past n read no bytes (r < n guards every read); the pointer stays the row base
    lib.q6k_tile(raw.data_ptr(), tile[1], k, n, r0, r0 + tn, threads)
    return packed_linear(x2, tile[0])
