"""The native unpacker of the GGML GEMM path (kernels/ggml_cpu.py): a small C function that unpacks row blocks of an
int4 form (Q4_K, Q4_0) to bf16 straight into a oneDNN-packed weight, so the bf16 GEMM that follows runs at the
prepacked rate without F.linear's per-call reorder.

Owns: `_NATIVE_SOURCE` (C, AVX-512 BF16 where the compiler targets it, a plain-C loop otherwise, OpenMP on the
runtime torch already loaded), its build (`_build_native`: the system's cc at first use, ~0.3 s, into
~/.cache/dgemma or the temp dir, keyed by source, compiler and CPU flags, loaded with ctypes: no torch headers),
the per-thread packed tiles (`_packed_tile`: oneDNN's layout [n/64][k/2][64][2] checked once per shape against a
real `linear_cpu.pack`) and `tile_product`. Each weight is bf16(zero + (q - 8)·scale) rounded to nearest even: the
torch unpacker's bits (tests/kernels/test_ggml_cpu.py). Why C: torch's ops need ~6 passes over a tile (0.55-0.8 ns
a weight here); this is one (~0.085 ns). Off (`NATIVE = False`, DGEMMA_GGML_NATIVE=0), without a compiler or
without oneDNN packing: `tile_product` returns None and ggml_cpu's torch unpacker runs.
Must not: know GGUF types beyond the int4 form's layout (ggml_cpu.py), or be needed: every path works without it.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from .linear_cpu import linear as packed_linear
from .linear_cpu import pack

NATIVE = True  # False: the torch unpacker (as DGEMMA_GGML_NATIVE=0)
PACKED_CACHE_BYTES = 64 << 20  # per thread: the packed tiles kept for reuse
_native_lib: list = []  # [the loaded library, or None]: filled at first use
_scratch = threading.local()  # per thread: {(rows, k, threads): (packed tile, its blocks' address) or None}

_NATIVE_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define VEC 1
#endif
/* Row blocks b0..b1 of an int4 form (packed uint8 [blocks, k, 32]: byte j of row kk of block b holds rows 64b + j
   (low nibble) and 64b + 32 + j (high); sz bf16 [k/32, np, 2]: scale, zero) -> bf16(zero + (q - 8) * scale) rounded
   to nearest even (the vector conversion flushes denormals: none here), in oneDNN's layout [b1 - b0][k/2][64][2]. */
void int4_tile(const uint8_t *packed, const uint16_t *sz, uint16_t *out, long k, long np, long b0, long b1,
               int threads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (long b = b0; b < b1; b++)
        for (long g = 0; g < k / 32; g++) {
            float s[128], z[128];  /* per (row, k parity), fp32 (bf16 bits shifted up): a row's pair shares them */
            uint8_t q[128];
            uint32_t r = 0, u, v;
#ifdef VEC
            for (const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                 hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8)); r < 128; r += 32) {
                __m512i w = _mm512_loadu_si512(sz + (g * np + b * 64 + r / 2) * 2);  /* 16 rows' (scale, zero) */
                __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
                _mm512_storeu_ps(s + r, _mm512_permutexvar_ps(lo, sv)), _mm512_storeu_ps(s + r + 16, _mm512_permutexvar_ps(hi, sv));
                _mm512_storeu_ps(z + r, _mm512_permutexvar_ps(lo, zv)), _mm512_storeu_ps(z + r + 16, _mm512_permutexvar_ps(hi, zv));
            }
#endif
            for (; r < 128; r++)
                u = (uint32_t)sz[(g * np + b * 64 + r / 2) * 2] << 16, v = (uint32_t)sz[(g * np + b * 64 + r / 2) * 2 + 1] << 16,
                memcpy(s + r, &u, 4), memcpy(z + r, &v, 4);
            for (long kk = 32 * g; kk < 32 * g + 32; kk += 2) {
                const uint8_t *e = packed + (b * k + kk) * 32, *o = e + 32;
                uint16_t *dst = out + ((b - b0) * (k / 2) + kk / 2) * 128, i = 0;
#ifdef VEC  /* bytes (e_j, o_j) side by side, their low then their high nibbles; 32 values per conversion */
                __m512i pr = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)e)),
                    _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)o)), 8));
                _mm512_storeu_si512(q, _mm512_and_si512(pr, _mm512_set1_epi16(0x0F0F)));
                _mm512_storeu_si512(q + 64, _mm512_and_si512(_mm512_srli_epi16(pr, 4), _mm512_set1_epi16(0x0F0F)));
                for (__m512 f[2]; i < 128; i += 32) {
                    for (int h = 0; h < 2; h++)
                        f[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                            (const __m128i *)(q + i + 16 * h))), _mm512_set1_epi32(8))), _mm512_loadu_ps(s + i + 16 * h),
                            _mm512_loadu_ps(z + i + 16 * h));
                    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
                }
#endif
                for (int j = 0; j < 32 && i < 128; j++)
                    q[2 * j] = e[j] & 15, q[2 * j + 1] = o[j] & 15, q[64 + 2 * j] = e[j] >> 4, q[65 + 2 * j] = o[j] >> 4;
                for (float f; i < 128; i++)  /* round to nearest even, as torch */
                    f = z[i] + (float)((int)q[i] - 8) * s[i], memcpy(&u, &f, 4), dst[i] = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            }
        }
}
"""


def _build_native():
    """`_NATIVE_SOURCE` compiled (cc -O3 -march=native [-fopenmp: binds to the libgomp torch loaded]) into
    ~/.cache/dgemma or the temp dir, keyed by source, compiler and CPU flags; loaded. None where anything fails."""
    import hashlib
    import platform
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    info = Path("/proc/cpuinfo")  # -march=native: a library built for one CPU must not load on another
    cpu = [ln for ln in (info.read_text() if info.is_file() else "").splitlines() if ln.startswith(("flags", "Fea"))][:1]
    key = hashlib.sha256(f"{_NATIVE_SOURCE}{cc}{platform.machine()}{cpu}".encode()).hexdigest()[:16]
    for d in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma",
              Path(tempfile.gettempdir()) / f"dgemma-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        so = d / f"ggml_native-{key}.so"
        try:
            if cc and not so.exists():
                d.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=d) as tmp:
                    (Path(tmp) / "t.c").write_text(_NATIVE_SOURCE)
                    for omp in (["-fopenmp"], []):
                        if subprocess.run([cc, "-O3", "-march=native", *omp, "-shared", "-fPIC", "t.c", "-o", "t.so"],
                                          cwd=tmp, capture_output=True, timeout=120).returncode == 0:
                            os.replace(Path(tmp) / "t.so", so)  # atomic: processes racing here all get a whole file
                            break
            lib = ctypes.CDLL(str(so))
            lib.int4_tile.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4 + [ctypes.c_int]
            return lib
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def _native():
    """The native unpacker (built at first use), or None: unavailable, NATIVE off, or DGEMMA_GGML_NATIVE=0."""
    if not NATIVE or os.environ.get("DGEMMA_GGML_NATIVE", "1") == "0":
        return None
    if not _native_lib:
        _native_lib.append(_build_native())
    return _native_lib[0]


def _packed_tile(tn: int, k: int):
    """This thread's oneDNN-packed bf16 weight [tn, k] (linear_cpu.pack) and its blocks' address, or None where
    packing is unavailable or its layout is not [tn/64][k/2][64][2] (checked once per shape on a real packing)."""
    tiles, key = _scratch.__dict__.setdefault("packed", {}), (tn, k, torch.get_num_threads())  # pack checks per count
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


def tile_product(x2: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, k: int, b0: int, b1: int):
    """x2 [M, k] bf16 @ (row blocks b0..b1 of the int4 form `packed`, `sz`).T -> [M, (b1 - b0)·64], the tile
    unpacked natively into a packed weight; None where that does not apply (no native code or packing here, not
    bf16, odd k, non-contiguous form)."""
    if x2.dtype != torch.bfloat16 or sz.dtype != torch.bfloat16 or k % 2 \
            or not (packed.is_contiguous() and sz.is_contiguous()):
        return None
    lib = _native()
    tile = None if lib is None else _packed_tile((b1 - b0) * 64, k)
    if tile is None:
        return None
    lib.int4_tile(packed.data_ptr(), sz.data_ptr(), tile[1], k, packed.shape[-2], b0, b1, torch.get_num_threads())
    return packed_linear(x2, tile[0])
