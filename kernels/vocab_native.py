"""The vocabulary pass's per-tile elementwise work in one C function: two passes over a tile's rows, not ~12.

Owns: `tile_stats` (kernels/vocab_pass_cpu.py's `tile_stats` contract: softcap, temperature, the row max and its
first index, round(L) to bf16 for the soft embedding, exp(L - max) and its sums per row and per group of columns)
and its C source, built at first use (kernels/native.py). Rows run in parallel on torch's thread count; each
row's tile is read once into L (in place on an fp32 tile, else a per-thread fp32 row), then once more for the
exponentials, while it is still in cache.
Numbers: tanh and exp are glibc's vector versions (libmvec; declared here to vectorise without -ffast-math, whose
startup code would flush denormals to zero process-wide): a few ulp from torch's; the sums run in another order;
L is divided by the softcap and the temperature as torch does. The outputs equal the torch tile's within fp32
rounding (tests/kernels/test_vocab_native.py), so the bits of a step may change; the parity and agreement tests
bound them (fp32 <= 1e-4, bf16 <= 0.02 against the reference). DGEMMA_KERNELS=torch keeps the torch tile, whose bits are the reference's elementwise ops.
Must not: run GEMMs, keep state between tiles (the caller rescales to the running max), or be needed: None
means "use the torch tile" (no compiler, another dtype, CUDA tensors, strided rows).
"""

from __future__ import annotations

import ctypes

import torch

from . import native


_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURE = {"tile_stats": [_P, _I, _L, _L, _L, _F, _P, _L, _P, _L, _L, _P, _P, _P, _P, _P, _I]}


def _native():
    return native.library("vocab_native", _SIGNATURE)


def available() -> bool:
    """The C library built and enabled here (not under DGEMMA_KERNELS=torch|reference, a compiler is here)."""
    return _native() is not None


def tile_stats(raw: torch.Tensor, softcap: float | None, temperature: torch.Tensor,
               soft_dtype: torch.dtype | None, width: int, store: torch.Tensor | None = None) -> tuple | None:
    """vocab_pass_cpu.tile_stats's outputs from the C function, or None where it does not apply. An fp32 `raw`
    is overwritten (by L, then exp(L - max): the fp32 soft embedding's `keep`), as the torch tile does."""
    n, t = raw.shape
    fp32_soft = soft_dtype == torch.float32
    if not raw.is_cpu or raw.dtype not in (torch.bfloat16, torch.float32) or raw.stride(1) != 1 \
            or soft_dtype not in (None, torch.float32, torch.bfloat16) or (fp32_soft and raw.dtype != torch.float32) \
            or (store is not None and (store.dtype != torch.bfloat16 or store.stride(1) != 1)) \
            or temperature.dtype != torch.float32 or temperature.numel() not in (1, n):
        return None
    lib = _native()
    if lib is None:
        return None
    if soft_dtype == torch.bfloat16 and store is None:
        store = torch.empty(n, t, dtype=torch.bfloat16)
    temp = temperature.reshape(-1)
    groups = -(-t // width)
    tmax, zt, st = (torch.empty(n) for _ in range(3))
    targ = torch.empty(n, dtype=torch.long)
    gz = torch.empty(n, groups)
    lib.tile_stats(raw.data_ptr(), int(raw.dtype == torch.bfloat16), n, t, raw.stride(0), float(softcap or 0.0),
                   temp.data_ptr(), int(temp.numel() > 1), 0 if store is None else store.data_ptr(),
                   0 if store is None else store.stride(0), width, tmax.data_ptr(), targ.data_ptr(), zt.data_ptr(),
                   st.data_ptr(), gz.data_ptr(), torch.get_num_threads())
    keep = raw if fp32_soft else store
    return tmax, targ, zt, st, gz, keep
