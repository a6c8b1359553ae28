"""FP8 weights (float8_e4m3fn, one scale per output channel): the two ways dgemma runs them (DGEMMA_FP8), as torch
references and the CPU paths. Must not: route, pick devices (dispatch does), import the model.

* Weight-only (the default): each weight tile dequantized to the activation dtype inside the matmul, W =
  (q.to(s.dtype) * s).to(x.dtype) (compressed-tensors' `dequantize`), so a run equals the unquantized model holding
  those weights; only a tile of a matrix, or a chunk of experts, exists dequantized at a time.
* Dynamic activations (vLLM's FP8-dynamic): each FP8 matmul's input quantized per token to e4m3 with scale
  max(absmax / 448, 1 / (448 * 512)); FP8 products summed in fp32, times the token's then the channel's scale (vLLM's
  fused-MoE epilogue order), rounded to the activation dtype. The experts' intermediate is quantized again. Against
  weight-only, each activation is rounded to e4m3 (3 mantissa bits: within 2^-4 of itself, or 2^-10 x its token's
  scale below 2^-6 x scale) besides the weight: outputs move by up to ~2^-4 of sum |x·w| (a test holds the bound).
Shapes: q [N, K] and s [N, 1] for a linear; experts gate_up q [E, 2I, H] with s [E, 2I, 1], down q [E, H, I] with
s [E, H, 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .moe_cpu import _outside_compiled_graphs, _sorted_pairs, _sum_slots, segments_fit
from .reference_ops import routed

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor on a token's scale: an all-zero row stays finite
TILE_BYTES = 16 * 2**20  # one dequantized weight tile (or expert chunk) in the activation dtype


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., 1] fp32), all in fp32 as vLLM's kernel."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_over_256(q: torch.Tensor) -> torch.Tensor:
    """e4m3 values / 256 as float16, exactly: the e4m3 bits s.eeee.mmm placed at float16's s.0eeee.mmm0000000
    (float16's exponent bias is 8 more; e4m3 subnormals land on float16 subnormals). A few int16 passes:
    2.5-3.5x faster on CPU than torch's float8 conversion (measured 1.8 against 4.6 ns per weight, 1 thread)."""
    x = q.view(torch.uint8).to(torch.int16)
    x = (x & 0x7F).bitwise_left_shift_(7).bitwise_or_((x & 0x80).bitwise_left_shift_(8))
    return x.view(torch.float16)


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' dequantize: q x s rounded once in the scale's dtype, then cast to `dtype`. The
    product q·s is exact in fp32 (4 x 8 significant bits), so a bf16 or fp32 multiply rounds it once."""
    half = fp8_over_256(q)
    if s.dtype in (torch.bfloat16, torch.float32):
        w = half.to(s.dtype) * (s * 256)  # x 256 is exact: q·s, rounded once to s.dtype
    else:
        w = (half.float() * (s.float() * 256)).to(s.dtype)
    return w.to(dtype)


def _rows_per_tile(out_features: int, in_features: int, itemsize: int, tile_bytes: int) -> int:
    return max(1, min(out_features, tile_bytes // max(1, in_features * itemsize)))


def linear_weight_only(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                       tile_bytes: int | None = TILE_BYTES) -> torch.Tensor:
    """F.linear(x, dequantize(q, s)) with at most `tile_bytes` of dequantized rows at a time (None: whole)."""
    n, k = q.shape
    rows = n if tile_bytes is None else _rows_per_tile(n, k, x.element_size(), tile_bytes)
    if rows >= n:
        return F.linear(x, dequantize(q, s, x.dtype))
    out = x.new_empty(*x.shape[:-1], n)
    for r in range(0, n, rows):
        out[..., r:r + rows] = F.linear(x, dequantize(q[r:r + rows], s[r:r + rows], x.dtype))
    return out


def scaled_mm_fits(x: torch.Tensor, q: torch.Tensor) -> bool:
    """torch._scaled_mm's row-wise scaling on CUDA: SM 8.9+, bf16 output, K and N multiples of 16."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    n, k = q.shape
    return k % 16 == 0 and n % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 9)


def linear_dynamic(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, scaled_mm: bool = False,
                   tile_bytes: int = TILE_BYTES, quantize=quantize_per_token) -> torch.Tensor:
    """y = ((x_q @ q^T) * s_x) * s_w^T, fp32 accumulation, rounded to x.dtype. `scaled_mm`: torch._scaled_mm
    (CUDA); else the torch reference (fp32 GEMM on the upcast FP8 values, whose products are exact). `quantize`:
    the per-token quantizer (CUDA: the one-launch kernel, bit for bit this module's)."""
    shape = x.shape
    xq, xs = quantize(x.reshape(-1, shape[-1]))  # [M, K] fp8, [M, 1] fp32
    if scaled_mm:
        y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.float().reshape(1, -1), out_dtype=x.dtype)  # [1, N]
    else:
        n, k = q.shape
        rows = _rows_per_tile(n, k, 4, tile_bytes)
        y = x.new_empty(xq.shape[0], n)
        for r in range(0, n, rows):
            y[:, r:r + rows] = _scaled(xq, xs, q[r:r + rows], s[r:r + rows], x.dtype)
    return y.reshape(*shape[:-1], -1)


def _scaled(aq: torch.Tensor, a_s: torch.Tensor, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference FP8 GEMM of quantized rows aq [M, K] (scales a_s [M, 1]) with q [N, K], s [N, 1] (an expert's, or
    a row tile of a linear's): products of the e4m3 values (exact in fp32), fp32 sums, both scales, rounded."""
    return ((aq.float() @ (fp8_over_256(q).float() * 256).t()) * a_s * s.float().t()).to(dtype)


def experts_fp8_reference(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gu_q: torch.Tensor,
                          gu_s: torch.Tensor, dn_q: torch.Tensor, dn_s: torch.Tensor, *,
                          dynamic: bool = False) -> torch.Tensor:
    """`reference_ops.experts_reference` on FP8 experts, op for op: weight-only dequantizes one expert at a
    time; `dynamic` quantizes x per token once (as vLLM quantizes the MoE input) and each expert's
    intermediate per row."""
    xq, xs = quantize_per_token(x) if dynamic else (None, None)

    def mlp(e: int, tok: torch.Tensor) -> torch.Tensor:
        if dynamic:
            gate, up = _scaled(xq[tok], xs[tok], gu_q[e], gu_s[e], x.dtype).chunk(2, dim=-1)
            aq, a_s = quantize_per_token(F.gelu(gate, approximate="tanh") * up)
            return _scaled(aq, a_s, dn_q[e], dn_s[e], x.dtype)
        gate, up = F.linear(x[tok], dequantize(gu_q[e], gu_s[e], x.dtype)).chunk(2, dim=-1)
        return F.linear(F.gelu(gate, approximate="tanh") * up, dequantize(dn_q[e], dn_s[e], x.dtype))

    return routed(x, w, idx, gu_q.shape[0], mlp)


@_outside_compiled_graphs  # reads the per-expert counts back to the host to cut expert chunks
def experts_fp8_segments(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gu_q: torch.Tensor,
                         gu_s: torch.Tensor, dn_q: torch.Tensor, dn_s: torch.Tensor,
                         chunk_bytes: int | None = None) -> torch.Tensor:
    """Weight-only experts as `moe_cpu.experts_segments` runs them (pairs sorted into per-expert segments,
    `F.grouped_mm`), over chunks of consecutive experts whose dequantized weights fit `chunk_bytes`
    (default 4 x TILE_BYTES): the same per-segment GEMMs on the same dequantized values, one chunk of
    experts in x.dtype at a time."""
    chunk_bytes = 4 * TILE_BYTES if chunk_bytes is None else chunk_bytes
    k = idx.shape[1]
    num_experts, two_i, h = gu_q.shape
    inter = dn_q.shape[2]
    if not segments_fit(h, inter, x.dtype):
        return experts_fp8_reference(x, w, idx, gu_q, gu_s, dn_q, dn_s)
    flat, order, ws = _sorted_pairs(idx, w)  # [N*k], [N*k], [N*k, 1]
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).tolist()  # host: where each expert's rows end
    per = max(1, chunk_bytes // ((two_i * h + h * inter) * x.element_size()))
    xs = x[order // k]  # [N*k, H] rows in expert order
    ys = xs.new_empty(xs.shape[0], h)  # [N*k, H]
    for e0 in range(0, num_experts, per):
        e1 = min(num_experts, e0 + per)
        r0, r1 = (ends[e0 - 1] if e0 else 0), ends[e1 - 1]
        if r0 == r1:
            continue  # no token routed to these experts: nothing dequantized
        offs = torch.tensor(ends[e0:e1], dtype=torch.int32, device=x.device) - r0
        gu = F.grouped_mm(xs[r0:r1], dequantize(gu_q[e0:e1], gu_s[e0:e1], x.dtype).transpose(1, 2), offs=offs)
        act = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]  # [rows, I]
        ys[r0:r1] = F.grouped_mm(act, dequantize(dn_q[e0:e1], dn_s[e0:e1], x.dtype).transpose(1, 2), offs=offs)
    return _sum_slots(ys.mul_(ws), order, k)  # the fp32 product rounded once to x.dtype, in place
