"""Linear layers on CPU with their bf16 weights prepacked for oneDNN once, instead of on every call.

Owns: `packing_available`, `pack(w)` and `linear(x, packed)`. Must not: know about modules (dgcli/model/packed.py
swaps them), run on CUDA, or handle fp32 (torch's fp32 CPU GEMM is MKL's: other bits).
Why: torch's bf16 `F.linear` on CPU re-lays the weight out into oneDNN's blocked layout on every call; packed once,
a GEMM only reads the blocks (2-core avx512_bf16, [M, 1024]x[1024, 1024] cold: M = 16 156 -> 246 GFLOP/s, M = 256
375 -> 418; benchmarks/RESULTS.md). Bits: oneDNN's inner product on the same inputs equalled `F.linear` for every
shape tried, but the order of its sums is oneDNN's business, so `pack` checks each weight shape here on probe rows
and leaves a weight as stored where they differ.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Probe heights: a single row, a ragged expert group, a whole canvas (oneDNN picks kernels by M).
PROBE_ROWS = (1, 17, 256)


@functools.cache
def packing_available() -> bool:
    """oneDNN with bf16 support and the (private, inductor's) packed-linear ops in this torch build."""
    try:
        return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N]: `F.linear(x, w)` for the weight w that `pack` packed."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _reorder(w: torch.Tensor) -> torch.Tensor:
    # The layout hint (256 rows) barely matters: any M from 16 to 1024 ran within a few % of its best.
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 256)


def probes(n: int, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A random bf16 weight [n, k] and bf16 rows of each PROBE_ROWS height, seeded by the shape."""
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.empty(n, k, dtype=torch.bfloat16).uniform_(-(3 / k) ** 0.5, (3 / k) ** 0.5, generator=g)
    return w, [torch.empty(m, k, dtype=torch.bfloat16).uniform_(-2, 2, generator=g) for m in PROBE_ROWS]


@functools.cache
def _agrees(n: int, k: int, threads: int) -> bool:
    """Does the packed product give F.linear's bits for an [n, k] weight at this thread count?"""
    w, xs = probes(n, k)
    p = _reorder(w)
    return all(torch.equal(F.linear(x, w), linear(x, p)) for x in xs)


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] bf16 on CPU -> its oneDNN-packed copy (an opaque mkldnn tensor), or None: packing not
    available, another dtype or device, or the packed product differs from F.linear's here."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 or not packing_available():
        return None
    if not _agrees(w.shape[0], w.shape[1], torch.get_num_threads()):
        return None
    return _reorder(w)
