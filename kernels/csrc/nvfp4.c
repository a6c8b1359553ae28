/* NVFP4 rows decoded to bf16 (kernels/nvfp4.py's `decode`, the same bits): per group of 16, the factor
   e4m3 / global (or x global) in fp32, its 16 products with the E2M1 values rounded to bf16 (nearest even)
   into a table, then each byte's two codes looked up. Rows split over OpenMP threads. */
#include <stdint.h>
#include <string.h>
static const float E2M1[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
static float e4m3(uint8_t b) {  /* float8_e4m3fn value (0x7F/0xFF never appear in a checkpoint) */
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? (float)(8 + m) * (float)(1 << e) / 1024.f : (float)m / 512.f;  /* exact: a power of two apart */
    return (b & 0x80) ? -v : v;
}
static uint16_t bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
void nvfp4_decode(const uint8_t *packed, const uint8_t *scale, const float *glob, int divide, long n, long k,
                  uint16_t *out) {
    #pragma omp parallel for schedule(static)
    for (long r = 0; r < n; r++) {
        uint16_t t[16];
        for (long g = 0; g < k / 16; g++) {
            float f = divide ? e4m3(scale[r * (k / 16) + g]) / glob[r] : e4m3(scale[r * (k / 16) + g]) * glob[r];
            for (int c = 0; c < 8; c++) {  /* the negative codes: the same products, sign flipped */
                t[c] = bf16(E2M1[c] * f);
                t[c + 8] = t[c] ^ 0x8000;
            }
            const uint8_t *p = packed + r * (k / 2) + g * 8;
            uint16_t *o = out + r * k + g * 16;
            for (int j = 0; j < 8; j++) {
                o[2 * j] = t[p[j] & 15];
                o[2 * j + 1] = t[p[j] >> 4];
            }
        }
    }
}
