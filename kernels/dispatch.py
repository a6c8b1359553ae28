"""Which implementation runs each fused op: Triton kernels on CUDA, the fast torch paths on CPU, the torch
references when asked (`DGEMMA_KERNELS=reference`) or when nothing better applies.

Owns: `vocab_pass`, `experts`, `rms_norm` (same signatures as their references) and `implementation`,
which names the choice (benchmarks and traces record it). The environment is read at each call, so a
test or a benchmark can flip it. Must not: hold math of its own, or import Triton unless a CUDA tensor
asks for a kernel (so CPU-only installs without Triton work).
"""

from __future__ import annotations

import os

import torch

from . import reference, reference_ops

MODES = ("auto", "reference")


def mode() -> str:
    """DGEMMA_KERNELS: 'auto' (default: kernels on CUDA, fast paths on CPU) or 'reference'."""
    m = os.environ.get("DGEMMA_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"DGEMMA_KERNELS={m!r}: use one of {', '.join(MODES)}")
    return m


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def implementation(op: str, device: torch.device | str) -> str:
    """'triton', 'cpu' or 'reference': what `op` ('vocab_pass', 'experts', 'rms_norm') runs on `device`."""
    dev = torch.device(device)
    if mode() == "reference":
        return "reference"
    if dev.type == "cuda" and _triton_ok():
        return "triton"
    if dev.type == "cpu" and op in ("vocab_pass", "experts"):
        return "cpu"  # RMSNorm has no faster CPU form than the reference's few torch ops
    return "reference"


def vocab_pass(hidden: torch.Tensor, embed: torch.Tensor, compile_tiles: bool = False,
               **kwargs) -> reference.VocabPassOut:
    """`kernels.reference.vocab_pass` (same keywords), by the implementation for hidden's device.
    `compile_tiles` (CPU path only) runs the per-tile elementwise math through torch.compile."""
    impl = implementation("vocab_pass", hidden.device)
    if impl == "triton":
        from .vocab_pass import vocab_pass_triton

        return vocab_pass_triton(hidden, embed, **kwargs)
    if impl == "cpu":
        from .vocab_pass_cpu import vocab_pass_tiled

        return vocab_pass_tiled(hidden, embed, compile_tiles=compile_tiles, **kwargs)
    return reference.vocab_pass(hidden, embed, **kwargs)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts x [N, H] -> [N, H] (see `reference_ops.experts_reference`)."""
    impl = implementation("experts", x.device)
    if impl == "triton":
        from .moe import experts_triton

        return experts_triton(x, w, idx, gate_up_proj, down_proj)
    if impl == "cpu":
        from .moe_cpu import experts_segments

        return experts_segments(x, w, idx, gate_up_proj, down_proj)
    return reference_ops.experts_reference(x, w, idx, gate_up_proj, down_proj)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Norm_w / Norm_0 of x (see `reference_ops.rms_norm_reference`)."""
    if implementation("rms_norm", x.device) == "triton":
        from .rmsnorm import rms_norm as rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return reference_ops.rms_norm_reference(x, weight, eps)
