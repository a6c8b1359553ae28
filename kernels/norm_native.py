"""The layer's elementwise chains on CPU in one pass over memory each: RMSNorm (with its residual add and the add
before it) and the gated GELU(tanh) of the MLPs and experts, as C functions built at first use (kernels/native.py).

Owns: `rms_norm(x, weight, eps, *, residual=None, pre_add=None)` (kernels/reference_ops.py::rms_norm_reference's
Norm_w / Norm_0 of x, or of round(x + pre_add); plus round(residual + round(y)) when `residual` is given),
`gelu_mul(gate, up)` (F.gelu(gate, approximate="tanh") * up; gate and up may be the two halves of one [..., 2I]
tensor: rows of a stride of their own, as kernels/dispatch.py::gelu_mul_fused passes them), and their C source.
Norm rows run on torch's thread count only from `PARALLEL_ELEMENTS` on (below it one thread, no OpenMP region);
the GELU splits as torch's does.
Numbers: torch's bits, not just its formula (tests/kernels/test_norm_native.py checks them equal). The norm keeps
every rounding of the torch ops: x (+ pre_add, rounded to x.dtype) read as fp32; the sum of squares in the order of
ATen's cascade_sum (8-float vectors, 4 interleaved accumulators, a 4-level cascade; `sum_sq`); mean = sum / d;
r = 1 / sqrt(mean + eps) (torch's rsqrt); y = x·r, then y·w with w read as fp32 (any weight dtype, as the
reference's weight.float()); one rounding to x.dtype (bf16: nearest even); then residual + y rounded to x.dtype.
The GELU is ATen's AVX512 kernel op for op: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in fp32 with its FMA, tanh
by torch's own Sleef_tanhf16_u10 on the elements its loops take as whole vectors and glibc's tanhf on the rest
(the same runs: its thread split, row ends), rounded to the activation dtype, then times up, rounded again.
No -ffast-math (its startup code would flush denormals to zero process-wide), no FMA contraction.
Except fp32 GELUs (FAST_TANH_DTYPES): their tanh is glibc's vector tanhf (libmvec, <= 1.3 ulp from tanh against
Sleef's 0.5; 0.47 against 1.65 ns an element here), so fp32 GELU values differ from torch's by a few ulp of tanh
times 0.5·|gate·up| (relatively more where 1 + tanh cancels, at large negative gates; the fp32 parity tests bound
the effect). bf16 keeps torch's bits (the fast tanh there was 2.5x faster but moved 1 value in 10^4 by a bf16 ulp
or two: not worth losing the bf16 paths' equality with the reference). DGEMMA_NATIVE=0 (or DGEMMA_NORM_NATIVE=0)
runs the torch ops themselves.
Must not: pick devices or implementations (kernels/dispatch.py does), run under autograd or inside a compiled
graph, or be needed: None means "use the torch ops" (no compiler, CUDA tensors, other dtypes, a last dimension
that is not contiguous, leading dimensions that do not fold into one row stride, gradients wanted, a one-row norm
torch would split over threads, a GELU where torch runs no AVX512 kernels, below GELU_MIN_ELEMENTS or in bf16).
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
"""

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURE = {"rms_norm": [_P, _L, _P, _L, _P, _L, _P, _L, _L, _L, _I, _P, _I, _F, _I],
              "gelu_mul": [_P, _P, _L, _P, _L, _L, _I, _L, _P, _I]}
_FLAGS = ("-fno-math-errno", "-fopenmp-simd", "-ffp-contract=off")  # no FMA: y is rounded before the residual add
_lib: list = []  # [the loaded library, or None]: filled at first use
_ON = native.switch("DGEMMA_NORM_NATIVE")  # on unless DGEMMA_NATIVE or it is "0", read at each call
_GELU_SERIAL = 16384  # ATen's GELU_MIN_ELEMENTS_FOR_MULTI_THREADING: up to it one run of the flat index
# Below this many elements torch's gelu and mul are as fast (Sleef's tanh takes the time): gelu_mul says None.
GELU_MIN_ELEMENTS = _GELU_SERIAL + 1
GELU_DTYPES = (torch.float32,)  # bf16 runs bit for bit too, but no faster than torch's (both Sleef-bound)
# GELUs of these dtypes take glibc's vector tanh instead, at every size (other bits, ~1 ulp of tanh)
FAST_TANH_DTYPES = (torch.float32,)
_REDUCE_SERIAL = 32768  # ATen's GRAIN_SIZE: a one-row sum shorter than it runs on one thread
_DTYPES = (torch.float32, torch.bfloat16)
_WKIND = {torch.float32: 1, torch.bfloat16: 2}  # the C function's weight kinds (0: none)
# Elements (rows x width) from which a call splits its rows over torch's threads: below it the OpenMP region's
# start and the second core's cold caches cost more than the split saves (measured on the 2-core EPYC: issue 28).
PARALLEL_ELEMENTS = 1 << 15


def _native():
    return native.load_once(_lib, "norm_native", _SOURCE, _SIGNATURE, flags=_FLAGS, direct=True) if _ON() else None


def _usable(x: torch.Tensor):
    """(library, x.shape, x.dtype) where x is a non-empty CPU fp32/bf16 tensor outside autograd and compiled graphs,
    else None. Few tensor reads: each is a torch call to a TorchFunctionMode (benchmarks/engine_passes.py)."""
    if torch.compiler.is_compiling():
        return None
    dtype, shape = x.dtype, x.shape
    if dtype not in _DTYPES or not shape or not shape[-1] or not x.is_cpu \
            or (torch.is_grad_enabled() and x.requires_grad):
        return None
    lib = _native()
    return None if lib is None else (lib, shape, dtype)


def _ld(t: torch.Tensor, shape: torch.Size, dtype: torch.dtype, same: bool = False) -> int | None:
    """The row stride of t as [rows, d] (rows: the leading dimensions folded), or None: another shape, dtype or
    device, a strided last dimension, leading dimensions that do not fold into one stride, a gradient to keep.
    `same`: t is the tensor _usable checked."""
    if not same and (t.dtype != dtype or t.shape != shape or not t.is_cpu
                     or (torch.is_grad_enabled() and t.requires_grad)):
        return None
    d = shape[-1]
    if t.is_contiguous():
        return d
    if t.stride(-1) != 1:
        return None
    if len(shape) == 2:  # rows already (an expert GEMM's half): no view to make
        return t.stride(0) if shape[0] > 1 else d
    try:
        r = t.view(-1, d)
    except RuntimeError:
        return None
    return r.stride(0) if r.shape[0] > 1 else d


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, residual: torch.Tensor | None = None,
             pre_add: torch.Tensor | None = None) -> torch.Tensor | None:
    """[residual +] Norm_w(x [+ pre_add]) in x's shape and dtype (a new contiguous tensor), with the torch
    composition's bits (module docstring); None where the C kernel does not apply."""
    got = _usable(x)
    if got is None:
        return None
    lib, shape, dtype = got
    d = shape[-1]
    wkind = 0
    if weight is not None:
        wkind = _WKIND.get(weight.dtype, 0)
        if not wkind or weight.shape != (d,) or not weight.is_contiguous() or not weight.is_cpu \
                or (torch.is_grad_enabled() and weight.requires_grad):
            return None
    dense = x.is_contiguous()
    ldx = d if dense else _ld(x, shape, dtype, same=True)
    ldp = 0 if pre_add is None else _ld(pre_add, shape, dtype)
    ldr = 0 if residual is None else _ld(residual, shape, dtype)
    if ldx is None or ldp is None or ldr is None:
        return None
    n = x.numel() // d
    if n == 1 and d >= _REDUCE_SERIAL and torch.get_num_threads() > 1:
        return None  # torch sums one long row on several threads, in another order
    # empty_like where that is contiguous: torch.empty given a torch.Size takes 2.5 µs, empty_like 1 (~50 a step)
    out = torch.empty_like(x) if dense else torch.empty(*shape, dtype=dtype)
    lib.rms_norm(x.data_ptr(), ldx, None if pre_add is None else pre_add.data_ptr(), ldp,
                 None if residual is None else residual.data_ptr(), ldr, out.data_ptr(), d, n, d,
                 dtype == torch.bfloat16, None if weight is None else weight.data_ptr(), wkind, eps,
                 torch.get_num_threads() if n * d >= PARALLEL_ELEMENTS else 1)
    return out


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """F.gelu(gate, approximate="tanh") * up (same shapes, dtype and row stride) as a new contiguous tensor: bit
    for bit, or (FAST_TANH_DTYPES) with glibc's vector tanh; None where neither applies (module docstring)."""
    got = _usable(gate)
    if got is None:
        return None
    lib, shape, dtype = got
    d = shape[-1]
    total = gate.numel()
    fast = native.vector_tanh("libmvec") if dtype in FAST_TANH_DTYPES else None
    if not fast and (total < GELU_MIN_ELEMENTS or dtype not in GELU_DTYPES):
        return None
    tanh = fast or native.vector_tanh("sleef")
    ld = _ld(gate, shape, dtype, same=True)
    if ld is None or _ld(up, shape, dtype) != ld or tanh is None:
        return None
    n = total // d
    # exact: torch's split of the flat index (GeluKernelImpl's grain, TensorIterator.for_each, at::parallel_for),
    # which decides which elements its loops reach as whole vectors; the same pieces run on as many threads here.
    # fast: every size, one row a piece, so a row's bits do not depend on its batch or the thread count
    t = torch.get_num_threads() if total > _GELU_SERIAL else 1
    out = torch.empty(*shape, dtype=dtype)  # unpacked: a torch.Size costs torch.empty 1.5 µs more to parse
    if lib.gelu_mul(gate.data_ptr(), up.data_ptr(), d if n == 1 else ld, out.data_ptr(), n, d,
                    dtype == torch.bfloat16, d if fast else -(-total // t), tanh, t) != 0:
        return None
    return out
