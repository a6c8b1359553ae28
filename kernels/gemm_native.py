"""fp32 GEMMs with few rows on CPU in C (kernels/csrc/gemm_native.c), from weights packed once into column panels.

Owns: `pack` / `unpack` (an fp32 weight [N, K] <-> panels [ceil(N/16), K, 16], zero past column N), `linear` and
`grouped` (the routed experts' GEMMs in one call). Must not: run on CUDA, handle other dtypes, know about modules
(dgcli/model/packed.py swaps them in), or be needed: None means "use torch's GEMM" (no compiler, no AVX-512,
another dtype, DGEMMA_KERNELS=torch).
Why: MKL's fp32 GEMM reaches ~35-70 GFLOP/s at the bundled model's shapes (16-128 rows, K and N 160-1024) against
the core's ~96 (2-core EPYC); here a 16-column panel is one stream, up to 12 rows sit in registers, and a tiny
expert's GEMM pays no per-call setup.
Bits: each output is Σ_k x·w accumulated in k order by FMAs from 0, whatever the rows, threads or segment
(batch-invariant, not MKL's order); the parity tests bound the effect (fp32 <= 1e-4).
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native

PANEL = 16  # columns per packed panel: one AVX-512 vector of fp32


_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURE = {"gemm": [_P, _L, _L, _L, _P, _L, _P, _L, _I],
              "grouped": [_P, _P, _L, _L, _P, _L, _L, _P, _L, _P, _L, _I], "gemm_ok": []}


def _native():
    return native.library("gemm_native", _SIGNATURE)


def available() -> bool:
    """The C GEMM built and enabled here."""
    return _native() is not None


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (or a stack [E, N, K]) fp32 -> panels [ceil(N/16), K, 16] (or [E, ...]), zero past column N."""
    n, k = w.shape[-2:]
    pad = -n % PANEL
    if pad:
        w = torch.cat([w, w.new_zeros(*w.shape[:-2], pad, k)], dim=-2)
    return w.unflatten(-2, (-1, PANEL)).transpose(-2, -1).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """`pack`'s inverse: panels [.., P, K, 16] -> the weight [.., n, K] as stored (a contiguous copy)."""
    return panels.transpose(-2, -1).flatten(-3, -2)[..., :n, :].contiguous()


def _threads(m: int, n: int, k: int) -> int:
    return torch.get_num_threads() if m * n * k >= (1 << 22) else 1


def linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [..., K] fp32 @ W.T -> [..., n] for the W that `pack` packed, or None where the C GEMM does not apply."""
    lib = _native()
    shape, ps = x.shape, packed.shape
    k = shape[-1]
    if lib is None or x.dtype != torch.float32 or packed.dtype != torch.float32 or not x.is_cpu \
            or not packed.is_cpu or ps[-2] != k or ps[-3] * PANEL < n:
        return None
    if k > 1 and x.is_contiguous():  # the model's rows: no reshape (a tensor call costs ~0.5 µs, ~35 GEMMs a step)
        m, ldx = x.numel() // k, k
    elif x.stride(-1) != 1:
        return None
    else:
        x = x.reshape(-1, k)
        if x.shape[0] > 1 and x.stride(0) < k:
            x = x.contiguous()
        m = x.shape[0]
        ldx = x.stride(0) if m > 1 else k
    y = torch.empty(*shape[:-1], n, dtype=torch.float32)  # unpacked: a torch.Size is slower to parse
    if m:
        lib.gemm(x.data_ptr(), m, k, ldx, packed.data_ptr(), n, y.data_ptr(), n, _threads(m, n, k))
    return y


def grouped(x: torch.Tensor, rows: torch.Tensor | None, packed: torch.Tensor, ends: torch.Tensor,
            n: int) -> torch.Tensor | None:
    """Row segments of x (x[rows] when rows [R] int64 is given, else x's own rows in order) times the packed
    stack's matrices: segment e (rows ends[e-1] .. ends[e], ends [E] int64) by matrix e -> [R, n] fp32."""
    lib = _native()
    ps = packed.shape
    k = x.shape[1]
    if lib is None or x.dtype != torch.float32 or packed.dtype != torch.float32 or not x.is_cpu \
            or not packed.is_cpu or x.stride(-1) != 1 or ps[-2] != k or ps[-3] * PANEL < n \
            or ends.dtype != torch.int64 or not ends.is_contiguous() or ends.shape[0] != ps[0] \
            or (rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous())):
        return None
    r = x.shape[0] if rows is None else rows.shape[0]
    y = torch.empty(r, n, dtype=torch.float32)
    if r:
        lib.grouped(x.data_ptr(), None if rows is None else rows.data_ptr(), k, x.stride(0), packed.data_ptr(),
                    math.prod(ps[1:]), n, ends.data_ptr(), ps[0], y.data_ptr(), n, _threads(r, n, k))
    return y
