"""The sampler's small integer and search steps for CPU tensors, each one C call instead of tens of tiny torch ops
(a step of the bundled tiny model is made of such ops).

Owns: `fold_mixed` (dgcli/sampling/draws.py's `uniform_at` / `token_ids_at` from a row's hash state and the
positions' mixed words), `locate_group` and `locate_column` (kernels/categorical.py's inverse-CDF search over the
group masses, then inside the chosen group), and their C source, built at first use (kernels/native.py).
Numbers: the same bits as the torch ops they replace (tests/sampling/test_draws.py, tests/kernels/test_categorical.py):
exact 32-bit unsigned words (uint32_t wraps by definition), the uniform's 53 bits converted exactly to float64 and
scaled by 2^-53 (exact); torch's CPU cumsum (a float64 running sum from 0, in order), its searchsorted (the same
binary search, `!(mid > value)` moving right), products and differences in float64 without contraction into FMAs
(-ffp-contract=off). The exponentials stay torch's. DGEMMA_NATIVE=0 (or DGEMMA_SAMPLER_NATIVE=0) keeps the torch ops.
Must not: know what the counters or groups mean (draws.py, categorical.py do), or be needed: None means "use the
torch ops" (no compiler, CUDA or strided tensors, another dtype).
"""

from __future__ import annotations

import ctypes

import torch

from . import native

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
"""

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURE = {"fold_mixed": [_P, _L, _P, _L, _L, _P, _P], "locate_group": [_P, _L, _L, _P, _P, _P, _P],
              "locate_column": [_P, _L, _L, _P, _P, _P, _P]}
_lib: list = []  # [the loaded library, or None]: filled at first use
_ON = native.switch("DGEMMA_SAMPLER_NATIVE")  # on unless DGEMMA_NATIVE or it is "0", read at each call


def _native():
    if not _ON():
        return None
    if not _lib:
        _lib.append(native.build("sampler_native", _SOURCE, _SIGNATURE, flags=("-ffp-contract=off",),
                                 direct=True))
    return _lib[0]


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
