#include "q6k_helpers.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vnni.h"
#define MR 4
int q8_ok(void) { return VNNI; }
#if VNNI
#include "scratch.h"
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* x bf16 [m, k] -> int8 per row and group of 32 (this thread's scratch 0): xq [m, k], and per (row, group) dx =
   max|x|/127, xs = dx·sum xq, nb = -off·sum xq; with q6 also n16 [m, k/16]: -32·sum xq per 16 values. */
struct xint { int8_t *xq; float *dx, *xs; int32_t *nb, *n16; };
static int quantize(const uint16_t *x, long mrows, long k, int off, int q6, int threads, struct xint *q) {
    long gs = k / 32;
    q->xq = scratch(0, (size_t)(mrows * k + (3 + 2 * q6) * mrows * gs * 4));
    if (!q->xq) return 0;
    q->dx = (float *)(q->xq + mrows * k), q->xs = q->dx + mrows * gs;
    q->nb = (int32_t *)(q->xs + mrows * gs), q->n16 = q->nb + mrows * gs;
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && mrows * k >= (1L << 16))
    for (long r = 0; r < mrows; r++)
        for (long g = 0; g < gs; g++) {
            __m512 lo = bf16x16(x + r * k + 32 * g), hi = bf16x16(x + r * k + 32 * g + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, absm), _mm512_and_ps(hi, absm)));
            __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
            __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            _mm_storeu_si128((__m128i *)(q->xq + r * k + 32 * g), _mm512_cvtsepi32_epi8(ql));
            _mm_storeu_si128((__m128i *)(q->xq + r * k + 32 * g + 16), _mm512_cvtsepi32_epi8(qh));
            int sl = _mm512_reduce_add_epi32(ql), sh = _mm512_reduce_add_epi32(qh);
            /* a NaN in the group: dx NaN, so the outputs it reaches are NaN, as the bf16 product's (max drops it;
               its lanes converted to INT_MIN: sums of 0 instead, no overflow) */
            int nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
            if (nan) sl = sh = 0;
            q->dx[r * gs + g] = nan ? __builtin_nanf("") : amax / 127.f;
            q->xs[r * gs + g] = q->dx[r * gs + g] * (float)(sl + sh);
            q->nb[r * gs + g] = -off * (sl + sh);
            if (q6) q->n16[r * 2 * gs + 2 * g] = -32 * sl, q->n16[r * 2 * gs + 2 * g + 1] = -32 * sh;
        }
    return 1;
}
/* Rows m0..m0 + mr of x (int8 xq [m, k]; per (row, group): dx, xs = dx·sum xq, nb = -8·sum xq) times the 32
   outputs of block scratch w (u8 weights q: w = (q - 8)·scale + zero), vector pair p (outputs 32p..32p + 31 of the
   block), all K. */
static inline __attribute__((always_inline)) void rows(const uint8_t *w, int p, const int8_t *xq, const float *dx,
        const float *xs, const int32_t *nb, const uint16_t *sz, long k, long np, long col, const int mr,
        const char *pf, long pfg, uint16_t *out) {
    long gs = k / 32;
    __m512 f[MR][2];
    for (int m = 0; m < mr; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (long g = 0; g < gs; g++) {
        const uint16_t *sg = sz + (g * np + col) * 2;  /* 32 outputs' (scale, zero), bf16 pairs */
        if (pf)  /* the next block's form, a group's share at a time: read while this one computes, not after */
            for (long c = 0; c < pfg; c += 64) _mm_prefetch(pf + g * pfg + c, _MM_HINT_T1);
        __m512i r0 = _mm512_loadu_si512(sg), r1 = _mm512_loadu_si512(sg + 32);
        __m512 s0 = _mm512_castsi512_ps(_mm512_slli_epi32(r0, 16)), z0 = _mm512_castsi512_ps(_mm512_and_si512(r0, hi));
        __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(r1, 16)), z1 = _mm512_castsi512_ps(_mm512_and_si512(r1, hi));
        __m512i a[MR][2];
        for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm512_set1_epi32(nb[m * gs + g]);
        const uint8_t *wg = w + (8 * g * 4 + 2 * p) * 64;
        const int8_t *xg = xq + 32 * g;
        for (int t = 0; t < 8; t++) {
            __m512i w0 = _mm512_load_si512(wg + t * 256), w1 = _mm512_load_si512(wg + t * 256 + 64);
            for (int m = 0; m < mr; m++) {
                int32_t xv;
                memcpy(&xv, xg + m * k + 4 * t, 4);
                __m512i xb = _mm512_set1_epi32(xv);
                a[m][0] = _mm512_dpbusd_epi32(a[m][0], w0, xb);
                a[m][1] = _mm512_dpbusd_epi32(a[m][1], w1, xb);
            }
        }
        for (int m = 0; m < mr; m++) {
            __m512 d = _mm512_set1_ps(dx[m * gs + g]), x = _mm512_set1_ps(xs[m * gs + g]);
            f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, d), f[m][0]);
            f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, d), f[m][1]);
            f[m][0] = _mm512_fmadd_ps(z0, x, f[m][0]), f[m][1] = _mm512_fmadd_ps(z1, x, f[m][1]);
        }
    }
    for (int m = 0; m < mr; m++)  /* to bf16, nearest even (no NaN payloads to keep: the sums are finite or inf) */
        _mm512_storeu_si512(out + m * np + col, (__m512i)_mm512_cvtne2ps_pbh(f[m][1], f[m][0]));
}
/* GGUF blocks decoded into the scratch layout: weights scale·(u - off), u a byte, one fp32 scale a gv values (Q6_K:
   16, Q5_0 / Q8_0: 32). Rows m0..m0 + mr times the 32 outputs of pair p of block scratch w, scales scl fp32
   [k/gv][64]; ns: -off·sum xq per gv values. */
static inline __attribute__((always_inline)) void rowsg(const uint8_t *w, const float *scl, int p, const int8_t *xq,
        const float *dx, const int32_t *ns, long k, long np, long col, const int mr, const int gv, uint16_t *out) {
    long gs = k / 32, ng = k / gv;
    __m512 f[MR][2];
    for (int m = 0; m < mr; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    for (long h = 0; h < ng; h++) {
        __m512 s0 = _mm512_load_ps(scl + h * 64 + 32 * p), s1 = _mm512_load_ps(scl + h * 64 + 32 * p + 16);
        __m512i a[MR][2];
        for (int m = 0; m < mr; m++) a[m][0] = a[m][1] = _mm512_set1_epi32(ns[m * ng + h]);
        const uint8_t *wh = w + (gv * h + 2 * p) * 64;
        for (int t = 0; t < gv / 4; t++) {
            __m512i w0 = _mm512_load_si512(wh + t * 256), w1 = _mm512_load_si512(wh + t * 256 + 64);
            for (int m = 0; m < mr; m++) {
                int32_t xv;
                memcpy(&xv, xq + m * k + gv * h + 4 * t, 4);
                __m512i xb = _mm512_set1_epi32(xv);
                a[m][0] = _mm512_dpbusd_epi32(a[m][0], w0, xb);
                a[m][1] = _mm512_dpbusd_epi32(a[m][1], w1, xb);
            }
        }
        for (int m = 0; m < mr; m++) {
            __m512 d = _mm512_set1_ps(dx[m * gs + h * gv / 32]);
            f[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][0]), _mm512_mul_ps(s0, d), f[m][0]);
            f[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][1]), _mm512_mul_ps(s1, d), f[m][1]);
        }
    }
    for (int m = 0; m < mr; m++)
        _mm512_storeu_si512(out + m * np + col, (__m512i)_mm512_cvtne2ps_pbh(f[m][1], f[m][0]));
}
/* Q6_K rows 64b.. of raw [n, k/256 * 210] -> scratch w (q bytes) and scl (d·sc per 16 values); rows from n on
   weigh 0: each 16 rows' 256-value blocks decoded to q bytes, transposed by 4-value words into the layout. */
static void decode_q6k(const uint8_t *raw, long b, long k, long n, uint8_t *w, float *scl) {
    long nbk = k / 256;
    for (int v = 0; v < 4; v++)
        for (long bi = 0; bi < nbk; bi++) {
            uint32_t tmp[16 * 64];  /* 16 rows' 256 q bytes */
            for (int rr = 0; rr < 16; rr++) {
                long r = 64 * b + 16 * v + rr;
                uint8_t *t = (uint8_t *)(tmp + 64 * rr);
                float *sr = scl + bi * 16 * 64 + 16 * v + rr;
                if (r >= n) {
                    memset(t, 32, 256);
                    for (int j = 0; j < 16; j++) sr[j * 64] = 0.f;
                    continue;
                }
                const uint8_t *bl = raw + (r * nbk + bi) * 210;
                for (int c = 0; c < 256; c += 64)  /* the row's next block (rows sit nbk·210 bytes apart) */
                    __builtin_prefetch(bl + 210 + c);
                float d = f16(bl + 208);
                for (int j = 0; j < 16; j++) sr[j * 64] = d * (float)((const int8_t *)bl)[192 + j];
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 4; j++)
                        _mm256_storeu_si256((__m256i *)(t + 128 * h + 32 * j), q6k_quarter(bl, h, j));
            }
            for (int c = 0; c < 4; c++)  /* words (4 values) of 16 rows -> 16 quads of the layout */
                tr16(tmp + 16 * c, 64, (uint32_t *)(w + (bi * 64 + 16 * c) * 256 + 64 * v), 64);
        }
}
/* Q5_0 / Q8_0 decoded 16 rows and two blocks (64 values) at a time straight into the layout, transposed by 4-value
   words: 16 bytes of 4 rows a register as loaded, then two rounds of two-source permutes (tr16x8); the scales and
   Q5_0's 5th bits gathered 16 rows at a time. `struct q58` holds the constants, built once a call. */
struct q58 { __m512i t[4], ctl[8], vi, iq; long rb; };
static void q58_init(struct q58 *C, long rb) {
    int32_t t[4][16];
    for (int s = 1; s < 3; s++)  /* lanes row-major: 2 << s rows x 8 >> s words -> twice the rows, half the words */
        for (int l = 0; l < 16; l++) {
            int rin = 2 << s, cin = 8 >> s, cout = cin / 2, r = l / cout, col = l % cout;
            t[2 * s - 2][l] = (r < rin ? 0 : 16) + r % rin * cin + col;  /* the low output: the first half */
            t[2 * s - 1][l] = t[2 * s - 2][l] + cout;
        }
    for (int s = 0; s < 4; s++) C->t[s] = _mm512_loadu_si512(t[s]);
    uint8_t ix[64];
    for (int j = 0; j < 8; j++) {  /* bit 4j + b (+ 32 for an odd row) of a qword of two rows' qh: byte b of word j */
        for (int i = 0; i < 64; i++) ix[i] = (uint8_t)(i / 4 % 2 * 32 + 4 * j + i % 4);
        C->ctl[j] = _mm512_loadu_si512(ix);
    }
    for (int i = 0; i < 64; i++) ix[i] = (uint8_t)((i < 32 ? 6 : 28) + i % 16);  /* pair58: a pair's qs, twice */
    C->iq = _mm512_loadu_si512(ix);
    int32_t vi[16];
    for (int i = 0; i < 16; i++) vi[i] = (int32_t)(i * rb);
    C->vi = _mm512_loadu_si512(vi), C->rb = rb;
}
/* z[2p + h]: 16 bytes at p0 (h 0) or p1 (h 1) of rows 4p .. 4p + 3 (rows rb apart), words 4h .. 4h + 3 -> word j
   of the 16 rows in z[j bit-reversed] */
static inline __attribute__((always_inline)) void tr16x8(const uint8_t *p0, const uint8_t *p1, long rb,
        const struct q58 *C, __m512i z[8]) {
    __m512i a[8];
    for (int i = 0; i < 8; i++) {
        const uint8_t *r = (i % 2 ? p1 : p0) + 4 * (i / 2) * rb;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)r));
        v = _mm512_mask_broadcast_i32x4(v, 0x00F0, _mm_loadu_si128((const __m128i *)(r + rb)));
        v = _mm512_mask_broadcast_i32x4(v, 0x0F00, _mm_loadu_si128((const __m128i *)(r + 2 * rb)));
        z[i] = _mm512_mask_broadcast_i32x4(v, 0xF000, _mm_loadu_si128((const __m128i *)(r + 3 * rb)));
    }
    for (int s = 1, h = 2; s < 3; s++, h *= 2) {
        for (int i = 0; i < 8; i++) {  /* the pair (g, g + h) makes a[g] (low) and a[g + h] (high) */
            int g = i / (2 * h) * (2 * h) + i % h;
            a[i] = _mm512_permutex2var_epi32(z[g], C->t[2 * (s - 1) + (i % (2 * h) >= h)], z[g + h]);
        }
        for (int i = 0; i < 8; i++) z[i] = a[i];
    }
}
#define REV3(j) (((j) & 1) << 2 | ((j) & 2) | (j) >> 2)
/* 16 whole rows' blocks c, c + 1 (bl: row 0's block c) -> w (words 0..15 of the pair, 256 bytes apart: u = q + 16
   | q + 128, Q5_0's nibble and 5th bit, Q8_0's int8 with its sign bit flipped) and d0, d1 (fp16 scales) */
static inline __attribute__((always_inline)) void q58_16(const uint8_t *bl, const int q8, const struct q58 *C,
        uint8_t *w, uint16_t *d0, uint16_t *d1) {
    const long rb = C->rb, bb = q8 ? 34 : 22;
    __m512i z[8];
    if (q8) {
        for (int b = 0; b < 2; b++) {
            tr16x8(bl + b * bb + 2, bl + b * bb + 18, rb, C, z);
            for (int j = 0; j < 8; j++)
                _mm512_store_si512(w + (8 * b + j) * 256, _mm512_xor_si512(z[REV3(j)], _mm512_set1_epi8(-128)));
        }
    } else {
        tr16x8(bl + 6, bl + 28, rb, C, z);  /* words 0..3: block c's qs, 4..7: block c + 1's */
        const __m512i m4 = _mm512_set1_epi8(15), s16 = _mm512_set1_epi8(16);
        __m512i qh[2] = {_mm512_i32gather_epi32(C->vi, bl + 2, 1), _mm512_i32gather_epi32(C->vi, bl + 24, 1)};
        for (int j = 0; j < 8; j++) {  /* qs word j % 4 of block c + j / 4: values 4j.. low nibbles, 16 + 4j.. high */
            __m512i q = z[REV3(j)];
            for (int hn = 0; hn < 2; hn++) {
                __m512i u = _mm512_and_si512(hn ? _mm512_srli_epi16(q, 4) : q, m4);
                u = _mm512_mask_add_epi8(u, _mm512_bitshuffle_epi64_mask(qh[j / 4], C->ctl[4 * hn + j % 4]), u, s16);
                _mm512_store_si512(w + (8 * (j / 4) + 4 * hn + j % 4) * 256, u);
            }
        }
    }
    _mm256_storeu_si256((__m256i *)d0, _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(C->vi, bl, 1)));
    _mm256_storeu_si256((__m256i *)d1, _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(C->vi, bl + bb, 1)));
}
/* One row's blocks c, c + 1 as q58_16 makes them (two: whether c + 1 exists; its scale 0 where not): the rows and
   blocks at the edges */
static inline __m512i pair58(const uint8_t *bl, int q8, int two, __m512i iq, uint16_t *d0, uint16_t *d1) {
    memcpy(d0, bl, 2);
    *d1 = 0;
    if (two) memcpy(d1, bl + (q8 ? 34 : 22), 2);
    if (q8) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(bl + 2));
        __m256i hi = two ? _mm256_loadu_si256((const __m256i *)(bl + 36)) : _mm256_set1_epi8(-128);
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(-128));
    }
    __m512i q = _mm512_permutexvar_epi8(iq, _mm512_maskz_loadu_epi8(~0ULL >> (two ? 20 : 42), bl));
    q = _mm512_and_si512(_mm512_mask_blend_epi8(0xFFFF0000FFFF0000ULL, q, _mm512_srli_epi16(q, 4)), _mm512_set1_epi8(15));
    uint32_t h0, h1 = 0;
    memcpy(&h0, bl + 2, 4);
    if (two) memcpy(&h1, bl + 24, 4);
    return _mm512_mask_add_epi8(q, (uint64_t)h1 << 32 | h0, q, _mm512_set1_epi8(16));
}
/* Q5_0 (q8 0) / Q8_0 (q8 1) rows 64b.. of raw [n, k/32 * (22 | 34)] -> scratch w and scl (d per 32 values; dh:
   their fp16 first, read back once all are written); rows from n on weigh 0; w holds k rounded up to 64. */
static void decode_q58(const uint8_t *raw, long b, long k, long n, int q8, const struct q58 *C, uint8_t *w,
        float *scl, uint16_t *dh) {
    long nb = k / 32, bb = q8 ? 34 : 22, rb = C->rb;
    /* the next 64 rows' bytes (contiguous), a share each step: in cache when their turn comes */
    long nx = n - 64 * (b + 1), nxb = (nx < 0 ? 0 : nx > 64 ? 64 : nx) * rb, share = (nxb / 2 / nb + 64) & ~63L;
    const char *pf = (const char *)raw + 64 * (b + 1) * rb;
    for (int v = 0, st = 0; v < 4; v++) {
        long r0 = 64 * b + 16 * v, live = n - r0 < 0 ? 0 : n - r0 > 16 ? 16 : n - r0;
        for (long c = 0; c < nb; c += 2, st++) {
            for (long o = st * share, e = o + share; o < e && o < nxb; o += 64) _mm_prefetch(pf + o, _MM_HINT_T1);
            const uint8_t *bl = raw + (r0 * nb + c) * bb;
            uint8_t *wc = w + 8 * c * 256 + 64 * v;
            uint16_t *d0 = dh + c * 64 + 16 * v, *d1 = d0 + 64;
            if (live == 16 && c + 1 < nb) {
                if (q8) q58_16(bl, 1, C, wc, d0, d1);
                else q58_16(bl, 0, C, wc, d0, d1);
                continue;
            }
            __m512i u[16];
            for (int rr = 0; rr < 16; rr++)
                if (rr < live) u[rr] = pair58(bl + rr * rb, q8, c + 1 < nb, C->iq, d0 + rr, d1 + rr);
                else u[rr] = _mm512_setzero_si512(), d0[rr] = d1[rr] = 0;
            tr16r(u);
            for (int j = 0; j < 16; j++) _mm512_store_si512(wc + j * 256, u[j]);
        }
    }
    for (long j = 0; j < nb * 4; j++)
        _mm512_storeu_ps(scl + 16 * j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dh + 16 * j))));
}
#endif
/* out bf16 [m, np] = x bf16 [m, k] @ W.T for the int4 form (packed uint8 [np/64, k, 32], sz bf16 [k/32, np, 2]).
   1, or 0 where scratch could not be had (out unwritten). */
int q8_gemm(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *out, long mrows, long k,
             long np, int threads) {
#if VNNI
    long gs = k / 32;
    struct xint q;
    if (!quantize(x, mrows, k, 8, 0, threads, &q)) return 0;
    int ok = 1;
    /* byte 4l + i of a regrouped vector: k row i of the 4, byte l (+16 for the second) of the form's 32 */
    uint8_t ib[64];
    for (int l = 0; l < 16; l++)
        for (int i = 0; i < 4; i++) ib[4 * l + i] = (uint8_t)(32 * i + l);
    const __m512i i0 = _mm512_loadu_si512(ib), i1 = _mm512_add_epi8(i0, _mm512_set1_epi8(16)),
        nib = _mm512_set1_epi8(15);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < np / 64; b++) {
        uint8_t *w = scratch(1, (size_t)(k * 64));
        if (!w) {
#pragma omp atomic write
            ok = 0;
            continue;
        }
        const uint8_t *pb = packed + b * k * 32;
        for (long t = 0; t < k / 4; t++) {  /* 4 k rows of 64 outputs -> rows 0-15, 16-31, 32-47, 48-63 */
            __m512i l0 = _mm512_loadu_si512(pb + t * 128), l1 = _mm512_loadu_si512(pb + t * 128 + 64);
            __m512i p0 = _mm512_permutex2var_epi8(l0, i0, l1), p1 = _mm512_permutex2var_epi8(l0, i1, l1);
            uint8_t *d = w + t * 256;
            _mm512_store_si512(d, _mm512_and_si512(p0, nib));
            _mm512_store_si512(d + 64, _mm512_and_si512(p1, nib));
            _mm512_store_si512(d + 128, _mm512_and_si512(_mm512_srli_epi16(p0, 4), nib));
            _mm512_store_si512(d + 192, _mm512_and_si512(_mm512_srli_epi16(p1, 4), nib));
        }
        for (long m0 = 0, mr; m0 < mrows; m0 += mr)
            for (int p = 0; p < 2; p++) {
                const char *pf = m0 == 0 && p == 0 && b + 1 < np / 64 ? (const char *)(pb + k * 32) : NULL;
                const long pfg = k * 32 / gs;  /* bytes of the next block a group */
                const int8_t *xm = q.xq + m0 * k;
                const float *dm = q.dx + m0 * gs, *sm = q.xs + m0 * gs;
                const int32_t *nm = q.nb + m0 * gs;
                uint16_t *om = out + m0 * np;
                switch (mr = mrows - m0 < MR ? mrows - m0 : MR) {
                case 1: rows(w, p, xm, dm, sm, nm, sz, k, np, 64 * b + 32 * p, 1, pf, pfg, om); break;
                case 2: rows(w, p, xm, dm, sm, nm, sz, k, np, 64 * b + 32 * p, 2, pf, pfg, om); break;
                case 3: rows(w, p, xm, dm, sm, nm, sz, k, np, 64 * b + 32 * p, 3, pf, pfg, om); break;
                default: rows(w, p, xm, dm, sm, nm, sz, k, np, 64 * b + 32 * p, MR, pf, pfg, om); break;
                }
            }
    }
    return ok;
#else
    return 0;
#endif
}
/* out bf16 [m, np] = x bf16 [m, k] @ W.T for GGUF rows raw [n, row bytes] of ggml type qtype (6 Q5_0, 8 Q8_0,
   14 Q6_K), used as stored: per 64-row block (np: n rounded up to 64; rows from n on weigh 0) the blocks decoded
   into this thread's scratch, then int8 dot products. 1, or 0 where scratch could not be had or qtype is another. */
int blocks_gemm(const uint16_t *x, const uint8_t *raw, uint16_t *out, long mrows, long k, long n, long np,
                int threads, int qtype) {
#if VNNI
    if (qtype != 6 && qtype != 8 && qtype != 14) return 0;
    const int gv = qtype == 14 ? 16 : 32, off = qtype == 14 ? 32 : qtype == 8 ? 128 : 16;
    struct xint q;
    if (!quantize(x, mrows, k, off, qtype == 14, threads, &q)) return 0;
    long gs = k / 32, kw = (k + 63) / 64 * 64;  /* kw: Q5_0 / Q8_0 decode 64 values at a time */
    const int32_t *ns = qtype == 14 ? q.n16 : q.nb;
    struct q58 C;
    q58_init(&C, k / 32 * (qtype == 8 ? 34 : 22));
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < np / 64; b++) {
        uint8_t *w = scratch(1, (size_t)(kw * 64 + k / gv * 64 * 4 + (k / 32 + 1) * 64 * 2));
        if (!w) {
#pragma omp atomic write
            ok = 0;
            continue;
        }
        float *scl = (float *)(w + kw * 64);
        if (qtype == 14) decode_q6k(raw, b, k, n, w, scl);
        else decode_q58(raw, b, k, n, qtype == 8, &C, w, scl, (uint16_t *)(scl + k / gv * 64));
        for (long m0 = 0, mr; m0 < mrows; m0 += mr)
            for (int p = 0; p < 2; p++) {
                const int8_t *xm = q.xq + m0 * k;
                const float *dm = q.dx + m0 * gs;
                const int32_t *nm = ns + m0 * (k / gv);
                uint16_t *om = out + m0 * np;
                long col = 64 * b + 32 * p;
                mr = mrows - m0 < MR ? mrows - m0 : MR;
#define RG(R, G) rowsg(w, scl, p, xm, dm, nm, k, np, col, R, G, om)
                if (gv == 16) switch (mr) { case 1: RG(1, 16); break; case 2: RG(2, 16); break;
                                            case 3: RG(3, 16); break; default: RG(MR, 16); }
                else switch (mr) { case 1: RG(1, 32); break; case 2: RG(2, 32); break;
                                   case 3: RG(3, 32); break; default: RG(MR, 32); }
#undef RG
            }
    }
    return ok;
#else
    return 0;
#endif
}
