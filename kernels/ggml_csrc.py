"""The C source of the GGML native code (built and loaded by kernels/ggml_native.py; text only here).

Owns: `SOURCE`, three functions over the forms kernels/ggml_cpu.py keeps, each AVX-512 BF16 (+ BW, VBMI) where
the compiler targets it (`VEC`) with a plain-C twin otherwise, OpenMP-parallel over 64-row blocks:
- `int4_tile`: row blocks of an int4 form (Q4_K, Q4_0) -> bf16(zero + (q - 8)·scale), rounded to nearest even (the
  torch unpacker's bits), in oneDNN's packed layout [rows/64][k/2][64][2] (the GEMM path). Vector code: one byte
  shuffle per 64 bytes puts each output's nibble in the low 4 bits of a dword lane (shifted 8j), `vpermps` (which
  reads only those bits) looks float(q - 8) up, one fma with the row's scale and zero (held in registers per
  group), ~7 ops per 32 weights (was ~11: widen, subtract, convert); the next groups' scales prefetched (they sit
  np·4 bytes apart);
- `q6k_tile`: Q6_K rows (GGUF bytes) -> bf16(d·sc·(q - 32)) (the torch dequantizer's bits: every fp32 product is
  exact) in the same layout: each 32-row x 256-value piece decoded row-major, then 16 x 16 transposes of pairs
  (each row's next block and the block 4 rows on prefetched: the column-wise reads missed the hardware's);
- `int4_gemv`: few rows of bf16 x times an int4 form (planes: x fed twice) with the form's exact weights, factored
  per group of 32 (y = sum_g scale·sum((q - 8)·x) + zero·sum(x)); the vector code makes each nibble the bf16
  1 + q/16 (two ops; exact) and runs `_mm512_dpbf16_ps` (products exact, fp32 sums) on row chunks of <= 6, so
  y = sum_g 16·scale·sum((1 + q/16)·x) + (zero − 24·scale)·sum(x), rounded once to bf16. Bound (tests): within
  2^-8·|x·Wᵀ| + 1e-6·|x|·|W|ᵀ of the exact product (DAZ: a bf16-denormal x counts as 0 in the vector code).
Must not: be imported for anything but its text.
"""

# Shared with kernels/ggml_q8.py's source: fp16 -> float, a 16 x 16 transpose of 32-bit words, and one Q6_K
# quarter-block's 32 values q (0..63) in value order.
Q6K_HELPERS = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
static inline float f16(const uint8_t *p) {
    uint32_t h = p[0] | (uint32_t)p[1] << 8, e = (h >> 10) & 31, m = h & 1023, u;
    float f;
    if (e == 0) return (h & 0x8000u ? -1.f : 1.f) * (float)m * 5.9604644775390625e-8f;
    u = (h & 0x8000u) << 16 | (e == 31 ? 0x7F800000u : (e + 112) << 23) | m << 13;
    memcpy(&f, &u, 4);
    return f;
}
#ifdef __AVX512F__
static inline void tr16(const uint32_t *src, long ls, uint32_t *dst, long ld) {  /* 16 x 16 transpose, 32-bit */
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * ls);
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4)
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]),
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++)
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88),
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    for (int j = 0; j < 8; j++)
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88), r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + i * ld, r[i]);
}
#endif
#ifdef __AVX2__
static inline __m256i q6k_quarter(const uint8_t *bl, int h, int j) {  /* q (0..63) of values 128h + 32j .. + 31 */
    __m256i lo = _mm256_loadu_si256((const __m256i *)(bl + 64 * h + 32 * (j & 1)));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(bl + 128 + 32 * h));
    lo = _mm256_and_si256(j >> 1 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
    hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * j), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}
#endif
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define VEC 1
#endif
#define PF 4  /* groups ahead: software prefetch of the scales (int4_tile, int4_gemv) */
/* Row blocks b0..b1 of an int4 form (packed uint8 [blocks, k, 32]: byte j of row kk of block b holds rows 64b + j
   (low nibble) and 64b + 32 + j (high); sz bf16 [k/32, np, 2]: scale, zero) -> bf16(zero + (q - 8) * scale) rounded
   to nearest even (the vector conversion flushes denormals: none here), in oneDNN's layout [b1 - b0][k/2][64][2]. */
void int4_tile(const uint8_t *packed, const uint16_t *sz, uint16_t *out, long k, long np, long b0, long b1,
               int threads) {
#ifdef VEC
    /* Byte 4L + j of a shuffled 64-byte [e (32) | o (32)] load: the byte of output 16j + L (output i: row i/2 of the
       pair's k parity i&1, low nibbles, outputs 64 + i: high nibbles), so that lane L of (bytes >> 8j) holds output
       16j + L's nibble in its low 4 bits: `vpermps` (which reads only those bits) turns it into float(q - 8). */
    uint8_t ib[64];
    for (int p = 0; p < 64; p++) {
        int i = 16 * (p & 3) + p / 4;
        ib[p] = (uint8_t)((i & 1) * 32 + (i >> 1));
    }
    const __m512i ia = _mm512_loadu_si512(ib);
    const __m512 tab = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                     3, 2, 1, 0)), _mm512_set1_ps(8.f));
#endif
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (long b = b0; b < b1; b++)
        for (long g = 0; g < k / 32; g++) {
#ifdef VEC  /* per output vector j (16 outputs: rows 8j.., both parities): fp32 scale and zero in registers */
            __m512 S[8], Z[8];
            if (g + PF < k / 32)  /* a later group's scales: groups sit np·4 bytes apart (a stride the hardware
                                     prefetcher misses: ~10 % of the tile's time from memory) */
                for (int c = 0; c < 256; c += 64)
                    _mm_prefetch((const char *)(sz + ((g + PF) * np + b * 64) * 2) + c, _MM_HINT_T0);
            const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
            for (int c = 0; c < 4; c++) {
                __m512i w = _mm512_loadu_si512(sz + (g * np + b * 64 + 16 * c) * 2);  /* 16 rows' (scale, zero) */
                __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
                S[2 * c] = _mm512_permutexvar_ps(lo, sv), S[2 * c + 1] = _mm512_permutexvar_ps(hi, sv);
                Z[2 * c] = _mm512_permutexvar_ps(lo, zv), Z[2 * c + 1] = _mm512_permutexvar_ps(hi, zv);
            }
            for (long kk = 32 * g; kk < 32 * g + 32; kk += 2) {
                __m512i a = _mm512_permutexvar_epi8(ia, _mm512_loadu_si512(packed + (b * k + kk) * 32));
                __m512i h = _mm512_srli_epi32(a, 4);
                uint16_t *dst = out + ((b - b0) * (k / 2) + kk / 2) * 128;
                __m512 f[8];
                for (int j = 0; j < 4; j++)  /* fma: z + (q - 8)·s rounded once, then to bf16 (nearest even) */
                    f[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(a, 8 * j), tab), S[j], Z[j]),
                    f[4 + j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(h, 8 * j), tab), S[4 + j],
                                               Z[4 + j]);
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(f[2 * c + 1], f[2 * c]));
            }
#else
            float s[128], z[128];  /* per (row, k parity), fp32 (bf16 bits shifted up): a row's pair shares them */
            uint8_t q[128];
            uint32_t u, v;
            for (int r = 0; r < 128; r++)
                u = (uint32_t)sz[(g * np + b * 64 + r / 2) * 2] << 16, v = (uint32_t)sz[(g * np + b * 64 + r / 2) * 2 + 1] << 16,
                memcpy(s + r, &u, 4), memcpy(z + r, &v, 4);
            for (long kk = 32 * g; kk < 32 * g + 32; kk += 2) {
                const uint8_t *e = packed + (b * k + kk) * 32, *o = e + 32;
                uint16_t *dst = out + ((b - b0) * (k / 2) + kk / 2) * 128;
                for (int j = 0; j < 32; j++)
                    q[2 * j] = e[j] & 15, q[2 * j + 1] = o[j] & 15, q[64 + 2 * j] = e[j] >> 4, q[65 + 2 * j] = o[j] >> 4;
                for (int i = 0; i < 128; i++) {  /* round to nearest even, as torch */
                    float f = z[i] + (float)((int)q[i] - 8) * s[i];
                    memcpy(&u, &f, 4), dst[i] = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
                }
            }
#endif
        }
}

/* Few rows: out bf16 [m, np] = x bf16 [m, k] @ W.T for the int4 form's exact weights w = (q - 8)·scale + zero,
   factored per group of 32: y = sum_g scale·(sum (q - 8)·x) + zero·(sum x), fp32 sums (bf16 x bf16 products exact),
   rounded once to bf16. Vector: each nibble becomes the bf16 1 + q/16 (exact; two ops), so per group
   y += 16·scale·sum((1 + q/16)·x) + (zero - 24·scale)·sum(x); each 64-row block's group is unpacked once and
   serves every row of x. */
#define MR 6
static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
#ifdef VEC
static inline __attribute__((always_inline)) void gemv_rows(const __m512i *w, const uint16_t *x, long k, long k0,
        const int mr, float *acc, const __m512 *s, const __m512 *z, const float *xs, long gs) {
    __m512 t[MR][4];
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < 4; v++) t[m][v] = _mm512_setzero_ps();
    for (int p = 0; p < 16; p++)
        for (int m = 0; m < mr; m++) {
            uint32_t xv;
            memcpy(&xv, x + m * k + k0 + 2 * p, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xv);
            for (int v = 0; v < 4; v++) t[m][v] = _mm512_dpbf16_ps(t[m][v], (__m512bh)w[4 * p + v], xb);
        }
    for (int m = 0; m < mr; m++) {
        __m512 xsv = _mm512_set1_ps(xs[m * gs]);
        for (int v = 0; v < 4; v++) {
            float *a = acc + m * 64 + 16 * v;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(z[v], xsv, _mm512_fmadd_ps(t[m][v], s[v], _mm512_loadu_ps(a))));
        }
    }
}
#endif
/* Q6_K rows r0..r1 (GGUF bytes [n, k/256 * 210]) -> bf16 in oneDNN's layout [(r1 - r0)/64][k/2][64][2]: each weight
   bf16(d·sc·(q - 32)) rounded to nearest even (the fp32 products are exact: 11 + 8 + 6 bits), rows from n on 0. */
""" + Q6K_HELPERS + r"""void q6k_tile(const uint8_t *raw, uint16_t *out, long k, long n, long r0, long r1, int threads) {
    long nb = k / 256;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < (r1 - r0) / 64; b++)
        for (long bi = 0; bi < nb; bi++)
            for (int half = 0; half < 2; half++) {  /* 32 rows' 256 values, row-major, then pairs to the layout */
                uint32_t tmp[32 * 128];
                for (int rr = 0; rr < 32; rr++) {
                    long r = r0 + 64 * b + 32 * half + rr;
                    uint16_t *t = (uint16_t *)(tmp + 128 * rr);
                    if (r >= n) {
                        memset(t, 0, 512);
                        continue;
                    }
                    const uint8_t *bl = raw + (r * nb + bi) * 210;
                    float d = f16(bl + 208);
                    for (int c = 0; c < 256; c += 64)  /* this row's next block, this block 4 rows on: rows sit nb·210
                        bytes apart, read a block at a time (the hardware prefetcher misses it: 2.5-3.5x slower) */
                        __builtin_prefetch(bl + 210 + c), __builtin_prefetch(bl + 4 * nb * 210 + c);
#ifdef VEC
                    for (int h = 0; h < 2; h++)
                        for (int j = 0; j < 4; j++) {  /* 32 values: sub-blocks 8h + 2j and 8h + 2j + 1 */
                            const int8_t *sc = (const int8_t *)bl + 192 + 8 * h + 2 * j;
                            __m256i q = _mm256_sub_epi8(q6k_quarter(bl, h, j), _mm256_set1_epi8(32));
                            __m512 w0 = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[0]),
                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
                            __m512 w1 = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[1]),
                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
                            _mm512_storeu_si512(t + 128 * h + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                        }
                    continue;
#endif
                    for (int h = 0; h < 2; h++)
                        for (int j = 0; j < 4; j++) {
                            const int8_t *sc = (const int8_t *)bl + 192 + 8 * h + 2 * j;
                            float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
                            for (int l = 0; l < 32; l++) {
                                int q = ((bl[64 * h + 32 * (j & 1) + l] >> (4 * (j >> 1))) & 15)
                                        | ((bl[128 + 32 * h + l] >> (2 * j)) & 3) << 4;
                                float w = (l < 16 ? d0 : d1) * (float)(q - 32);
                                uint32_t u;
                                memcpy(&u, &w, 4);
                                t[128 * h + 32 * j + l] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                            }
                        }
                }
                uint32_t *dst = (uint32_t *)out + (b * (k / 2) + bi * 128) * 64 + 32 * half;
#ifdef VEC
                for (int r16 = 0; r16 < 32; r16 += 16)
                    for (int p16 = 0; p16 < 128; p16 += 16)
                        tr16(tmp + 128 * r16 + p16, 128, dst + p16 * 64 + r16, 64);
                continue;
#endif
                for (int pr = 0; pr < 128; pr++)
                    for (int rr = 0; rr < 32; rr++) dst[pr * 64 + rr] = tmp[128 * rr + pr];
            }
}

void int4_gemv(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, long mrows, long k,
               long np, int threads) {
    long gs = k / 32;
    float *xs = __builtin_alloca(sizeof(float) * (size_t)(mrows * gs + 1));  /* per (row, group): sum of x */
    for (long m = 0; m < mrows; m++)
        for (long g = 0; g < gs; g++) {
            float a = 0;
            for (int j = 0; j < 32; j++) a += bf(x[m * k + 32 * g + j]);
            xs[m * gs + g] = a;
        }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
    float *acc = __builtin_alloca(sizeof(float) * (size_t)(mrows * 64));
#pragma omp for schedule(static)
    for (long b = 0; b < np / 64; b++) {
        memset(acc, 0, sizeof(float) * (size_t)(mrows * 64));
        for (long g = 0; g < gs; g++) {
            const uint16_t *sg = sz + (g * np + b * 64) * 2;
#ifdef VEC
            if (g + PF < gs)
                for (int c = 0; c < 256; c += 64) _mm_prefetch((const char *)(sg + PF * np * 2) + c, _MM_HINT_T0);
            __m512i w[64];  /* [kk pair][16-row vector]: bf16 pairs 1 + q/16 */
            __m512 s[4], z[4];
            for (int v = 0; v < 4; v++) {
                __m512i pr = _mm512_loadu_si512(sg + 32 * v);  /* 16 rows' (scale, zero) */
                __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
                __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(pr, _mm512_set1_epi32((int)0xFFFF0000u)));
                s[v] = _mm512_mul_ps(sv, _mm512_set1_ps(16.f)), z[v] = _mm512_fmadd_ps(sv, _mm512_set1_ps(-24.f), zv);
            }
            /* bytes: e_i (k even) to word 2i's low byte, o_i (k odd) to word 2i + 1's: rows i (and i + 32), 16 + i */
            const __m512i i0 = _mm512_set_epi8(0, 47, 0, 15, 0, 46, 0, 14, 0, 45, 0, 13, 0, 44, 0, 12, 0, 43, 0, 11,
                0, 42, 0, 10, 0, 41, 0, 9, 0, 40, 0, 8, 0, 39, 0, 7, 0, 38, 0, 6, 0, 37, 0, 5, 0, 36, 0, 4, 0, 35, 0, 3, 0, 34,
                0, 2, 0, 33, 0, 1, 0, 32, 0, 0);
            const __m512i i1 = _mm512_add_epi8(i0, _mm512_set1_epi16(16)), mk = _mm512_set1_epi16(0x0078),
                one = _mm512_set1_epi16(0x3F80);
            for (int p = 0; p < 16; p++) {
                __m512i l = _mm512_loadu_si512(packed + (b * k + 32 * g + 2 * p) * 32);  /* [e (32) | o (32)] */
                __m512i p0 = _mm512_permutexvar_epi8(i0, l), p1 = _mm512_permutexvar_epi8(i1, l);
                w[4 * p] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(p0, 3), mk, one, 0xEA);
                w[4 * p + 1] = _mm512_ternarylogic_epi32(_mm512_slli_epi16(p1, 3), mk, one, 0xEA);
                w[4 * p + 2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(p0, 1), mk, one, 0xEA);
                w[4 * p + 3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(p1, 1), mk, one, 0xEA);
            }
            for (long m0 = 0, c = (mrows + MR - 1) / MR, mr; m0 < mrows; m0 += mr, c--) {  /* chunks near equal */
                const uint16_t *xm = x + m0 * k;
                float *am = acc + m0 * 64;
                const float *xsm = xs + m0 * gs + g;
                switch (mr = (mrows - m0 + c - 1) / c) {
                case 1: gemv_rows(w, xm, k, 32 * g, 1, am, s, z, xsm, gs); break;
                case 2: gemv_rows(w, xm, k, 32 * g, 2, am, s, z, xsm, gs); break;
                case 3: gemv_rows(w, xm, k, 32 * g, 3, am, s, z, xsm, gs); break;
                case 4: gemv_rows(w, xm, k, 32 * g, 4, am, s, z, xsm, gs); break;
                case 5: gemv_rows(w, xm, k, 32 * g, 5, am, s, z, xsm, gs); break;
                default: gemv_rows(w, xm, k, 32 * g, 6, am, s, z, xsm, gs); break;
                }
            }
#else
            float s[64], z[64];
            for (int r = 0; r < 64; r++) s[r] = bf(sg[2 * r]), z[r] = bf(sg[2 * r + 1]);
            for (int r = 0; r < 64; r++) {
                float qf[32];
                for (int j = 0; j < 32; j++) {
                    uint8_t byte = packed[(b * k + 32 * g + j) * 32 + (r & 31)];
                    qf[j] = (float)((int)(r < 32 ? byte & 15 : byte >> 4) - 8);
                }
                for (long m = 0; m < mrows; m++) {
                    float t = 0;
                    for (int j = 0; j < 32; j++) t += qf[j] * bf(x[m * k + 32 * g + j]);
                    acc[m * 64 + r] += t * s[r] + z[r] * xs[m * gs + g];
                }
            }
#endif
        }
        for (long m = 0; m < mrows; m++)
            for (int r = 0; r < 64; r++) {
                uint32_t u;
                memcpy(&u, acc + m * 64 + r, 4);
                out[m * np + b * 64 + r] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            }
    }
    }
}
"""
