"""The sampler's small integer and search steps for CPU tensors, each one C call instead of tens of tiny torch ops
(a step of the bundled tiny model is made of such ops).

Owns: `fold_mixed` (dgcli/sampling/draws.py's `uniform_at` / `token_ids_at` from a row's hash state and the
positions' mixed words), `locate_group` and `locate_column` (kernels/categorical.py's inverse-CDF search over the
group masses, then inside the chosen group), `group_logits_bf16` (the chosen groups' bf16 logits, each [W, H] block
of E read in place: no gathered copy), and their C source, built at first use (kernels/native.py).
Numbers: the same bits as the torch ops they replace (tests/sampling/test_draws.py, tests/kernels/test_categorical.py):
exact 32-bit unsigned words (uint32_t wraps by definition), the uniform's 53 bits converted exactly to float64 and
scaled by 2^-53 (exact); torch's CPU cumsum (a float64 running sum from 0, in order), its searchsorted (the same
binary search, `!(mid > value)` moving right), products and differences in float64 without contraction into FMAs
(-ffp-contract=off). The exponentials stay torch's. `group_logits_bf16` sums as the vocabulary tile's head GEMM
(oneDNN's bf16 brgemm, without AMX) does: fp32 lanes fed by vdpbf16ps k pair by k pair, in k chunks whose sums are
added; at H 160-2560 on the 2-core EPYC, the same bits as F.linear(rows, E) in every one of 65536 random logits (the
gather's bmm: 2-3 in 10^4 one bf16 step off where H > 1024); one bf16 step from an fp32 product elsewhere.
DGEMMA_NATIVE=0 (or DGEMMA_SAMPLER_NATIVE=0) keeps the torch ops.
Must not: know what the counters or groups mean (draws.py, categorical.py do), or be needed: None means "use the
torch ops" (no compiler, CUDA or strided tensors, another dtype).
"""

from __future__ import annotations

import ctypes

import torch

from . import gemm_bf16, native

_SOURCE = r"""
#include <stdint.h>
#define GOLDEN 0x9E3779B9u
#define FOLD 0x7F4A7C15u
static inline uint32_t mix(uint32_t x) { /* lowbias32 (Wellons) */
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}
/* out[i, j] for row states h[i] and mixed position words m[j] (their low 32 bits): f = mix((h ^ m) + FOLD) (the
   position's fold); vocab == 0: the uniform ((mix((f ^ mix(GOLDEN)) + FOLD) << 21 | mix((f ^ mix(GOLDEN + 1))
   + FOLD) >> 11) * 2^-53 into the doubles uout; else the id (f * vocab) >> 32 into iout. */
void fold_mixed(const int64_t *h, long n, const int64_t *m, long c, long vocab, double *uout, int64_t *iout) {
    const uint32_t w0 = mix(GOLDEN), w1 = mix(GOLDEN + 1u);
    for (long i = 0; i < n; i++) {
        const uint32_t hi_ = (uint32_t)h[i];
        for (long j = 0; j < c; j++) {
            const uint32_t f = mix((hi_ ^ (uint32_t)m[j]) + FOLD);
            if (vocab) {
                iout[i * c + j] = (int64_t)(((uint64_t)f * (uint64_t)vocab) >> 32);
            } else {
                const uint64_t a = mix((f ^ w0) + FOLD), b = mix((f ^ w1) + FOLD);
                uout[i * c + j] = (double)(int64_t)((a << 21) | (b >> 11)) * 0x1p-53;
            }
        }
    }
}
/* torch's searchsorted(right=True) on one sorted row: the first k with x[k] > v, by its binary search */
static long upper_bound(const double *x, long len, double v) {
    long lo = 0, hi = len;
    while (lo < hi) {
        long mid = lo + ((hi - lo) >> 1);
        if (!(x[mid] > v))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}
/* Rows of mass [n, g]: cum = cumsum(mass) (in place), target = u * cum[-1], grp = min(upper_bound(cum, target),
   g - 1), before = cum[grp - 1] (0 for the first group). */
void locate_group(double *mass, long n, long g, const double *u, int64_t *grp, double *target, double *before) {
    for (long i = 0; i < n; i++) {
        double *c = mass + i * g, s = 0;
        for (long k = 0; k < g; k++)
            s += c[k], c[k] = s;
        double t = u[i] * c[g - 1];
        long k = upper_bound(c, g, t);
        k = k < g - 1 ? k : g - 1;
        grp[i] = k, target[i] = t, before[i] = k > 0 ? c[k - 1] : 0.0;
    }
}
/* Rows of p [n, w] (p = exp(L - max) of the chosen group): cum = cumsum(p) (in place), j = upper_bound(cum,
   target - before), last = the last column with p > 0 (0 if none); pick = grp * w + min(j, last). */
void locate_column(double *p, long n, long w, const int64_t *grp, const double *target, const double *before,
                   int64_t *pick) {
    for (long i = 0; i < n; i++) {
        double *c = p + i * w, s = 0;
        long last = 0;
        for (long k = 0; k < w; k++) {
            if (c[k] > 0)
                last = k;
            s += c[k], c[k] = s;
        }
        long j = upper_bound(c, w, target[i] - before[i]);
        pick[i] = grp[i] * w + (j < last ? j : last);
    }
}
#ifdef __AVX512BF16__
#include <immintrin.h>
/* t[0..16): 16 rows of 16 dwords (bf16 pairs) -> t[p] = dword p of every row (a 16x16 transpose) */
static inline void transpose16(__m512i *t) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2)
        a[i] = _mm512_unpacklo_epi32(t[i], t[i + 1]), a[i + 1] = _mm512_unpackhi_epi32(t[i], t[i + 1]);
    for (int i = 0; i < 16; i += 4)  /* b[i + c]: rows i..i+3 of dword 4l + c in each 128-bit lane l */
        for (int q = 0; q < 2; q++)
            b[i + 2 * q] = _mm512_unpacklo_epi64(a[i + q], a[i + q + 2]),
            b[i + 2 * q + 1] = _mm512_unpackhi_epi64(a[i + q], a[i + q + 2]);
    for (int c = 0; c < 4; c++)  /* then a 4x4 transpose of 128-bit lanes across b[c], b[4 + c], b[8 + c], b[12 + c] */
        a[c] = _mm512_shuffle_i32x4(b[c], b[c + 4], 0x88), a[c + 4] = _mm512_shuffle_i32x4(b[c], b[c + 4], 0xdd),
        a[c + 8] = _mm512_shuffle_i32x4(b[c + 8], b[c + 12], 0x88),
        a[c + 12] = _mm512_shuffle_i32x4(b[c + 8], b[c + 12], 0xdd);
    for (int c = 0; c < 4; c++)
        for (int q = 0; q < 2; q++)
            t[c + 4 * q] = _mm512_shuffle_i32x4(a[c + 4 * q], a[c + 8 + 4 * q], 0x88),
            t[c + 8 + 4 * q] = _mm512_shuffle_i32x4(a[c + 4 * q], a[c + 8 + 4 * q], 0xdd);
}
#endif
/* out[i, j] = bf16_round(Σ_k x[i, k] e[grp[i] * w + j, k]) as float (j < w) for bf16 rows x [n, h], e [v, h]: one
   fp32 lane per column, k in order by vdpbf16ps pairs within chunks of kb, the chunks' sums added in order (the
   head GEMM's order here, oneDNN's brgemm). Rows over `threads` threads; the next row's block prefetched into L2.
   -1 (nothing written) without AVX512-BF16, for w % 16, h % 32, kb % 32 != 0 or a group outside [0, v / w). */
int group_logits_bf16(const uint16_t *x, long n, long h, const uint16_t *e, long v, const int64_t *grp, long w,
                      long kb, long threads, float *out) {
#ifdef __AVX512BF16__
    if (w % 16 || h % 32 || kb % 32 || kb <= 0)
        return -1;
    for (long i = 0; i < n; i++)
        if (grp[i] < 0 || grp[i] >= v / w)
            return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < n; i++) {
        const uint16_t *xi = x + i * h, *blk = e + grp[i] * w * h;
        const char *next = i + 1 < n && grp[i + 1] != grp[i] ? (const char *)(e + grp[i + 1] * w * h) : 0;
        for (long j0 = 0; j0 < w; j0 += 64) {
            const int nj = (w - j0 < 64 ? w - j0 : 64) / 16;  /* 16-column vectors in this pass */
            __m512 tot[4], part[4];
            for (long k0 = 0; k0 < h; k0 += kb) {
                for (int g = 0; g < 4; g++)
                    part[g] = _mm512_setzero_ps();
                for (long k = k0; k < h && k < k0 + kb; k += 32) {
                    __m512i t[4][16];
                    for (int g = 0; g < nj; g++) {
                        for (int r = 0; r < 16; r++) {
                            long j = j0 + g * 16 + r;
                            t[g][r] = _mm512_loadu_si512(blk + j * h + k);
                            if (next)
                                _mm_prefetch(next + (j * h + k) * 2, _MM_HINT_T1);
                        }
                        transpose16(t[g]);
                    }
                    for (int p = 0; p < 16; p++) {
                        __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(xi + k + 2 * p));
                        for (int g = 0; g < nj; g++)
                            part[g] = _mm512_dpbf16_ps(part[g], (__m512bh)t[g][p], xb);
                    }
                }
                for (int g = 0; g < nj; g++)
                    tot[g] = k0 ? _mm512_add_ps(tot[g], part[g]) : part[g];
            }
            for (int g = 0; g < nj; g++) {  /* round to bf16 (nearest even), back to float */
                __m256i b = (__m256i)_mm512_cvtneps_pbh(tot[g]);
                _mm512_storeu_ps(out + i * w + j0 + g * 16,
                                 _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
            }
        }
    }
    return 0;
#else
    return -1;
#endif
}
"""

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURE = {"fold_mixed": [_P, _L, _P, _L, _L, _P, _P], "locate_group": [_P, _L, _L, _P, _P, _P, _P],
              "locate_column": [_P, _L, _L, _P, _P, _P, _P],
              "group_logits_bf16": [_P, _L, _L, _P, _L, _P, _L, _L, _L, _P]}
_lib: list = []  # [the loaded library, or None]: filled at first use
_ON = native.switch("DGEMMA_SAMPLER_NATIVE")  # on unless DGEMMA_NATIVE or it is "0", read at each call


def _native():
    if not _ON():
        return None
    return native.load_once(_lib, "sampler_native", _SOURCE, _SIGNATURE, flags=("-ffp-contract=off",), direct=True)


def _cpu(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_cpu and b.is_cpu and a.is_contiguous() and b.is_contiguous()  # (is_cpu: no torch.device made)


def fold_mixed(states: torch.Tensor, mixed: torch.Tensor, vocab_size: int = 0) -> torch.Tensor | None:
    """[n, C] float64 uniforms (vocab_size 0) or int64 ids in [0, vocab_size) from hash states [n, 1] and mixed
    position words [C] (int64, CPU); None where the C function does not apply."""
    if not _cpu(states, mixed) or states.dtype != torch.long or mixed.dtype != torch.long or states.dim() != 2 \
            or states.shape[1] != 1 or mixed.dim() != 1:
        return None
    lib = _native()
    if lib is None:
        return None
    n, c = states.shape[0], mixed.shape[0]
    out = torch.empty(n, c, dtype=torch.long if vocab_size else torch.float64)
    lib.fold_mixed(states.data_ptr(), n, mixed.data_ptr(), c, vocab_size,
                   None if vocab_size else out.data_ptr(), out.data_ptr() if vocab_size else None)
    return out


def locate_group(mass: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The group each row's target u·Σmass falls in: (group [N] int64, target [N], mass before the group [N]) from
    group masses [N, G] (float64; overwritten by their cumsum) and uniforms u [N] (float64); None: use torch."""
    if not mass.is_cpu or not u.is_cpu:
        return None
    mass, u = mass.contiguous(), u.contiguous()  # no copy for the pass's own results
    if not _cpu(mass, u) or mass.dtype != torch.float64 or u.dtype != torch.float64 or mass.dim() != 2 \
            or mass.shape[1] < 1 or u.shape != mass.shape[:1]:
        return None
    lib = _native()
    if lib is None:
        return None
    n, g = mass.shape
    grp = torch.empty(n, dtype=torch.long)
    target, before = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    lib.locate_group(mass.data_ptr(), n, g, u.data_ptr(), grp.data_ptr(), target.data_ptr(), before.data_ptr())
    return grp, target, before


def locate_column(p: torch.Tensor, grp: torch.Tensor, target: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The drawn column [N] (int64) from `locate_group`'s outputs and the chosen groups' weights p [N, W] (float64;
    overwritten by their cumsum). Called only after `locate_group` answered."""
    p = p.contiguous()
    n, w = p.shape
    pick = torch.empty(n, dtype=torch.long)
    _native().locate_column(p.data_ptr(), n, w, grp.data_ptr(), target.data_ptr(), before.data_ptr(),
                            pick.data_ptr())
    return pick


def group_logits_bf16(rows: torch.Tensor, embed: torch.Tensor, group: torch.Tensor, width: int) -> torch.Tensor | None:
    """The head's logits [N, width] (float32 holding bf16 values) of columns group·width + [0, width) for bf16 rows
    [N, H] and embedding [V, H] (CPU, contiguous, V % width == 0), each block read in place; None: use torch."""
    if not _cpu(rows, embed) or not group.is_cpu or not group.is_contiguous() or rows.dtype != torch.bfloat16 \
            or embed.dtype != torch.bfloat16 or group.dtype != torch.long or rows.dim() != 2 or embed.dim() != 2 \
            or embed.shape[0] % width or rows.shape[1] != embed.shape[1] or group.shape != rows.shape[:1]:
        return None
    lib = _native()
    if lib is None:
        return None
    (n, h), v = rows.shape, embed.shape[0]
    out = torch.empty(n, width)
    # oneDNN's K blocking for its bf16 head GEMM here (a tile of many rows): the k chunks whose fp32 sums it adds
    kb = gemm_bf16.chunk(h, rows=2)
    if lib.group_logits_bf16(rows.data_ptr(), n, h, embed.data_ptr(), v, group.data_ptr(), width, kb,
                             torch.get_num_threads(), out.data_ptr()) != 0:
        return None
    return out
