/* NVFP4 weights times bf16 x through int8 dot products (AVX-512 VNNI `vpdpbusd`), kernels/nvfp4.py's `product`.
   An E2M1 code times 2 is an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}: stored + 12 as an unsigned byte, and
   x quantized per row and group of 16 to int8 (dx = max|x|/127), a group's 16 products are an exact integer sum
   (less 12·sum xq); times the group's factor e4m3 x (1/global or global) / 2 and dx in fp32, summed over K in
   fp32, rounded once to bf16. A dot product's 4 bytes need not be adjacent columns, only the same 4 in x and w: a
   group's x is stored in the order its bytes' nibbles give (columns 0 2 4 6, 1 3 5 7, 8 10 12 14, 9 11 13 15), so
   the codes are looked up (`vpshufb`) where they lie. Per block of 64 weight rows, per-thread scratch holds for
   each group, quad and 16 rows one vector (row l's 4 values at bytes 4l..4l+3), and the factors [k/16][64]. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vnni.h"
#include "q6k_helpers.h"
#define MR 4
int nvfp4_ok(void) { return VNNI; }
#if VNNI
#include "scratch.h"
/* Rows m0..m0 + mr of x (xq int8 [m, k]; per (row, group): dx, nb = -12·sum xq) times outputs 32p..32p + 31 of
   block scratch w (groups, then quads, then 4 vectors of 16 rows), factors fs [k/16][64]; to out column col. */
static inline __attribute__((always_inline)) void rows(const uint8_t *w, const float *fs, int p, const int8_t *xq,
        const float *dx, const int32_t *nb, long k, long n, long col, const int mr, uint16_t *out) {
    long gs = k / 16;
    __m512 f[MR][2];
    for (int m = 0; m < mr; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    for (long g = 0; g < gs; g++) {
        const uint8_t *wg = w + g * 1024 + p * 128;
        __m512i a[MR][2];
        for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm512_set1_epi32(nb[m * gs + g]);
        for (int q = 0; q < 4; q++) {
            __m512i w0 = _mm512_load_si512(wg + q * 256), w1 = _mm512_load_si512(wg + q * 256 + 64);
            for (int m = 0; m < mr; m++) {
                int32_t xv;
                memcpy(&xv, xq + m * k + 16 * g + 4 * q, 4);
                __m512i xb = _mm512_set1_epi32(xv);
                a[m][0] = _mm512_dpbusd_epi32(a[m][0], w0, xb);
                a[m][1] = _mm512_dpbusd_epi32(a[m][1], w1, xb);
            }
        }
        __m512 s0 = _mm512_load_ps(fs + g * 64 + 32 * p), s1 = _mm512_load_ps(fs + g * 64 + 32 * p + 16);
        for (int m = 0; m < mr; m++) {
            __m512 d = _mm512_set1_ps(dx[m * gs + g]);
            f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, d), f[m][0]);
            f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, d), f[m][1]);
        }
    }
    long c = n - col;  /* to bf16, nearest even; the block's rows past n are not written */
    __mmask32 keep = c >= 32 ? 0xFFFFFFFFu : c <= 0 ? 0 : (__mmask32)((1u << c) - 1);
    for (int m = 0; m < mr; m++)
        _mm512_mask_storeu_epi16(out + m * n + col, keep, (__m512i)_mm512_cvtne2ps_pbh(f[m][1], f[m][0]));
}
#endif
/* out bf16 [m, n] = x bf16 [m, k] @ W.T, W [n, k] NVFP4: packed uint8 [n, k/2] (column 2j in the low nibble),
   scale e4m3 [n, k/16], glob fp32 [n] (a divisor where `divide`); k a multiple of 16. 1, or 0 where this CPU has
   no VNNI or scratch could not be had (out unwritten). */
int nvfp4_gemm(const uint16_t *x, const uint8_t *packed, const uint8_t *scale, const float *glob, int divide,
               uint16_t *out, long mrows, long k, long n, int threads) {
#if VNNI
    long gs = k / 16;
    int8_t *xq = scratch(0, (size_t)(mrows * k + 2 * mrows * gs * 4));
    if (!xq) return 0;
    float *dx = (float *)(xq + mrows * k);
    int32_t *nb = (int32_t *)(dx + mrows * gs);
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && mrows * k >= (1L << 16))
    for (long i = 0; i < mrows * gs; i++) {  /* x: int8 per row and group of 16, in the codes' order */
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16 * i))), 16));
        float amax = _mm512_reduce_max_ps(_mm512_and_ps(v, absm));
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f)));
        _mm_storeu_si128((__m128i *)(xq + 16 * i), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(q), order));
        /* a NaN in the group: dx NaN, so the outputs it reaches are NaN, as the bf16 product's (max drops it) */
        int nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        dx[i] = nan ? __builtin_nanf("") : amax / 127.f;
        nb[i] = nan ? 0 : -12 * _mm512_reduce_add_epi32(q);
    }
    const __m512i nib = _mm512_set1_epi8(15);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < (n + 63) / 64; b++) {
        uint8_t *w = scratch(1, (size_t)(k * 64 + gs * 64 * 4));
        if (!w) {
#pragma omp atomic write
            ok = 0;
            continue;
        }
        float *fs = (float *)(w + k * 64);
        for (long v = 0, r0 = 64 * b; v < 4; v++, r0 += 16) {  /* rows past n: row n - 1 again, factors 0 */
            const uint8_t *pr[16], *sr[16];
            float gr[16];  /* a row's factor is e4m3 x gr: x 1/global (or x global) / 2 */
            for (int l = 0; l < 16; l++) {
                long row = r0 + l < n ? r0 + l : n - 1;
                pr[l] = packed + row * (k / 2), sr[l] = scale + row * gs;
                gr[l] = r0 + l >= n ? 0.f : divide ? .5f / glob[row] : .5f * glob[row];
            }
            __m512i t[16];
            for (long g0 = 0; g0 < gs; g0 += 16) {  /* factors: 16 groups of each row, then rows into lanes */
                __mmask16 in = gs - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (gs - g0)) - 1);
                for (int l = 0; l < 16; l++) {
                    /* e4m3 s.eeee.mmm, sign-extended, at float16's s.0eeee.mmm0000000: its value / 256, exactly */
                    __m256i h = _mm256_cvtepi8_epi16(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(in, sr[l] + g0)));
                    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
                    t[l] = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f * gr[l])));
                }
                tr16r(t);
                for (long j = 0; j < 16 && g0 + j < gs; j++) _mm512_store_si512(fs + (g0 + j) * 64 + 16 * v, t[j]);
            }
            for (long g0 = 0; g0 < gs; g0 += 8) {  /* codes: 8 groups (16 dwords) of each row, then rows into lanes */
                __mmask16 in = gs - g0 >= 8 ? 0xFFFF : (__mmask16)((1u << (2 * (gs - g0))) - 1);
                for (int l = 0; l < 16; l++) t[l] = _mm512_maskz_loadu_epi32(in, pr[l] + 8 * g0);
                tr16r(t);
                for (long j = 0; j < 8 && g0 + j < gs; j++) {
                    uint8_t *d = w + (g0 + j) * 1024 + v * 64;
                    __m512i c0 = t[2 * j], c1 = t[2 * j + 1];
                    _mm512_store_si512(d, _mm512_shuffle_epi8(lut, _mm512_and_si512(c0, nib)));
                    _mm512_store_si512(d + 256, _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(c0, 4), nib)));
                    _mm512_store_si512(d + 512, _mm512_shuffle_epi8(lut, _mm512_and_si512(c1, nib)));
                    _mm512_store_si512(d + 768, _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(c1, 4), nib)));
                }
            }
        }
        for (long m0 = 0, mr; m0 < mrows; m0 += mr)
            for (int p = 0; p < 2; p++) {
                const int8_t *xm = xq + m0 * k;
                const float *dm = dx + m0 * gs;
                const int32_t *nm = nb + m0 * gs;
                uint16_t *om = out + m0 * n;
                switch (mr = mrows - m0 < MR ? mrows - m0 : MR) {
                case 1: rows(w, fs, p, xm, dm, nm, k, n, 64 * b + 32 * p, 1, om); break;
                case 2: rows(w, fs, p, xm, dm, nm, k, n, 64 * b + 32 * p, 2, om); break;
                case 3: rows(w, fs, p, xm, dm, nm, k, n, 64 * b + 32 * p, 3, om); break;
                default: rows(w, fs, p, xm, dm, nm, k, n, 64 * b + 32 * p, MR, om); break;
                }
            }
    }
    return ok;
#else
    return 0;
#endif
}
