"""The one table the model imports: which implementation runs each fused op on a device. Triton kernels on CUDA
(through their custom ops, kernels/ops.py, so eager, compiled and fake-tensor runs take the same door); on CPU
torch's own kernels, or our C kernels (kernels/native.py) where faster; the references when DGEMMA_KERNELS=reference
or when nothing better applies. Per op and device: one reference, at most one fast implementation.
Owns the ops' entry points (same signatures as their references), `implementation` and `provenance` (what ran, for
bench rows and traces). The switches are read at each call (kernels/switches.py), so a test or benchmark can flip
them. Must not: hold math of its own, or import Triton unless a CUDA tensor asks for a kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops, reference, reference_ops
from .switches import fp8_semantics, getenv, mode  # noqa: F401 (fp8_semantics: a public name)


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_CHOSEN: dict[tuple, str] = {}  # (op, device, DGEMMA_KERNELS as set) -> implementation


def implementation(op: str, device: torch.device | str) -> str:
    """'triton', 'cuda' (FP8 linears on CUDA without Triton: torch's CUDA ops), 'cpu' or 'reference': what `op`
    runs on `device`. 'linear' is decided when a session starts ('cpu': prepacked weights, dgcli/model/packed.py).
    Cached per op, device and DGEMMA_KERNELS value: this runs ~13 times per layer per step."""
    key = (op, device, getenv("DGEMMA_KERNELS"))
    got = _CHOSEN.get(key)
    if got is None:
        got = _CHOSEN[key] = _choose(op, torch.device(device))
    return got


def _choose(op: str, dev: torch.device) -> str:
    if mode() == "reference":
        return "reference"
    if op == "linear":  # no kernel of ours on CUDA: torch's GEMM (cuBLAS) as the reference runs it
        return "cpu" if dev.type == "cpu" else "reference"
    if dev.type == "cuda" and op == "fp8_linear" and not _triton_ok():
        return "cuda"
    if dev.type == "cuda" and _triton_ok():
        return "triton"
    if dev.type == "cpu" and op in ("vocab_pass", "experts", "fp8_experts", "fp8_linear", "rms_norm", "gelu_mul"):
        return "cpu"
    return "reference"


def vocab_pass(hidden: torch.Tensor, embed: torch.Tensor, compile_tiles: bool = False,
               **kwargs) -> reference.VocabPassOut:
    """`reference.vocab_pass`; `compile_tiles` (CPU only) runs the per-tile math through torch.compile."""
    impl = implementation("vocab_pass", hidden.device)
    if impl == "triton":
        return ops.vocab_pass(hidden, embed, **kwargs)
    if impl == "cpu":
        from .vocab_pass_cpu import vocab_pass_tiled

        return vocab_pass_tiled(hidden, embed, compile_tiles=compile_tiles, **kwargs)
    return reference.vocab_pass(hidden, embed, **kwargs)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor) -> torch.Tensor:
    """Routed experts x [N, H] -> [N, H] (see `reference_ops.experts_reference`)."""
    impl = implementation("experts", x.device)
    if impl == "triton":
        return torch.ops.dgemma.experts(x, w, idx, gate_up_proj, down_proj)
    if impl == "cpu":
        from .moe_cpu import experts_segments

        return experts_segments(x, w, idx, gate_up_proj, down_proj)
    return reference_ops.experts_reference(x, w, idx, gate_up_proj, down_proj)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Norm_w / Norm_0 of x (see `reference_ops.rms_norm_reference`)."""
    impl = implementation("rms_norm", x.device)
    if impl == "triton":
        return torch.ops.dgemma.rms_norm(x, weight, eps)
    if impl == "cpu" and (weight is None or weight.dtype == x.dtype):
        # torch's own op: the reference's fp32 formula bit for bit (tests/kernels/test_kernel_dispatch.py), one call
        # where the reference makes nine (45 norms a step)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return reference_ops.rms_norm_reference(x, weight, eps)


def rms_norm_add(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, residual: torch.Tensor | None = None,
                 pre_add: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """(residual + rms_norm(x + pre_add)) · scale (any may be None; scale: one value, the product in place), each
    op rounded to x.dtype as torch's ops round; one Triton launch on CUDA."""
    if implementation("rms_norm", x.device) == "triton" and (scale is None or scale.numel() == 1) and all(
            t is None or (t.shape, t.dtype) == (x.shape, x.dtype) for t in (residual, pre_add)):
        return torch.ops.dgemma.rms_norm(x, weight, eps, residual, pre_add, scale)
    y = rms_norm(x if pre_add is None else x + pre_add, weight, eps)
    y = y if residual is None else residual + y
    return y if scale is None else y.mul_(scale)


gelu_mul = reference_ops.gelu_mul  # F.gelu(gate, approximate="tanh") * up: torch's ops on every device


def gelu_mul_fused(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """gelu_mul of a [..., 2·inter] gate_up tensor's halves (gate first); one Triton launch on CUDA."""
    if _fusing(gu):
        return torch.ops.dgemma.gelu_mul(gu, inter)
    return reference_ops.gelu_mul(gu[..., :inter], gu[..., inter:])


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, heads: int, kv_heads: int, has_v: bool, eps: float):
    """q, k, v [B, T, n, d] of a fused projection (`reference_ops.qkv_norm_rope_reference`)."""
    if implementation("rms_norm", qkv.device) == "triton" and q_weight.dtype == k_weight.dtype == qkv.dtype:
        return torch.ops.dgemma.qkv_norm_rope(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, has_v, eps)
    return reference_ops.qkv_norm_rope_reference(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, has_v, eps)


def _fusing(x: torch.Tensor) -> bool:
    """The CUDA path's fused Triton kernels (kernels/fused.py) run: on CUDA with Triton, without autograd."""
    return implementation("rms_norm", x.device) == "triton" and not torch.is_grad_enabled()


def router_input(r: torch.Tensor, scale: torch.Tensor, root: float, eps: float) -> torch.Tensor:
    """The router's input Norm_0(r)·scale·root (`reference_ops.router_input_reference`); one launch on CUDA."""
    if _fusing(r) and scale.dtype == r.dtype and r.dim() == 2:
        return torch.ops.dgemma.router_input(r, scale, root, eps)
    return rms_norm(r, None, eps) * scale * root  # the reference's ops, the norm by this device's kernel


def route(logits: torch.Tensor, per_expert_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and expert ids of router logits (`reference_ops.route_reference`); one launch on CUDA."""
    if _fusing(logits) and logits.dim() == 2:
        return torch.ops.dgemma.route(logits, per_expert_scale, k)
    return reference_ops.route_reference(logits, per_expert_scale, k)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [..., K] by FP8 weights q [N, K], per-channel scales s [N, 1] -> [..., N] in x.dtype, with the DGEMMA_FP8
    semantics (kernels/fp8.py). The reference dequantizes the whole matrix at once."""
    from . import fp8

    impl = implementation("fp8_linear", x.device)
    if fp8_semantics() == "dynamic":  # torch._scaled_mm where it takes the shapes; the quantizer one launch
        fast = impl in ("triton", "cuda") and fp8.scaled_mm_fits(x, q)
        quantize = torch.ops.dgemma.fp8_quantize if fast and impl == "triton" else fp8.quantize_per_token
        return fp8.linear_dynamic(x, q, s, scaled_mm=fast, quantize=quantize)
    if impl == "triton" and x.dtype in ops.FLOATS and s.dtype in ops.FLOATS:
        return torch.ops.dgemma.fp8_linear(x, q, s)
    return fp8.linear_weight_only(x, q, s, tile_bytes=None if impl == "reference" else fp8.TILE_BYTES)


def fp8_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                gate_up_scale: torch.Tensor, down_proj: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """Routed FP8 experts x [N, H] -> [N, H] (gate_up_proj [E, 2I, H] and down_proj [E, H, I] float8_e4m3fn,
    scales [E, 2I, 1] and [E, H, 1]), with the DGEMMA_FP8 semantics (kernels/fp8.py)."""
    from . import fp8

    dynamic = fp8_semantics() == "dynamic"
    impl = implementation("fp8_experts", x.device)
    # Dynamic on SM 8.9+ only: Triton has no e4m3 type below (its e4m3 dots fail to compile for an A100), so older
    # GPUs run the reference; weight-only decodes the bytes with integer ops, built for sm_80 too (benchmarks/
    # kernel_targets.py checks both).
    if impl == "triton" and gate_up_scale.dtype in (torch.bfloat16, torch.float32) and (
            torch.cuda.get_device_capability(x.device) >= ((8, 9) if dynamic else (8, 0))):
        return torch.ops.dgemma.experts(x, w, idx, gate_up_proj, down_proj, gate_up_scale, down_scale, dynamic)
    if impl == "cpu" and not dynamic:
        return fp8.experts_fp8_segments(x, w, idx, gate_up_proj, gate_up_scale, down_proj, down_scale)
    return fp8.experts_fp8_reference(x, w, idx, gate_up_proj, gate_up_scale, down_proj, down_scale, dynamic=dynamic)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor,
                 divide: bool) -> torch.Tensor:
    """x [..., K] by NVFP4 weights (kernels/nvfp4.py's held form) -> [..., N] in x.dtype, weight-only (W4A16)."""
    from . import nvfp4

    if implementation("nvfp4_linear", x.device) == "triton" and x.dtype in ops.FLOATS:
        return torch.ops.dgemma.nvfp4_linear(x, packed, scale, glob, divide)
    return nvfp4.linear(x, packed, scale, glob, divide)


def nvfp4_experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: tuple, down: tuple,
                  divide: bool) -> torch.Tensor:
    """Routed NVFP4 experts x [N, H] -> [N, H] (gate_up, down: (packed, scale, global) stacks), weight-only."""
    from . import nvfp4

    return nvfp4.experts(x, w, idx, gate_up, down, divide, linear=nvfp4_linear)


def provenance(device: torch.device | str, dtype: str | None = None, packed: bool = False) -> dict[str, str]:
    """Per op, the implementation a session on `device` with weights of `dtype` runs (`packed`: dgcli/model/packed.py
    prepacked its linears and experts): 'triton', 'reference', torch's ('torch.linear', 'torch.grouped_mm', ...,
    'onednn-packed') or our C GEMM ('c-panels'). Two bench rows whose numbers differ can say why."""
    dev = torch.device(device)
    ops_ = {op: implementation(op, dev) for op in ("vocab_pass", "experts", "rms_norm", "gelu_mul")}
    if dev.type != "cpu":
        return {**ops_, "linear": "torch.linear"}
    fp32 = dtype in (None, "float32")  # only the C GEMM packs fp32 weights (dgcli/model/packed.py)
    linear = ("c-panels" if fp32 else "onednn-packed") if packed else "torch.linear"
    cpu = {"linear": linear, "experts": linear if packed else "torch.grouped_mm", "vocab_pass": "tiled, torch-ops",
           "rms_norm": "torch.rms_norm", "gelu_mul": "torch-ops"}
    return {**ops_, **{op: name for op, name in cpu.items() if op == "linear" or ops_[op] == "cpu"}}


def nvfp4_provenance(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """What NVFP4 linears and experts run on `device` for `dtype` activations (never FP4: W4A16, or W4A8 in the CPU's
    C, which takes bf16 activations only)."""
    if implementation("nvfp4_linear", torch.device(device)) == "triton":
        return "nvfp4: W4A16 triton (codes decoded in registers, bf16 tensor cores)"
    from . import nvfp4

    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and nvfp4.available():
        return "nvfp4: W4A8 c-vnni (e2m1 codes x activations rounded to int8 per 16, never FP4; kernels/csrc/nvfp4.c)"
    return "nvfp4: W4A16, e2m1 tiles decoded to bf16 by torch ops, torch.linear"
