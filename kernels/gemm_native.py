"""fp32 GEMMs with few rows on CPU in C, from weights packed once into column panels.

Owns: `pack(w)` (an fp32 weight [N, K] as panels [ceil(N/16), K, 16], zero past column N; `unpack` back),
`linear(x, packed, n)` (x [..., K] @ w.T) and `grouped(x, rows, packed, ends, n)` (the routed experts' GEMMs in
one call: row block e of the result is x[rows[block e]] @ w_e.T), and their C source, built at first use
(kernels/native.py).
Must not: run on CUDA, handle other dtypes, know about modules (dgcli/model/packed.py swaps them in), or be needed:
None means "use torch's GEMM" (no compiler, a CPU without AVX-512: the library built says so and is kept, another
dtype, DGEMMA_NATIVE=0 / DGEMMA_GEMM_NATIVE=0).

Why: torch's fp32 GEMM on CPU (MKL) is slow at the bundled model's shapes (16-128 rows, K and N of 160-1024):
~60-70 GFLOP/s with the weight in cache and ~35 with it cold (each of a step's ~100 GEMMs reads a weight the
previous layers pushed out of L2), against the core's ~96 (2-core EPYC, avx512, 1 thread). Here a weight panel
(16 columns) is read as one stream, each row block of up to 12 rows is held in 24 vector registers, and a tiny
expert's GEMM pays no per-call setup.
Bits: each output is Σ_k x[r, k]·w[c, k] accumulated in k order by fused multiply-adds from 0, whatever the row
count, the row's place in its block, the thread count or the segment: batch-invariant, and not MKL's order. The
products equal torch's within fp32 rounding (tests/kernels/test_gemm_native.py); the model's parity and agreement
tests bound the effect (fp32 <= 1e-4 against the reference). DGEMMA_GEMM_NATIVE=0 keeps torch's GEMMs (the
reference's bits).
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native

PANEL = 16  # columns per packed panel: one AVX-512 vector of fp32

_SOURCE = r"""
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
int gemm_ok(void) { return 1; }
#define MR 12
#ifndef PF
#define PF 16
#endif

/* Rows x[rows[i]] (rows NULL: x + i*ldx) of a block of R <= MR rows times NP (1 or 2) panels p (K x 16 each,
   the second at p + K*16): y[i, 0 : 16*NP] (the last panel's columns masked by `last`). Sums in k order, from 0. */
static inline __attribute__((always_inline)) void tile(const int R, const int NP, const float *const *xr,
                                                       const float *p, long k, float *y, long ldy, __mmask16 last) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NP; c++) acc[r][c] = _mm512_setzero_ps();
    const float *p1 = p + k * 16;
    for (long kk = 0; kk < k; kk++) {
        __m512 w0 = _mm512_loadu_ps(p + kk * 16), w1 = NP > 1 ? _mm512_loadu_ps(p1 + kk * 16) : w0;
        _mm_prefetch((const char *)(p + (kk + PF) * 16), _MM_HINT_T0);
        if (NP > 1) _mm_prefetch((const char *)(p1 + (kk + PF) * 16), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xr[r][kk]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            if (NP > 1) acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (NP > 1) {
            _mm512_storeu_ps(y + r * ldy, acc[r][0]);
            _mm512_mask_storeu_ps(y + r * ldy + 16, last, acc[r][1]);
        } else {
            _mm512_mask_storeu_ps(y + r * ldy, last, acc[r][0]);
        }
    }
}

#define CASE(R) case R: if (np == 2) tile(R, 2, xr, p, k, y, ldy, last); else tile(R, 1, xr, p, k, y, ldy, last); break;

static void block(long rows, int np, const float *const *xr, const float *p, long k, float *y, long ldy,
                  __mmask16 last) {
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
    }
}

/* y [m, n] (row stride ldy) = X @ W.T, X's row i at x + (rows ? rows[i] : i) * ldx, W packed as panels
   [ceil(n/16), k, 16]. Work split over `threads` by (panel pair, row block): no output depends on the split. */
static void gemm_rows(const float *x, const int64_t *rows, long m, long k, long ldx, const float *p, long n,
                      float *y, long ldy, int threads) {
    long panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = (m + MR - 1) / MR;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (long j = 0; j < pairs; j++)
        for (long b = 0; b < blocks; b++) {
            long r0 = b * MR, nr = m - r0 < MR ? m - r0 : MR, c0 = 2 * j * 16;
            int np = 2 * j + 1 < panels ? 2 : 1;
            long tail = n - (c0 + 16 * (np - 1));  /* columns of this pair's last panel */
            __mmask16 last = tail >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
            const float *xr[MR];
            for (long r = 0; r < nr; r++) xr[r] = x + (rows ? rows[r0 + r] : r0 + r) * ldx;
            block(nr, np, xr, p + 2 * j * k * 16, k, y + r0 * ldy + c0, ldy, last);
        }
}

void gemm(const float *x, long m, long k, long ldx, const float *p, long n, float *y, long ldy, int threads) {
    gemm_rows(x, 0, m, k, ldx, p, n, y, ldy, threads);
}

/* Segments: rows [ends[e-1], ends[e]) of y are X[rows[..]] @ W_e.T, W_e packed at p + e * pstride. */
void grouped(const float *x, const int64_t *rows, long k, long ldx, const float *p, long pstride, long n,
             const int64_t *ends, long experts, float *y, long ldy, int threads) {
    long start = 0;
    for (long e = 0; e < experts; e++) {
        long end = ends[e];
        if (end > start)
            gemm_rows(x, rows ? rows + start : 0, end - start, k, ldx, p + e * pstride, n, y + start * ldy, ldy,
                      threads);
        if (!rows) x += (end - start) * ldx;
        start = end;
    }
}
#else /* no AVX-512 target: a library that says so (built once, not retried by every process) */
int gemm_ok(void) { return 0; }
void gemm(void) {}
void grouped(void) {}
#endif
"""

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURE = {"gemm": [_P, _L, _L, _L, _P, _L, _P, _L, _I],
              "grouped": [_P, _P, _L, _L, _P, _L, _L, _P, _L, _P, _L, _I], "gemm_ok": []}
_lib: list = []
_ON = native.switch("DGEMMA_GEMM_NATIVE")  # on unless DGEMMA_NATIVE or it is "0", read at each call


def _native():
    return native.load_once(_lib, "gemm_native", _SOURCE, _SIGNATURE, ok="gemm_ok", direct=True) if _ON() else None


def available() -> bool:
    """The C GEMM built and enabled here."""
    return _native() is not None


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (or a stack [E, N, K]) fp32 -> panels [ceil(N/16), K, 16] (or [E, ...]), zero past column N."""
    n, k = w.shape[-2:]
    pad = -n % PANEL
    if pad:
        w = torch.cat([w, w.new_zeros(*w.shape[:-2], pad, k)], dim=-2)
    return w.unflatten(-2, (-1, PANEL)).transpose(-2, -1).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """`pack`'s inverse: panels [.., P, K, 16] -> the weight [.., n, K] as stored (a contiguous copy)."""
    return panels.transpose(-2, -1).flatten(-3, -2)[..., :n, :].contiguous()


def _threads(m: int, n: int, k: int) -> int:
    return torch.get_num_threads() if m * n * k >= (1 << 22) else 1


def linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [..., K] fp32 @ W.T -> [..., n] for the W that `pack` packed, or None where the C GEMM does not apply."""
    lib = _native()
    shape, ps = x.shape, packed.shape
    k = shape[-1]
    if lib is None or x.dtype != torch.float32 or packed.dtype != torch.float32 or not x.is_cpu \
            or not packed.is_cpu or ps[-2] != k or ps[-3] * PANEL < n:
        return None
    if k > 1 and x.is_contiguous():  # the model's rows: no reshape (a tensor call costs ~0.5 µs, ~35 GEMMs a step)
        m, ldx = x.numel() // k, k
    elif x.stride(-1) != 1:
        return None
    else:
        x = x.reshape(-1, k)
        if x.shape[0] > 1 and x.stride(0) < k:
            x = x.contiguous()
        m = x.shape[0]
        ldx = x.stride(0) if m > 1 else k
    y = torch.empty(*shape[:-1], n, dtype=torch.float32)  # unpacked: a torch.Size is slower to parse
    if m:
        lib.gemm(x.data_ptr(), m, k, ldx, packed.data_ptr(), n, y.data_ptr(), n, _threads(m, n, k))
    return y


def grouped(x: torch.Tensor, rows: torch.Tensor | None, packed: torch.Tensor, ends: torch.Tensor,
            n: int) -> torch.Tensor | None:
    """Row segments of x (x[rows] when rows [R] int64 is given, else x's own rows in order) times the packed
    stack's matrices: segment e (rows ends[e-1] .. ends[e], ends [E] int64) by matrix e -> [R, n] fp32."""
    lib = _native()
    ps = packed.shape
    k = x.shape[1]
    if lib is None or x.dtype != torch.float32 or packed.dtype != torch.float32 or not x.is_cpu \
            or not packed.is_cpu or x.stride(-1) != 1 or ps[-2] != k or ps[-3] * PANEL < n \
            or ends.dtype != torch.int64 or not ends.is_contiguous() or ends.shape[0] != ps[0] \
            or (rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous())):
        return None
    r = x.shape[0] if rows is None else rows.shape[0]
    y = torch.empty(r, n, dtype=torch.float32)
    if r:
        lib.grouped(x.data_ptr(), None if rows is None else rows.data_ptr(), k, x.stride(0), packed.data_ptr(),
                    math.prod(ps[1:]), n, ends.data_ptr(), ps[0], y.data_ptr(), n, _threads(r, n, k))
    return y
