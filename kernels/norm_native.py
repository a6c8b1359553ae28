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
or two: not worth losing the bf16 paths' equality with the reference). DGEMMA_KERNELS=torch
runs the torch ops themselves.
Must not: pick devices or implementations (kernels/dispatch.py does), run under autograd or inside a compiled
graph, or be needed: None means "use the torch ops" (no compiler, CUDA tensors, other dtypes, a last dimension
that is not contiguous, leading dimensions that do not fold into one row stride, gradients wanted, a one-row norm
torch would split over threads, a GELU where torch runs no AVX512 kernels, below GELU_MIN_ELEMENTS or in bf16).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import native


_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURE = {"rms_norm": [_P, _L, _P, _L, _P, _L, _P, _L, _L, _L, _I, _P, _I, _F, _I],
              "gelu_mul": [_P, _P, _L, _P, _L, _L, _I, _L, _P, _I]}
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
    return native.library("norm_native", _SIGNATURE)


def available() -> bool:
    """The C library built and enabled here (not under DGEMMA_KERNELS=torch|reference, a compiler is here)."""
    return _native() is not None


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


def gelu_mul_any(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`gelu_mul` where it applies (not under DGEMMA_KERNELS=torch|reference), else the torch ops it stands for."""
    y = gelu_mul(gate, up)
    if y is not None:
        return y
    y = F.gelu(gate, approximate="tanh")
    return y * up if torch.is_grad_enabled() else y.mul_(up)  # in place where no graph is kept: one buffer fewer
