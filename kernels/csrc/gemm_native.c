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
