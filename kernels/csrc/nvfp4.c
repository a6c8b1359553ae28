/* NVFP4 weights times bf16 x through int8 dot products (AVX-512 VNNI `vpdpbusd`), kernels/nvfp4.py's `product`.
   An E2M1 code times 2 is an integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}: stored + 12 as an unsigned byte, and
   x quantized per row and group of 16 to int8 (dx = max|x|/127), a group's 16 products are an exact integer sum
   (less 12·sum xq); times the group's factor e4m3/global (or x global) / 2 and dx in fp32, summed over K in fp32,
   rounded once to bf16. Per block of 64 weight rows, the codes are regrouped into per-thread scratch: for each
   group, quad of K and 16 rows, one vector of 16 rows x 4 bytes (row l's 4 values at bytes 4l..4l+3). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define VNNI 1
#else
#pragma GCC diagnostic ignored "-Wunused-parameter"  /* the entry points' stubs: they only return 0 */
#endif
#define MR 4
int nvfp4_ok(void) {
#ifdef VNNI
    return 1;
#else
    return 0;
#endif
}
#ifdef VNNI
#include "scratch.h"
static float e4m3(uint8_t b) {  /* float8_e4m3fn value (0x7F/0xFF never appear in a checkpoint) */
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? (float)(8 + m) * (float)(1 << e) / 1024.f : (float)m / 512.f;  /* exact: a power of two apart */
    return (b & 0x80) ? -v : v;
}
/* Rows m0..m0 + mr of x (xq int8 [m, k]; per (row, group): dx, nb = -12·sum xq) times the 64 outputs of block
   scratch w (groups, then quads, then 4 vectors of 16 rows), factors fs [k/16][64]; outputs col..col + 63 (< n). */
static inline __attribute__((always_inline)) void rows(const uint8_t *w, const float *fs, const int8_t *xq,
        const float *dx, const int32_t *nb, long k, long n, long col, const int mr, uint16_t *out) {
    long gs = k / 16;
    __m512 f[MR][4];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < 4; v++) f[m][v] = _mm512_setzero_ps();
    for (long g = 0; g < gs; g++) {
        const uint8_t *wg = w + g * 1024;
        for (int m = 0; m < mr; m++) {
            __m512i a[4];
            for (int v = 0; v < 4; v++) a[v] = _mm512_set1_epi32(nb[m * gs + g]);
            for (int q = 0; q < 4; q++) {
                int32_t xv;
                memcpy(&xv, xq + m * k + 16 * g + 4 * q, 4);
                __m512i xb = _mm512_set1_epi32(xv);
                for (int v = 0; v < 4; v++)
                    a[v] = _mm512_dpbusd_epi32(a[v], _mm512_load_si512(wg + (q * 4 + v) * 64), xb);
            }
            __m512 d = _mm512_set1_ps(dx[m * gs + g]);
            for (int v = 0; v < 4; v++)
                f[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[v]), _mm512_mul_ps(_mm512_load_ps(fs + g * 64 + 16 * v), d),
                                          f[m][v]);
        }
    }
    long left = n - col;
    for (int m = 0; m < mr; m++)  /* to bf16, nearest even; the block's rows past n are not written */
        for (int h = 0; h < 2; h++) {
            __m512i y = (__m512i)_mm512_cvtne2ps_pbh(f[m][2 * h + 1], f[m][2 * h]);
            long c = left - 32 * h;
            __mmask32 keep = c >= 32 ? 0xFFFFFFFFu : c <= 0 ? 0 : (__mmask32)((1u << c) - 1);
            _mm512_mask_storeu_epi16(out + m * n + col + 32 * h, keep, y);
        }
}
#endif
/* out bf16 [m, n] = x bf16 [m, k] @ W.T, W [n, k] NVFP4: packed uint8 [n, k/2] (column 2j in the low nibble),
   scale e4m3 [n, k/16], glob fp32 [n] (a divisor where `divide`); k a multiple of 16. 1, or 0 where this CPU has
   no VNNI or scratch could not be had (out unwritten). */
int nvfp4_gemm(const uint16_t *x, const uint8_t *packed, const uint8_t *scale, const float *glob, int divide,
               uint16_t *out, long mrows, long k, long n, int threads) {
#ifdef VNNI
    long gs = k / 16;
    int8_t *xq = scratch(0, (size_t)(mrows * k + 2 * mrows * gs * 4));
    if (!xq) return 0;
    float *dx = (float *)(xq + mrows * k);
    int32_t *nb = (int32_t *)(dx + mrows * gs);
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && mrows * k >= (1L << 16))
    for (long i = 0; i < mrows * gs; i++) {  /* x: int8 per row and group of 16 */
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16 * i))), 16));
        float amax = _mm512_reduce_max_ps(_mm512_and_ps(v, absm));
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f)));
        _mm_storeu_si128((__m128i *)(xq + 16 * i), _mm512_cvtsepi32_epi8(q));
        /* a NaN in the group: dx NaN, so the outputs it reaches are NaN, as the bf16 product's (max drops it) */
        int nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        dx[i] = nan ? __builtin_nanf("") : amax / 127.f;
        nb[i] = nan ? 0 : -12 * _mm512_reduce_add_epi32(q);
    }
    /* byte 4l + c of the 64 from (lo, hi) of 8 rows' 8 bytes: quads 2p, 2p + 1 (32 bytes each) of rows l = 0..7 */
    uint8_t ib[2][64];
    for (int p = 0; p < 2; p++)
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 8; l++)
                for (int c = 0; c < 4; c++)
                    ib[p][32 * h + 4 * l + c] = (uint8_t)(64 * (c & 1) + 8 * l + 2 * (2 * p + h) + (c >> 1));
    const __m512i i01 = _mm512_loadu_si512(ib[0]), i23 = _mm512_loadu_si512(ib[1]), nib = _mm512_set1_epi8(15);
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
        for (int r = 0; r < 64; r++) {  /* factors; rows past n (a clamped copy of row n - 1 below) weigh 0 */
            long row = 64 * b + r;
            float gl = row < n ? glob[row] : 1.f;
            for (long g = 0; g < gs; g++)
                fs[g * 64 + r] = row < n ? (divide ? e4m3(scale[row * gs + g]) / gl : e4m3(scale[row * gs + g]) * gl) * .5f
                                         : 0.f;
        }
        for (int v = 0; v < 4; v++) {
            long long ofs[16];
            for (int l = 0; l < 16; l++) {
                long row = 64 * b + 16 * v + l;
                ofs[l] = (row < n ? row : n - 1) * (k / 2);
            }
            __m512i oa = _mm512_loadu_si512(ofs), ob = _mm512_loadu_si512(ofs + 8);
            for (long g = 0; g < gs; g++) {
                __m512i a = _mm512_i64gather_epi64(oa, packed + 8 * g, 1), bb = _mm512_i64gather_epi64(ob, packed + 8 * g, 1);
                __m512i la = _mm512_shuffle_epi8(lut, _mm512_and_si512(a, nib));
                __m512i ha = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(a, 4), nib));
                __m512i lb = _mm512_shuffle_epi8(lut, _mm512_and_si512(bb, nib));
                __m512i hb = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(bb, 4), nib));
                __m512i a01 = _mm512_permutex2var_epi8(la, i01, ha), a23 = _mm512_permutex2var_epi8(la, i23, ha);
                __m512i b01 = _mm512_permutex2var_epi8(lb, i01, hb), b23 = _mm512_permutex2var_epi8(lb, i23, hb);
                uint8_t *d = w + g * 1024 + v * 64;
                _mm512_store_si512(d, _mm512_shuffle_i64x2(a01, b01, 0x44));
                _mm512_store_si512(d + 256, _mm512_shuffle_i64x2(a01, b01, 0xEE));
                _mm512_store_si512(d + 512, _mm512_shuffle_i64x2(a23, b23, 0x44));
                _mm512_store_si512(d + 768, _mm512_shuffle_i64x2(a23, b23, 0xEE));
            }
        }
        for (long m0 = 0, mr; m0 < mrows; m0 += mr) {
            const int8_t *xm = xq + m0 * k;
            const float *dm = dx + m0 * gs;
            const int32_t *nm = nb + m0 * gs;
            uint16_t *om = out + m0 * n;
            switch (mr = mrows - m0 < MR ? mrows - m0 : MR) {
            case 1: rows(w, fs, xm, dm, nm, k, n, 64 * b, 1, om); break;
            case 2: rows(w, fs, xm, dm, nm, k, n, 64 * b, 2, om); break;
            case 3: rows(w, fs, xm, dm, nm, k, n, 64 * b, 3, om); break;
            default: rows(w, fs, xm, dm, nm, k, n, 64 * b, MR, om); break;
            }
        }
    }
    return ok;
#else
    return 0;
#endif
}
