#ifndef DGEMMA_Q6K_HELPERS_H
#define DGEMMA_Q6K_HELPERS_H
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
static inline void tr16r(__m512i r[16]) {  /* 16 x 16 transpose of 32-bit words, in registers */
    __m512i t[16];
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
}
static inline void tr16(const uint32_t *src, long ls, uint32_t *dst, long ld) {  /* the same, memory to memory */
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * ls);
    tr16r(r);
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
#endif
