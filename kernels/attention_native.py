"""Unmasked bf16 attention on CPU in one C function: softmax(Q K^T) V with scale 1, GQA, written into a given view.

Owns: `attend(q, k, v, out)` (q [B, Hq, R, d], k, v [B, Hk, S, d] bf16, Hq a multiple of Hk, d a multiple of 32
up to 512, any strides with the last dimension contiguous; out [B, Hq, R, d] bf16, written in place) and its C
source, built at first use (kernels/native.py). Per (batch, kv head) K is packed once as panels
[S/16][d/2][16][2] and V as key pairs in blocks of 32 columns [d/32][S/2][32][2] (the operands of `vdpbf16ps`);
then per (batch, q head, block of up to 12 rows): the scores in fp32 (Q pairs broadcast against K panels,
12 rows x 32 keys in 24 registers), the row max, exp (glibc's libmvec `_ZGVeN16v_expf`, called by name: the
lanes and the sum's order are this file's, not the vectoriser's), the sum in fp32, P rounded to bf16,
O = P V in fp32 (12 rows x 32 columns), times 1/sum, rounded to bf16. Work runs in parallel over (batch,
q head, row block) on torch's thread count; K and V take one packed copy per call, their own size (up to
PACK_BYTES: longer key sets, long contexts' full layers, keep SDPA, which copies nothing).
Must not: take a mask (causal calls keep torch's SDPA), another dtype or a scale other than 1, run on CUDA, or
be needed: None means "use SDPA" (no compiler, a CPU without AVX512-BF16, a shape outside the above, not asked
for: it runs only under DGEMMA_BF16_FAST=1, and never with DGEMMA_NATIVE=0 or DGEMMA_KERNELS=reference).

Why: torch's CPU flash kernel runs ~125 GFLOP/s at the bundled model's shapes (8 heads, 256 rows, 288 keys,
d 128; 2 threads), ~30 % of the bf16 GEMM rate; its attention was ~6 % of a 200 M step.
Bits: torch's flash kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, torch 2.x) also computes the
scores in fp32 from bf16 products, exp(s - max) in fp32 (Sleef's exp_u20), the sum of the unrounded fp32
exponentials, P rounded to bf16 before P V accumulated in fp32, and the output times 1/sum; it splits the keys
in blocks of 512 and rescales across them (online softmax). Here every row reads all its keys at once, the dot
products run in another order (`vdpbf16ps` pairs, which flushes denormals), exp is libmvec's (a few ulp) of
s - max clamped at -87 (a weight below 1.6e-38 is 1.6e-38: no sum, and no output above ~1e-37, moves): P can
round to the neighbouring bf16 and the output differs from SDPA's by about a bf16 step (tests/kernels/
test_attention_native.py bounds it, and against an fp32 softmax(Q K^T) V of the same inputs). A row's result
depends only on its own q and its batch's keys: not on the other rows, the batch, the block or the thread count.
So it is opt-in (DGEMMA_BF16_FAST=1, kernels/native.py::fast_bf16): by default SDPA runs, the reference's bits,
which the bf16 parity tests against transformers (tests/model/test_model_parity.py) need: on their random models a
bf16 step per call grows to 0.03-1.2 in the logits (a flipped expert choice), past their 0.02 bound, as
transformers' own eager attention differs from its SDPA by 0.19-0.53 there. tests/model/test_bf16_fast.py holds
the fast mode to the accuracy of the reference's bf16 instead.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
int attn_ok(void) { return 1; }
#define MR 12
__m512 _ZGVeN16v_expf(__m512);  /* glibc libmvec: 16-lane expf */

static inline __m512bh pair(const uint16_t *p) {  /* two bf16 at p, broadcast to 16 lanes */
    int32_t x;
    memcpy(&x, p, 4);
    return (__m512bh)_mm512_set1_epi32(x);
}

/* K [s, d] (row stride ldk) -> panels of 16 keys [sp/16][d/2][16][2], zero past key s (sp: s rounded up to 32) */
static void pack_k(const uint16_t *k, long ldk, long s, long sp, long d, uint16_t *p) {
    for (long j = 0; j < sp / 16; j++) {
        uint32_t *dst = (uint32_t *)(p + j * 16 * d);
        for (long l = 0; l < 16; l++) {
            long key = j * 16 + l;
            if (key < s) {
                const uint16_t *src = k + key * ldk;
                for (long t = 0; t < d / 2; t++) {
                    uint32_t x;
                    memcpy(&x, src + 2 * t, 4);
                    dst[t * 16 + l] = x;
                }
            } else {
                for (long t = 0; t < d / 2; t++) dst[t * 16 + l] = 0;
            }
        }
    }
}

/* V [s, d] (row stride ldv) -> blocks of 32 columns [d/32][sp/2][32][2] (key pairs), zero past key s: a block's
   pairs one stream (a stride of 2d elements would keep ~8 of L1's 64 sets) */
static void pack_v(const uint16_t *v, long ldv, long s, long sp, long d, uint16_t *p) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (long t = 0; t < sp / 2; t++) {
        long a = 2 * t, b = 2 * t + 1;
        for (long c = 0; c < d; c += 32) {
            uint16_t *dst = p + c * sp + t * 64;
            __m512i x = a < s ? _mm512_loadu_si512(v + a * ldv + c) : _mm512_setzero_si512();
            __m512i y = b < s ? _mm512_loadu_si512(v + b * ldv + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* Scores of R rows (q, row stride ldq) against keys 32j .. 32j+31 (two panels at kp) into sc [R][lds] + 32j:
   sums over d in pair order, from 0. */
static inline __attribute__((always_inline)) void qk(const int R, const uint16_t *q, long ldq, const uint16_t *kp,
                                                     long d, float *sc, long lds) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t *k1 = kp + 16 * d;
    for (long t = 0; t < d / 2; t++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(kp + t * 32), w1 = (__m512bh)_mm512_loadu_si512(k1 + t * 32);
        for (int r = 0; r < R; r++) {
            __m512bh x = pair(q + r * ldq + 2 * t);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_store_ps(sc + r * lds, acc[r][0]);
        _mm512_store_ps(sc + r * lds + 16, acc[r][1]);
    }
}

/* 32 columns of R rows: (P [R][ldp] bf16 over np key pairs) V (the columns' block at vp, [.][32][2]) times
   inv[r], rounded to bf16 into o (row stride ldo). Sums over the key pairs in order, from 0. */
static inline __attribute__((always_inline)) void pv(const int R, const uint16_t *pb, long ldp, const uint16_t *vp,
                                                     long np, const float *inv, uint16_t *o, long ldo) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (long t = 0; t < np; t++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(vp + t * 64), w1 = (__m512bh)_mm512_loadu_si512(vp + t * 64 + 32);
        for (int r = 0; r < R; r++) {
            __m512bh x = pair(pb + r * ldp + 2 * t);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 s = _mm512_set1_ps(inv[r]);
        _mm256_storeu_si256((__m256i *)(o + r * ldo), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][0], s)));
        _mm256_storeu_si256((__m256i *)(o + r * ldo + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][1], s)));
    }
}

/* One row's softmax over s scores (sc, sp of them, 64-byte aligned): exp(x - max) rounded to bf16 into pb (zero
   past s); 1/sum of the unrounded exponentials. The same instructions for every row. */
static float softmax(float *sc, long s, long sp, uint16_t *pb) {
    __m512 vm = _mm512_set1_ps(-INFINITY), vz = _mm512_setzero_ps();
    for (long j = 0; j < sp; j += 16) {
        __mmask16 k = s - j >= 16 ? (__mmask16)0xFFFF : s > j ? (__mmask16)((1u << (s - j)) - 1) : 0;
        vm = _mm512_mask_max_ps(vm, k, vm, _mm512_load_ps(sc + j));
    }
    float m = _mm512_reduce_max_ps(vm);
    __m512 mv = _mm512_set1_ps(m > -INFINITY ? m : 0.0f);  /* no finite score: every exponential is 0 */
    /* exp(-87) = 1.6e-38: a weight that changes neither the sum nor, times V, any output above ~1e-37; below it
       libmvec takes a scalar path for the lane (~20x slower: d 512's scores often span that much) */
    const __m512 lo = _mm512_set1_ps(-87.0f);
    for (long j = 0; j < sp; j += 16) {
        __mmask16 k = s - j >= 16 ? (__mmask16)0xFFFF : s > j ? (__mmask16)((1u << (s - j)) - 1) : 0;
        __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_load_ps(sc + j), mv), lo);
        __m512 e = _mm512_maskz_mov_ps(k, _ZGVeN16v_expf(x));
        vz = _mm512_add_ps(vz, e);
        _mm256_store_si256((__m256i *)(pb + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return 1.0f / _mm512_reduce_add_ps(vz);
}

static inline __attribute__((always_inline)) void rows(const int R, const uint16_t *q, long ldq, const uint16_t *kp,
                                                       const uint16_t *vp, long s, long sp, long d, float *sc,
                                                       uint16_t *pb, uint16_t *o, long ldo) {
    float inv[MR];
    for (long j = 0; j < sp; j += 32) qk(R, q, ldq, kp + j * d, d, sc + j, sp);
    for (int r = 0; r < R; r++) inv[r] = softmax(sc + r * sp, s, sp, pb + r * sp);
    for (long c = 0; c < d; c += 32) pv(R, pb, sp, vp + c * sp, (s + 1) / 2, inv, o + c, ldo);
}

#define CASE(R) case R: rows(R, q, ldq, kp, vp, s, sp, d, sc, pb, o, ldo); break;
static void block(int nr, const uint16_t *q, long ldq, const uint16_t *kp, const uint16_t *vp, long s, long sp,
                  long d, float *sc, uint16_t *pb, uint16_t *o, long ldo) {
    switch (nr) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
    }
}

/* o[b, h] = softmax(q[b, h] k[b, h/g]^T) v[b, h/g] for every batch b < nb and q head h < hq (g = hq / hk); each
   tensor given by its pointer and its batch, head and row strides (in elements). 0, or -1 where memory ran out. */
int attend(const uint16_t *q, long qb, long qh, long qr, const uint16_t *k, long kb, long kh, long kr,
           const uint16_t *v, long vb, long vh, long vr, uint16_t *o, long ob, long oh, long orow,
           long nb, long hq, long hk, long r, long s, long d, int threads) {
    long sp = (s + 31) / 32 * 32, g = hq / hk, blocks = (r + MR - 1) / MR, each = sp * d;
    uint16_t *kp = aligned_alloc(64, nb * hk * each * 2 * 2);
    uint16_t *vp = kp + nb * hk * each;
    int failed = kp == NULL;
#pragma omp parallel num_threads(threads) if (threads > 1 && !failed)
    {
        float *sc = failed ? NULL : aligned_alloc(64, MR * sp * 4);
        uint16_t *pb = failed ? NULL : aligned_alloc(64, MR * sp * 2);
        if (!failed) {
#pragma omp for schedule(static)
            for (long i = 0; i < nb * hk; i++) {
                long b = i / hk, h = i % hk;
                pack_k(k + b * kb + h * kh, kr, s, sp, d, kp + i * each);
                pack_v(v + b * vb + h * vh, vr, s, sp, d, vp + i * each);
            }
            if (!sc || !pb) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp barrier
            if (!failed) {
#pragma omp for schedule(static)
                for (long w = 0; w < nb * hq * blocks; w++) {
                    long b = w / (hq * blocks), h = w / blocks % hq, r0 = w % blocks * MR;
                    long i = b * hk + h / g;
                    int nr = r - r0 < MR ? (int)(r - r0) : MR;
                    block(nr, q + b * qb + h * qh + r0 * qr, qr, kp + i * each, vp + i * each, s, sp, d, sc, pb,
                          o + b * ob + h * oh + r0 * orow, orow);
                }
            }
        }
        free(sc);
        free(pb);
    }
    free(kp);
    return failed ? -1 : 0;
}
#else /* no AVX512-BF16 target: a library that says so (built once, not retried by every process) */
int attn_ok(void) { return 0; }
int attend(void) { return -1; }
#endif
"""

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURE = {"attend": [_P, _L, _L, _L, _P, _L, _L, _L, _P, _L, _L, _L, _P, _L, _L, _L, _L, _L, _L, _L, _L, _L, _I],
              "attn_ok": []}
_lib: list = []  # [the loaded library, or None]: filled at first use
PACK_BYTES = 64 << 20  # the most a call's packed K and V may take (a canvas of the 200 M model: ~0.6 MiB)


def _library():
    return native.load_once(_lib, "attention_native", _SOURCE, _SIGNATURE, ok="attn_ok", libs=("-lmvec",), direct=True)


def _native():
    if not native.fast_bf16() or native.getenv("DGEMMA_KERNELS") == "reference":  # the reference's ops: SDPA
        return None
    return _library()


def enabled() -> bool:
    """bf16 canvases attend here in C: DGEMMA_BF16_FAST=1 and the library built (what bench rows report)."""
    return _native() is not None


def available() -> bool:
    """The C attention can run here (a compiler, AVX512-BF16), whether or not DGEMMA_BF16_FAST asks for it."""
    return _library() is not None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """out [B, Hq, R, d] = softmax(q k^T) v (scale 1, GQA: q head h reads kv head h // (Hq / Hk)), or None (out
    untouched) where the C kernel does not apply: the caller runs SDPA."""
    bf16 = torch.bfloat16
    if q.dtype != bf16 or not native.fast_bf16():  # the default's calls stop here: not asked for (two dict reads)
        return None
    if k.dtype != bf16 or v.dtype != bf16 or out.dtype != bf16 or not q.is_cpu or not k.is_cpu \
            or not v.is_cpu or not out.is_cpu or q.dim() != 4 or out.shape != q.shape:
        return None
    nb, hq, r, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    if k.shape != (nb, hk, s, d) or v.shape != k.shape or hk == 0 or hq % hk or d % 32 or not 0 < d <= 512 \
            or s == 0 or q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or out.stride(3) != 1:
        return None
    lib = _native()
    if lib is None:
        return None
    if nb * hk * -(-s // 32) * 32 * d * 4 > PACK_BYTES:
        return None
    if nb and r and hq:
        threads = torch.get_num_threads() if nb * hq * r * s * d >= 1 << 18 else 1
        if lib.attend(q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
                      out.data_ptr(), *out.stride()[:3], nb, hq, hk, r, s, d, threads):
            return None
    return out
