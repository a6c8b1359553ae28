"""The Triton kernels as torch custom ops (`torch.ops.dgemma.*`), each with a fake implementation: the doors through
which kernels/dispatch.py and model/attention.py reach the kernels. A real call runs the kernel's entry point
unchanged; a fake call (FakeTensorMode, torch.compile's tracing, CUDA-graph capture checks) gives the exact output
shapes, dtypes and devices without launching anything. No kernel writes its inputs (`mutates_args=()`), except
paged_attention's `out`. Must not: import Triton at module level (CPU-only installs import dispatch), hold math,
pick devices. Callers use `torch.ops.dgemma.NAME` (a test may swap an op there); `vocab_pass` and `paged_attention`
have wrappers that make their arguments the op's types.
"""

from __future__ import annotations

import torch

from .reference import VocabPassOut

FLOATS = (torch.float32, torch.bfloat16)


def _float_only(name: str, dtype: torch.dtype) -> None:
    """The kernels' own dtype check, shared by the fakes so a fake run rejects what a GPU run would."""
    if dtype not in FLOATS:
        raise TypeError(f"{name} supports float32 and bfloat16, got {dtype}")


@torch.library.custom_op("dgemma::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
              pre_add: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    from .fused import rms_norm

    return rms_norm(x, weight, eps, residual, pre_add, scale)


@_rms_norm.register_fake
def _(x, weight, eps, residual=None, pre_add=None, scale=None):
    _float_only("rms_norm", x.dtype)
    return x.new_empty(x.shape)  # [..., H] contiguous, x.dtype


@torch.library.custom_op("dgemma::experts", mutates_args=())
def _experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
             down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
             down_scale: torch.Tensor | None = None, dynamic: bool = False) -> torch.Tensor:
    from .moe import experts_triton

    return experts_triton(x, w, idx, gate_up_proj, down_proj, gate_up_scale=gate_up_scale,
                          down_scale=down_scale, dynamic=dynamic)


@_experts.register_fake
def _(x, w, idx, gate_up_proj, down_proj, gate_up_scale=None, down_scale=None, dynamic=False):
    _float_only("experts_triton", x.dtype)
    if dynamic and gate_up_scale is None:
        raise ValueError("dynamic FP8 activations need FP8 expert weights and their scales")
    return x.new_empty(x.shape)  # [N, H] in x.dtype


@torch.library.custom_op("dgemma::fp8_linear", mutates_args=())
def _fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from .fp8_linear import linear_w8a16

    return linear_w8a16(x, q, s)


@_fp8_linear.register_fake
def _(x, q, s):
    _float_only("linear_w8a16", x.dtype)
    _float_only("linear_w8a16 scales", s.dtype)
    return x.new_empty(*x.shape[:-1], q.shape[0])  # [..., N] in x.dtype


@torch.library.custom_op("dgemma::fp8_quantize", mutates_args=())
def _fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .fp8_linear import quantize_rows

    return quantize_rows(x)


@_fp8_quantize.register_fake
def _(x):
    _float_only("quantize_rows", x.dtype)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@torch.library.custom_op("dgemma::qkv_norm_rope", mutates_args=())
def _qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, heads: int, kv_heads: int, has_v: bool,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .fused import qkv_norm_rope

    return qkv_norm_rope(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, has_v, eps)


@_qkv_norm_rope.register_fake
def _(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, has_v, eps):
    _float_only("qkv_norm_rope", qkv.dtype)
    (b, t, _), d = qkv.shape, q_weight.shape[0]
    return qkv.new_empty(b, t, heads, d), qkv.new_empty(b, t, kv_heads, d), qkv.new_empty(b, t, kv_heads, d)


@torch.library.custom_op("dgemma::gelu_mul", mutates_args=())
def _gelu_mul(gu: torch.Tensor, inner: int) -> torch.Tensor:
    from .fused import gelu_mul_fused

    return gelu_mul_fused(gu, inner)


@_gelu_mul.register_fake
def _(gu, inner):
    _float_only("gelu_mul", gu.dtype)
    return gu.new_empty(*gu.shape[:-1], inner)


@torch.library.custom_op("dgemma::router_input", mutates_args=())
def _router_input(r: torch.Tensor, scale: torch.Tensor, root: float, eps: float) -> torch.Tensor:
    from .fused import router_input

    return router_input(r, scale, root, eps)


@_router_input.register_fake
def _(r, scale, root, eps):
    _float_only("router_input", r.dtype)
    return r.new_empty(r.shape)


@torch.library.custom_op("dgemma::route", mutates_args=())
def _route(logits: torch.Tensor, per_expert_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .fused import route

    return route(logits, per_expert_scale, k)


@_route.register_fake
def _(logits, per_expert_scale, k):
    _float_only("route", logits.dtype)
    n = logits.shape[0]
    return logits.new_empty(n, k, dtype=torch.float32), logits.new_empty(n, k, dtype=torch.int64)


@torch.library.custom_op("dgemma::nvfp4_linear", mutates_args=())
def _nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor,
                  divide: bool) -> torch.Tensor:
    from .nvfp4_triton import linear_w4a16

    return linear_w4a16(x, packed, scale, glob, divide)


@_nvfp4_linear.register_fake
def _(x, packed, scale, glob, divide):
    _float_only("linear_w4a16", x.dtype)
    return x.new_empty(*x.shape[:-1], packed.shape[0])  # [..., N] in x.dtype


@torch.library.custom_op("dgemma::vocab_pass", mutates_args=())
def _vocab_pass(hidden: torch.Tensor, embed: torch.Tensor, softcap: float | None, temperature: torch.Tensor,
                embed_scale: torch.Tensor, uniform: torch.Tensor, want_soft: bool, splits: int | None,
                block_m: int | None, block_n: int | None, block_k: int | None,
                row_chunk: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .vocab_pass import vocab_pass_triton

    out = vocab_pass_triton(hidden, embed, softcap=softcap, temperature=temperature, embed_scale=embed_scale,
                            uniform=uniform, want_soft=want_soft, splits=splits, block_m=block_m, block_n=block_n,
                            block_k=block_k, row_chunk=row_chunk)
    soft = out.soft if out.soft is not None else embed.new_empty(0)  # an op returns tensors, never None
    return out.sample, out.argmax, out.entropy, soft


@_vocab_pass.register_fake
def _(hidden, embed, softcap, temperature, embed_scale, uniform, want_soft, splits, block_m, block_n, block_k,
      row_chunk):
    _float_only("vocab_pass_triton", embed.dtype)
    b, c, h = hidden.shape
    ids = hidden.new_empty(b, c, dtype=torch.int64)
    soft = embed.new_empty(b, c, h) if want_soft else embed.new_empty(0)
    return ids, ids.new_empty(b, c), hidden.new_empty(b, c, dtype=torch.float32), soft


@torch.library.custom_op("dgemma::paged_attention", mutates_args=("out",))
def _paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, row_seq: torch.Tensor,
                     row_lo: torch.Tensor, row_hi: torch.Tensor, tables: torch.Tensor, block_size: int,
                     ring_blocks: int, tile_row0: torch.Tensor, tile_rows: torch.Tensor, k_new: torch.Tensor | None,
                     v_new: torch.Tensor | None, fresh_pos: torch.Tensor, fresh_row: torch.Tensor,
                     out: torch.Tensor) -> None:
    from .paged_attention import paged_attention

    paged_attention(q, k_pool, v_pool, row_seq, row_lo, row_hi, tables, block_size, ring_blocks,
                    tile_row0=tile_row0, tile_rows=tile_rows, k_new=k_new, v_new=v_new,
                    fresh_pos=None if k_new is None else fresh_pos, fresh_row=None if k_new is None else fresh_row,
                    out=out)


@_paged_attention.register_fake
def _(q, k_pool, v_pool, row_seq, row_lo, row_hi, tables, block_size, ring_blocks, tile_row0, tile_rows, k_new,
      v_new, fresh_pos, fresh_row, out):
    _float_only("paged_attention", q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"paged_attention writes out {tuple(out.shape)} {out.dtype} for q {tuple(q.shape)}")


def paged_attention(*args: torch.Tensor | int | None) -> None:
    """`paged_attention.paged_attention` with its row tiles given (no host read; the tiles' rows written into
    `out`) through its op: the op's arguments, in its order."""
    torch.ops.dgemma.paged_attention(*args)


def vocab_pass(hidden: torch.Tensor, embed: torch.Tensor, *, softcap: float | None,
               temperature: float | torch.Tensor, embed_scale: torch.Tensor | float, uniform: torch.Tensor,
               want_soft: bool = True, row_chunk: int | None = None, splits: int | None = None,
               block_m: int | None = None, block_n: int | None = None, block_k: int | None = None) -> VocabPassOut:
    """`vocab_pass.vocab_pass_triton` (same keywords) through its op. The temperature and the embedding
    scale become tensors here exactly as the kernel makes them (`row_temperature`, `torch.as_tensor`), so
    the numbers do not change; None sizes: the kernel's defaults (autotuned soft tiles on CUDA)."""
    dev = hidden.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=dev)
    embed_scale = torch.as_tensor(embed_scale, device=dev)
    sample, argmax, entropy, soft = torch.ops.dgemma.vocab_pass(
        hidden, embed, None if softcap is None else float(softcap), temperature, embed_scale, uniform,
        want_soft, splits, block_m, block_n, block_k, row_chunk)
    return VocabPassOut(sample=sample, argmax=argmax, entropy=entropy, soft=soft if want_soft else None)
