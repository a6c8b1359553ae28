"""Linear layers on CPU with their bf16 weights prepacked for oneDNN once, instead of on every call.

Owns: `packing_available`, `pack(w)` (a bf16 weight [N, K] in oneDNN's blocked layout, or None where that
would not give `F.linear`'s bits here) and `linear(x, packed)`.
Must not: know about modules or models (dgcli/model/packed.py swaps them), run on CUDA, or handle fp32
(torch's fp32 GEMM on CPU is MKL's, a different kernel and different bits).

Why: torch's bf16 `F.linear` on CPU is oneDNN's matmul with the weight in its stored [N, K] layout, and
oneDNN re-lays that weight out into its blocked layout on every call: a pass over the weight per GEMM,
paid again per expert and per layer. Packed once at load, a GEMM only reads the blocks. Measured on a
2-core avx512_bf16 CPU, 2 threads, [M, 1024]x[1024, 1024] over 24 weights not in cache (the decoder's
case): M = 16 156 -> 246 GFLOP/s, M = 85 307 -> 381, M = 256 375 -> 418 (benchmarks/RESULTS.md).
Bits: the packed product is oneDNN's inner-product primitive on the same bf16 inputs with fp32
accumulation. It equalled `F.linear` bit for bit for every shape tried (M 1-1024, K 512-2816, 1 and 2
threads); the order of a kernel's sums is the machine's and oneDNN's business, so `pack` checks each
weight shape here, on probe rows of a few heights, and leaves a weight as stored where they differ.
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


@functools.cache
def _agrees(n: int, k: int, threads: int) -> bool:
    """Does the packed product give F.linear's bits for an [n, k] weight at this thread count? (random
    values; each probe height once)"""
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.empty(n, k, dtype=torch.bfloat16).uniform_(-(3 / k) ** 0.5, (3 / k) ** 0.5, generator=g)
    p = _reorder(w)
    for m in PROBE_ROWS:
        x = torch.empty(m, k, dtype=torch.bfloat16).uniform_(-2, 2, generator=g)
        if not torch.equal(F.linear(x, w), linear(x, p)):
            return False
    return True


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] bf16 on CPU -> its oneDNN-packed copy (an opaque mkldnn tensor), or None: packing not
    available, another dtype or device, or the packed product differs from F.linear's here."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 or not packing_available():
        return None
    if not _agrees(w.shape[0], w.shape[1], torch.get_num_threads()):
        return None
    return _reorder(w)
