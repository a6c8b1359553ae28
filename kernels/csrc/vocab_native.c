#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* glibc's vector tanh and exp (libmvec), as its math.h declares them under -ffast-math, which is not used here */
extern float tanhf(float) __attribute__((simd("notinbranch")));
extern float expf(float) __attribute__((simd("notinbranch")));
/* Rows of one vocabulary tile R [n, t] (bf16 or fp32, row stride ldr): L = softcap * tanh(R / softcap) / temp
   (temp[i * ldt]), written over R when it is fp32; its max and first argmax; round(L) to bf16 (nearest even) into
   store [n, t] (stride lds) when given; then e = exp(L - max): zt = sum e, st = sum e (L - max), gz [n, groups]
   = sum e per `width` columns, and e over L (what an fp32 soft embedding weights its rows by). */
void tile_stats(void *raw, int raw_bf16, long n, long t, long ldr, float softcap, const float *temp, long ldt,
                uint16_t *store, long lds, long width, float *tmax, int64_t *targ, float *zt, float *st, float *gz,
                int threads) {
    long groups = (t + width - 1) / width;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *buf = raw_bf16 ? malloc(sizeof(float) * t) : NULL;
#pragma omp for schedule(static)
        for (long i = 0; i < n; i++) {
            float *l = raw_bf16 ? buf : (float *)raw + i * ldr, tp = temp[i * ldt], m = -FLT_MAX;
            if (raw_bf16) {
                const uint16_t *r = (const uint16_t *)raw + i * ldr;
#pragma omp simd
                for (long j = 0; j < t; j++) {
                    uint32_t u = (uint32_t)r[j] << 16;
                    memcpy(l + j, &u, 4);
                }
            }
            if (softcap > 0) {
#pragma omp simd reduction(max : m)
                for (long j = 0; j < t; j++) {
                    float v = tanhf(l[j] / softcap) * softcap / tp;
                    l[j] = v, m = v > m ? v : m;
                }
            } else {
#pragma omp simd reduction(max : m)
                for (long j = 0; j < t; j++) {
                    float v = l[j] / tp;
                    l[j] = v, m = v > m ? v : m;
                }
            }
            long a = 0;
            while (a < t - 1 && l[a] != m)
                a++;
            if (store) {
                uint16_t *s = store + i * lds;
#pragma omp simd
                for (long j = 0; j < t; j++) {
                    uint32_t u;
                    memcpy(&u, l + j, 4);
                    s[j] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                }
            }
            float z = 0, q = 0;
            for (long g = 0; g < groups; g++) {
                long lo = g * width, hi = lo + width < t ? lo + width : t;
                float gs = 0;
#pragma omp simd reduction(+ : gs, q)
                for (long j = lo; j < hi; j++) {
                    float d = l[j] - m, e = expf(d);
                    gs += e, q += e * d, l[j] = e;
                }
                gz[i * groups + g] = gs, z += gs;
            }
            tmax[i] = m, targ[i] = a, zt[i] = z, st[i] = q;
        }
        free(buf);
    }
}
