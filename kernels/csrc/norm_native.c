#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float bf2f(uint16_t h) { /* bf16 -> fp32 */
    uint32_t u = (uint32_t)h << 16;
    float f;
    return memcpy(&f, &u, 4), f;
}
static inline uint16_t f2bf(float f) { /* fp32 -> bf16, nearest even; NaN -> 0x7FC0 as torch's scalar cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* sum(v[j]^2) in torch's order (ATen's cascade_sum over a contiguous row in fp32, as its 8-float-vector kernels
   run it: x86 builds register no AVX512 sum): the squares, then row_sum over 8-lane vectors (4 interleaved
   accumulators, each a 4-level cascade of blocks of at least 2^4), the scalar tail from 0, then the 8 lanes in
   order; rows under 8 wide: the same over scalars. sq: d floats. */
#define VL 8
static inline __attribute__((always_inline)) void multi_row_sum(const float *e, long size, long lanes,
                                                                float acc0[4][VL]) {
    float acc[4][4][VL] = {{{0}}};
    long lg = 0; /* ceil(log2(size)) */
    while ((1L << lg) < size)
        lg++;
    long power = lg / 4 > 4 ? lg / 4 : 4, step = 1L << power, mask = step - 1, i = 0;
    while (i + step <= size) {
        for (long j = 0; j < step; j++, i++)
            for (long k = 0; k < 4; k++)
                for (long l = 0; l < lanes; l++)
                    acc[0][k][l] += e[(i * 4 + k) * lanes + l];
        for (long j = 1; j < 4; j++) {
            for (long k = 0; k < 4; k++)
                for (long l = 0; l < lanes; l++)
                    acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0;
            if ((i & (mask << (j * power))) != 0)
                break;
        }
    }
    for (; i < size; i++)
        for (long k = 0; k < 4; k++)
            for (long l = 0; l < lanes; l++)
                acc[0][k][l] += e[(i * 4 + k) * lanes + l];
    for (long j = 1; j < 4; j++)
        for (long k = 0; k < 4; k++)
            for (long l = 0; l < lanes; l++)
                acc[0][k][l] += acc[j][k][l];
    memcpy(acc0, acc[0], sizeof(acc[0]));
}

/* ATen's row_sum over `size` elements of `lanes` floats: sums[0..lanes) */
static inline __attribute__((always_inline)) void row_sum(const float *e, long size, long lanes, float *sums) {
    float part[4][VL];
    long ilp = size / 4;
    multi_row_sum(e, ilp, lanes, part);
    for (long i = ilp * 4; i < size; i++)
        for (long l = 0; l < lanes; l++)
            part[0][l] += e[i * lanes + l];
    for (long k = 1; k < 4; k++)
        for (long l = 0; l < lanes; l++)
            part[0][l] += part[k][l];
    memcpy(sums, part[0], sizeof(float) * lanes);
}

static float sum_sq(const float *v, long d, float *sq) {
#pragma omp simd
    for (long j = 0; j < d; j++)
        sq[j] = v[j] * v[j];
    float lanes[VL], s = 0;
    if (d < VL)
        return row_sum(sq, d, 1, lanes), lanes[0];
    long nv = d / VL;
    row_sum(sq, nv, VL, lanes);
    for (long k = nv * VL; k < d; k++)
        s += sq[k];
    for (long l = 0; l < VL; l++)
        s += lanes[l];
    return s;
}

/* out [n, d] (row stride ldo) = residual + round(Norm_w(x + pre)); x, pre, res and out in one dtype (bf16 when
   bf16), w fp32 (wkind 1), bf16 (2) or none (0); pre and res may be NULL. Rows lo..hi; buf: 2d floats. */
static void norm_rows(long lo, long hi, const void *x, long ldx, const void *pre, long ldp, const void *res,
                      long ldr, void *out, long ldo, long d, int bf16, const float *wf, float eps, float *buf) {
    for (long i = lo; i < hi; i++) {
        const float *v = buf; /* the row as fp32: x, or round(x + pre) */
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + i * ldx, *pr = pre ? (const uint16_t *)pre + i * ldp : xr;
#pragma omp simd
            for (long j = 0; j < d; j++)
                buf[j] = pre ? bf2f(f2bf(bf2f(xr[j]) + bf2f(pr[j]))) : bf2f(xr[j]);
        } else if (pre) {
            const float *xr = (const float *)x + i * ldx, *pr = (const float *)pre + i * ldp;
#pragma omp simd
            for (long j = 0; j < d; j++)
                buf[j] = xr[j] + pr[j];
        } else {
            v = (const float *)x + i * ldx;
        }
        float r = 1.0f / sqrtf(sum_sq(v, d, buf + d) / (float)d + eps);
#pragma omp simd
        for (long j = 0; j < d; j++)
            buf[j] = wf ? v[j] * r * wf[j] : v[j] * r;
        if (bf16) {
            uint16_t *o = (uint16_t *)out + i * ldo;
            const uint16_t *rr = res ? (const uint16_t *)res + i * ldr : o;
#pragma omp simd
            for (long j = 0; j < d; j++)
                o[j] = res ? f2bf(bf2f(rr[j]) + bf2f(f2bf(buf[j]))) : f2bf(buf[j]);
        } else {
            float *o = (float *)out + i * ldo;
            const float *rr = res ? (const float *)res + i * ldr : o;
#pragma omp simd
            for (long j = 0; j < d; j++)
                o[j] = res ? rr[j] + buf[j] : buf[j];
        }
    }
}

void rms_norm(const void *x, long ldx, const void *pre, long ldp, const void *res, long ldr, void *out, long ldo,
              long n, long d, int bf16, const void *w, int wkind, float eps, int threads) {
    float *wf = NULL;
    if (wkind == 1)
        wf = (float *)w;
    else if (wkind == 2) {
        wf = malloc(sizeof(float) * d);
        for (long j = 0; j < d; j++)
            wf[j] = bf2f(((const uint16_t *)w)[j]);
    }
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            float *buf = malloc(sizeof(float) * 2 * d);
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            norm_rows(n * t / nt, n * (t + 1) / nt, x, ldx, pre, ldp, res, ldr, out, ldo, d, bf16, wf, eps, buf);
            free(buf);
        }
    } else
#endif
    {
        float *buf = malloc(sizeof(float) * 2 * d);
        norm_rows(0, n, x, ldx, pre, ldp, res, ldr, out, ldo, d, bf16, wf, eps, buf);
        free(buf);
    }
    if (wkind == 2)
        free(wf);
}

/* out = round(round(gelu_tanh(g)) * u), g and u [n, d] (row stride ld), all bf16 or all fp32, out [n, d]
   contiguous, with torch's AVX512 CPU kernel's bits: its loops run over runs of elements (the flat index cut into
   `chunk`-long pieces, one per torch thread, and, where ld != d, at row ends); in each run the first whole
   multiples of 2 vectors go through Sleef_tanhf16_u10 (`tanh16`, torch's own), the rest through glibc's scalar
   tanhf; both compute x + 0.044715 x^3 with one FMA, as torch's build does. 0 = done, -1 = no AVX512 here. */
#ifdef __AVX512F__
typedef __m512 (*tanh16_t)(__m512);

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}

/* 16 floats to bf16 bits in 32-bit lanes, nearest even; NaN to 0x7FC0 (f2bf) */
static inline __m512i round_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
}

static void gelu_run(const void *g, const void *u, void *out, long len, int bf16, tanh16_t tanh16) {
    const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    long nv = len / (bf16 ? 64 : 32) * (bf16 ? 64 : 32), k = 0;
    const __m512 vb = _mm512_set1_ps(beta), vk = _mm512_set1_ps(kappa), half = _mm512_set1_ps(0.5f),
                 one = _mm512_set1_ps(1.0f);
    for (; k < nv; k += 16) {
        __m512 v = bf16 ? load_bf16((const uint16_t *)g + k) : _mm512_loadu_ps((const float *)g + k);
        __m512 c = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        __m512 a = _mm512_mul_ps(_mm512_mul_ps(half, v),
                                 _mm512_add_ps(one, tanh16(_mm512_mul_ps(vb, _mm512_fmadd_ps(vk, c, v)))));
        if (bf16) {
            a = _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(a), 16));
            __m512i o = round_bf16(_mm512_mul_ps(a, load_bf16((const uint16_t *)u + k)));
            _mm256_storeu_si256((void *)((uint16_t *)out + k), _mm512_cvtepi32_epi16(o));
        } else {
            _mm512_storeu_ps((float *)out + k, _mm512_mul_ps(a, _mm512_loadu_ps((const float *)u + k)));
        }
    }
    for (; k < len; k++) {
        float v = bf16 ? bf2f(((const uint16_t *)g)[k]) : ((const float *)g)[k], c = v * v * v;
        float a = 0.5f * v * (1.0f + tanhf(beta * fmaf(kappa, c, v)));
        if (bf16)
            ((uint16_t *)out)[k] = f2bf(bf2f(f2bf(a)) * bf2f(((const uint16_t *)u)[k]));
        else
            ((float *)out)[k] = a * ((const float *)u)[k];
    }
}
#endif

int gelu_mul(const void *g, const void *u, long ld, void *out, long n, long d, int bf16, long chunk, void *tanh16,
             int threads) {
#ifdef __AVX512F__
    long total = n * d, pieces = (total + chunk - 1) / chunk, es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static, 1)
    for (long c = 0; c < pieces; c++) {
        long lo = c * chunk, hi = lo + chunk < total ? lo + chunk : total;
        while (lo < hi) { /* one run: to the piece's end, or to the row's end where rows are apart */
            long row = lo / d, col = lo % d, end = ld == d ? hi : (row + 1) * d < hi ? (row + 1) * d : hi;
            long off = (row * ld + col) * es;
            gelu_run((const char *)g + off, (const char *)u + off, (char *)out + lo * es, end - lo, bf16,
                     (tanh16_t)tanh16);
            lo = end;
        }
    }
    return 0;
#else
    return -1;
#endif
}
