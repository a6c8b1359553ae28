"""The kernel layer's two switches, read at each call (a test or a benchmark can flip them): DGEMMA_KERNELS and
DGEMMA_FP8. Must not: import anything of the kernel layer (every module of it may ask these).
"""

from __future__ import annotations

import os

MODES = ("auto", "torch", "reference")
FP8_SEMANTICS = ("weight-only", "dynamic")

_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None  # CPython: bytes name -> bytes value
_KEYS: dict[str, bytes] = {}


def getenv(name: str) -> str | None:
    """os.environ.get(name) as it is now, without os.environ's per-call encoding (~1 µs; asked ~13 times a layer)."""
    if _DATA is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.fsencode(name)
    v = _DATA.get(key)
    return None if v is None else os.fsdecode(v)


def mode() -> str:
    """DGEMMA_KERNELS: 'auto' (default: kernels on CUDA, fast paths on CPU, C where it is faster), 'torch' (the same
    without our C kernels: torch's own) or 'reference'."""
    m = (getenv("DGEMMA_KERNELS") or "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"DGEMMA_KERNELS={m!r}: use one of {', '.join(MODES)}")
    return m


def fp8_semantics() -> str:
    """DGEMMA_FP8: how FP8 weights run. 'weight-only' (default): dequantized per tile, activations stay in
    the model dtype; 'dynamic': activations quantized per token to e4m3 as vLLM runs FP8-dynamic checkpoints."""
    m = os.environ.get("DGEMMA_FP8", "weight-only").strip().lower() or "weight-only"
    if m not in FP8_SEMANTICS:
        raise ValueError(f"DGEMMA_FP8={m!r}: use one of {', '.join(FP8_SEMANTICS)}")
    return m
