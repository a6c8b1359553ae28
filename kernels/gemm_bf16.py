"""bf16 GEMMs with few rows on CPU in C (AVX512-BF16's `vdpbf16ps`), from weights packed once as k-pair panels.

Owns: `pack(w)` (a bf16 weight [N, K] as panels [ceil(N/16), ceil(K/2), 16, 2]: panel p, k-pair j holds columns
16p..16p+15 of k 2j and 2j+1 side by side, zero past column N and past k K; `unpack` back), `linear(x, packed, n)`
(x [..., K] @ w.T) and `grouped(x, rows, packed, ends, n, scale)` (the routed experts' GEMMs in one call: row block e
of the result is x[rows[block e]] @ w_e.T, each row then times its routing weight if given), and their C source,
built at first use (kernels/native.py).
Must not: run on CUDA, handle other dtypes, know about modules (dgcli/model/packed.py swaps them in), or be needed:
None means "use the oneDNN path" (no compiler, a CPU without AVX512-BF16: the library built says so and is kept,
another dtype, DGEMMA_NATIVE=0 / DGEMMA_GEMM_NATIVE=0).

Why: the routed experts' GEMMs have few rows each (~85 at the 200 M config, ~16 at the released one) and weights
that are cold (a layer's 36 MB-1.5 GB of experts were pushed out by the other layers). oneDNN's bf16 GEMM without
AMX runs them at ~half its big-GEMM rate (one call per expert, its own blocking and setup). Here a pair of weight
panels (32 columns) is read as one stream, prefetched ahead (the next pair into cache while this one is used), a
block of up to 8 rows is held in 16 fp32 vector registers, both threads stream their own panels, and all
experts of a GEMM are one call (one OpenMP region, no barrier between experts). Measured (2-core EPYC, no AMX,
cold weights): ~200 GFLOP/s on 1 thread (~88 % of the core's dpbf16 peak), ~350-375 on 2, against oneDNN's
~400-420 on a 2,048-row GEMM; the 200 M config's experts 10.6-11.2 against 12.9-14.3 ms (oneDNN, per expert), the
released config's at 256 rows 70-85 against 100-117 ms: faster at 1 to 128 rows per expert (benchmarks/
bench_experts_cpu.py, path `native`).
Bits: each output is Σ_j (x[2j]·w[2j] + x[2j+1]·w[2j+1]) accumulated in fp32 by `vdpbf16ps` in k-pair order from
0 within chunks of `chunk(K, rows)` values, the chunks' sums added in order (the products are exact; the hardware rounds
each addition to nearest even and flushes denormals), then rounded once to bf16 (nearest even, `vcvtneps2bf16`); a
scaled row is then widened, multiplied by its fp32 scale and rounded again, as torch's mixed-dtype `mul_` does
(equal bits but for denormals). Whatever the row count, the row's place in its block, the thread count or the
segment: batch-invariant. That is oneDNN's own order on an AVX512-BF16 CPU without AMX: the same bits as F.linear
(measured at the 200 M and released configs' expert shapes, 1-256 rows: every output equal), so a session packs its
bf16 experts here where `agrees` finds F.linear's bits for their shapes at load (dgcli/model/packed.py); elsewhere
(an AMX CPU, another oneDNN) oneDNN runs them, unless DGEMMA_BF16_FAST=1 asks for this GEMM anyway (then about one
bf16 rounding from F.linear: tests/kernels/test_gemm_bf16.py bounds it against the fp32 product).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from . import native

PANEL = 16  # columns per packed panel: one AVX-512 vector of fp32 accumulators
PROBE_ROWS = (1, 2, 3, 8, 17, 85)  # row counts `agrees` compares (tails of the 8-row blocks, one and many blocks)


def chunk(k: int, rows: int) -> int:
    """The k chunk whose fp32 sums are added to each other for a product of `rows` rows: oneDNN's bf16 GEMM without
    AMX (torch 2.13) blocks K so (found by trying chunk sizes on a 2-core EPYC at K 160-2816 and 1-256 rows: every
    output equal; one row is another kernel, with 512 at every K); `agrees` checks it."""
    return 512 if k <= 1024 or rows == 1 else 1024

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
int gemm_ok(void) { return 1; }
#define MR 8  /* rows a block: 8-9 ran 3-7 % faster than 10-14 at the 200 M config's shapes */
#ifndef PF
#define PF 8  /* k-pairs ahead (8 x 64 B per panel) in the pair being read */
#endif

static inline __m512i bcast(const uint16_t *x, long j) {  /* x[2j], x[2j+1] in every lane */
    int32_t v;
    memcpy(&v, x + 2 * j, 4);
    return _mm512_set1_epi32(v);
}

/* An accumulator rounded to bf16; with a row scale, then times it in fp32 and rounded again (as torch's in-place
   mul of a bf16 tensor by an fp32 one). */
static inline __m256i out16(__m512 a, const float *sc, int r) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(a);
    if (!sc) return h;
    __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(f, _mm512_set1_ps(sc[r])));
}

/* Rows xr[0..R) (k elements each) of a block times NP (1 or 2) panels p (kp k-pairs x 16 x 2 each, the second at
   p + kp*32): y[i, 0 : 16*NP] as bf16 (the last panel's columns masked by `last`), scaled by sc[i] if sc. Sums in
   k-pair order from 0 within chunks of kc pairs, the chunks' sums added in order (oneDNN's order: see the Python
   side). nx: a panel pair to pull into cache meanwhile (2*kp lines of 64 B, two per k-pair), or 0. */
static inline __attribute__((always_inline)) void tile(const int R, const int NP, const uint16_t *const *xr,
        const uint16_t *p, long k, long kc, uint16_t *y, long ldy, __mmask16 last, const char *nx, const float *sc) {
    __m512 acc[MR][2], tot[MR][2];
    long kp = k / 2;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NP; c++) acc[r][c] = _mm512_setzero_ps();
    const uint16_t *p1 = p + ((k + 1) / 2) * 32;
    for (long j = 0; j < kp; j++) {
        if (j && j % kc == 0)  /* a chunk ends: its sums into the total (the first one is the total) */
            for (int r = 0; r < R; r++)
                for (int c = 0; c < NP; c++) {
                    tot[r][c] = j == kc ? acc[r][c] : _mm512_add_ps(tot[r][c], acc[r][c]);
                    acc[r][c] = _mm512_setzero_ps();
                }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + j * 32);
        __m512bh w1 = NP > 1 ? (__m512bh)_mm512_loadu_si512(p1 + j * 32) : w0;
        _mm_prefetch((const char *)(p + (j + PF) * 32), _MM_HINT_T0);
        if (NP > 1) _mm_prefetch((const char *)(p1 + (j + PF) * 32), _MM_HINT_T0);
        if (nx) { _mm_prefetch(nx + j * 128, _MM_HINT_T1); _mm_prefetch(nx + j * 128 + 64, _MM_HINT_T1); }
        for (int r = 0; r < R; r++) {
            __m512bh xb = (__m512bh)bcast(xr[r], j);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            if (NP > 1) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    if (k & 1) {  /* the last k alone: (x, 0) against the panel's (w, 0) */
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + kp * 32);
        __m512bh w1 = NP > 1 ? (__m512bh)_mm512_loadu_si512(p1 + kp * 32) : w0;
        for (int r = 0; r < R; r++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][k - 1]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            if (NP > 1) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    if (kp > kc)  /* the last chunk's sums */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < NP; c++) acc[r][c] = _mm512_add_ps(tot[r][c], acc[r][c]);
    for (int r = 0; r < R; r++) {
        __m256i h0 = out16(acc[r][0], sc, r);
        if (NP > 1) {
            _mm256_storeu_si256((__m256i *)(y + r * ldy), h0);
            _mm256_mask_storeu_epi16(y + r * ldy + 16, last, out16(acc[r][1], sc, r));
        } else {
            _mm256_mask_storeu_epi16(y + r * ldy, last, h0);
        }
    }
}

#define CASE(R) case R: if (np == 2) tile(R, 2, xr, p, k, kc, y, ldy, last, nx, sc); \
                      else tile(R, 1, xr, p, k, kc, y, ldy, last, nx, sc); break;

static void block(long rows, int np, const uint16_t *const *xr, const uint16_t *p, long k, long kc, uint16_t *y,
                  long ldy, __mmask16 last, const char *nx, const float *sc) {
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    }
}

/* This thread's panel pairs [j0, j1) of y [m, n] = X @ W.T (X's row i at x + (rows ? rows[i] : i) * ldx, W panels
   at p), over row blocks of near-equal sizes <= MR. While a pair's first block runs, the next pair (nx_last after
   the last one: the next expert's) is pulled into cache. No output depends on the split or the blocks. */
static void pairs(const uint16_t *x, const int64_t *rows, long m, long k, long kc, long ldx, const uint16_t *p,
                  long n, uint16_t *y, long ldy, long j0, long j1, const uint16_t *nx_last, const float *sc) {
    long panels = (n + 15) / 16, pstep = ((k + 1) / 2) * 32, blocks = (m + MR - 1) / MR;
    long base = m / blocks, extra = m % blocks;
    for (long j = j0; j < j1; j++) {
        long c0 = 2 * j * 16;
        int np = 2 * j + 1 < panels ? 2 : 1;
        long tail = n - (c0 + 16 * (np - 1));  /* columns of this pair's last panel */
        __mmask16 last = tail >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
        const uint16_t *pj = p + 2 * j * pstep;
        const char *nx = (const char *)(j + 1 < j1 ? pj + 2 * pstep : nx_last);
        for (long b = 0, r0 = 0; b < blocks; b++) {
            long nr = base + (b < extra);
            const uint16_t *xr[MR];
            for (long r = 0; r < nr; r++) xr[r] = x + (rows ? rows[r0 + r] : r0 + r) * ldx;
            block(nr, np, xr, pj, k, kc, y + r0 * ldy + c0, ldy, last, b ? 0 : nx, sc ? sc + r0 : 0);
            r0 += nr;
        }
    }
}

/* Segments: rows [ends[e-1], ends[e]) of y are X[rows[..]] @ W_e.T, W_e packed at p + e * pstride. One parallel
   region: thread t takes the same share of panel pairs of every expert, so each thread streams its own weights and
   prefetches its next expert's share; no barrier between experts (they write disjoint rows). */
void grouped(const uint16_t *x, const int64_t *rows, long k, long kc, long kc1, long ldx, const uint16_t *p,
             long pstride, long n, const int64_t *ends, long experts, uint16_t *y, long ldy, const float *sc,
             int threads) {
    long np = ((n + 15) / 16 + 1) / 2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(); nt = omp_get_num_threads();
#endif
        long j0 = np * t / nt, j1 = np * (t + 1) / nt, start = 0;
        const uint16_t *xe = x;
        for (long e = 0; e < experts; e++) {
            long end = ends[e];
            if (end > start && j1 > j0) {
                long nxt = e + 1;  /* the next expert with rows: its first pair of this thread's share */
                while (nxt < experts && ends[nxt] == end) nxt++;
                const uint16_t *nx = nxt < experts ? p + nxt * pstride + 2 * j0 * ((k + 1) / 2) * 32 : 0;
                pairs(xe, rows ? rows + start : 0, end - start, k, end - start > 1 ? kc : kc1, ldx,
                      p + e * pstride, n, y + start * ldy, ldy, j0, j1, nx, sc ? sc + start : 0);
            }
            if (!rows) xe += (end - start) * ldx;
            start = end;
        }
    }
}
#else /* no AVX512-BF16 target: a library that says so (built once, not retried by every process) */
int gemm_ok(void) { return 0; }
void grouped(void) {}
#endif
"""

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURE = {"grouped": [_P, _P, _L, _L, _L, _L, _P, _L, _L, _P, _L, _P, _L, _P, _I], "gemm_ok": []}
_lib: list = []
_ON = native.switch("DGEMMA_GEMM_NATIVE")  # on unless DGEMMA_NATIVE or it is "0", read at each call


def _native():
    return native.load_once(_lib, "gemm_bf16", _SOURCE, _SIGNATURE, ok="gemm_ok", direct=True) if _ON() else None


def available() -> bool:
    """The C bf16 GEMM built (an AVX512-BF16 CPU) and enabled here."""
    return _native() is not None


def agrees(n: int, k: int, threads: int) -> bool:
    """Does this GEMM give F.linear's bits (oneDNN's, the reference's) for a weight [n, k] at the caller's thread
    count here? Random values, PROBE_ROWS rows. False on CPUs whose oneDNN sums otherwise, and while the GEMM is off
    (not remembered: the switch is read at each call)."""
    return available() and _agrees(n, k, threads)


@functools.cache
def _agrees(n: int, k: int, threads: int) -> bool:
    if torch.cpu._is_amx_tile_supported():
        # oneDNN's AMX kernels sum in an order that depends on the row count: at small shapes the probe rows can
        # all agree while others do not (a Xeon with AMX, [32, 48]: rows 21, 51, 73, 114, 117 differ), so no probe
        # can vouch for it there; oneDNN's AMX GEMM is also the faster one there.
        return False
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.empty(n, k, dtype=torch.bfloat16).uniform_(-(3 / k) ** 0.5, (3 / k) ** 0.5, generator=g)
    p = pack(w)
    for m in PROBE_ROWS:  # one row is another kernel in oneDNN: 16 such calls (a wrong order shows in ~1/3 of them)
        for _ in range(16 if m == 1 else 1):
            x = torch.empty(m, k, dtype=torch.bfloat16).uniform_(-2, 2, generator=g)
            if not torch.equal(linear(x, p, n), torch.nn.functional.linear(x, w)):
                return False
    return True


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (or a stack [E, N, K]) bf16 -> panels [ceil(N/16), ceil(K/2), 16, 2] (or [E, ...]), zero past
    column N and past k K."""
    n, k = w.shape[-2:]
    if k % 2 or n % PANEL:  # padded only where needed: a layer's stack may be 1.5 GB, one copy is enough
        w = torch.nn.functional.pad(w, (0, k % 2, 0, -n % PANEL))  # [.., N', K']
    return w.unflatten(-2, (-1, PANEL)).unflatten(-1, (-1, 2)).transpose(-3, -2).contiguous()


def unpack(panels: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
    """`pack`'s inverse: panels [.., P, J, 16, 2] -> the weight [.., n, k] (k: 2J unless given) as stored (a
    contiguous copy)."""
    return panels.transpose(-3, -2).flatten(-2).flatten(-3, -2)[..., :n, :k].contiguous()


def _fits(x: torch.Tensor, packed: torch.Tensor, n: int) -> bool:
    ps, k = packed.shape, x.shape[-1]
    return (x.dtype == torch.bfloat16 and packed.dtype == torch.bfloat16 and x.is_cpu and packed.is_cpu
            and x.stride(-1) == 1 and packed.is_contiguous() and ps[-3] == (k + 1) // 2 and ps[-4] * PANEL >= n)


def grouped(x: torch.Tensor, rows: torch.Tensor | None, packed: torch.Tensor, ends: torch.Tensor, n: int,
            scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Row segments of x [., K] (x[rows] when rows [R] int64 is given, else x's own rows in order) times the packed
    stack's matrices [E, ..]: segment e (rows ends[e-1] .. ends[e], ends [E] int64) by matrix e -> [R, n] bf16;
    with scale (fp32, R values) each row then times its scale, as `y.mul_(scale[:, None])` does it (fp32 product,
    rounded to bf16), in the same pass. None where the C GEMM does not apply."""
    lib = _native()
    if lib is None or x.dim() != 2 or packed.dim() != 5 or not _fits(x, packed, n) \
            or ends.dtype != torch.int64 or not ends.is_contiguous() or ends.shape[0] != packed.shape[0] \
            or (rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous())):
        return None
    k = x.shape[1]
    r = x.shape[0] if rows is None else rows.shape[0]
    if scale is not None and (scale.dtype != torch.float32 or not scale.is_contiguous() or scale.numel() != r):
        return None
    y = torch.empty(r, n, dtype=torch.bfloat16)
    if r:
        threads = torch.get_num_threads() if r * n * k >= (1 << 22) else 1
        lib.grouped(x.data_ptr(), None if rows is None else rows.data_ptr(), k, chunk(k, 2) // 2, chunk(k, 1) // 2,
                    x.stride(0) if x.shape[0] > 1 else k,
                    packed.data_ptr(), math.prod(packed.shape[1:]), n, ends.data_ptr(), packed.shape[0], y.data_ptr(),
                    n, None if scale is None else scale.data_ptr(), threads)
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [..., K] bf16 @ W.T -> [..., n] bf16 for the W [n, K] that `pack` packed, or None where the C GEMM does
    not apply (one segment of `grouped`)."""
    if packed.dim() != 4 or x.stride(-1) != 1:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]:
        x2 = x2.contiguous()
    ends = torch.tensor([x2.shape[0]], dtype=torch.int64)
    y = grouped(x2, None, packed.unsqueeze(0), ends, n)
    return None if y is None else y.view(*x.shape[:-1], n)
