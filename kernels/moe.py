"""Routed experts as two grouped Triton GEMMs (CUDA): `experts_triton`, the twin of
`reference_ops.experts_reference` (its intermediate roundings to the storage dtype mirrored, a token's contributions
added in ascending expert order with one rounding each). FP8 experts run through the same kernels (twins of
`fp8.experts_fp8_reference`): weight-only, the e4m3 bytes decoded to bf16 and each channel's scale applied to the
accumulator (as `fp8_linear.linear_w8a16`: the reference's bf16 rounding of q·s is not made, so within its bound), or
with dynamic FP8 activations (each row quantized by one launch of `fp8_linear.quantize_rows`; e4m3 x e4m3 dots).
Must not: route, pick devices, or sync with the host (the launch grid is an upper bound on the row blocks; unused
blocks exit at once).

Layout: pair p = n·k + j after sorting each row's experts ascending, laid out by expert in "slots", each expert's run
padded to a multiple of BLOCK_M, so a block of slots belongs to one expert (`block_expert[b]`, -1 past the end).
Tiles on CUDA (bf16 activations, not dynamic, no tile asked for): BLOCK_M by the mean pairs per expert
(`block_rows`: each weight tile streamed about once), the rest autotuned over TUNE. BLOCK_K stays 64 everywhere:
it sets how each output's k chain is cut, so no tile choice (nor the batch) changes the bits (tests check it).
Every configuration compiles for sm_90 and sm_80 without spills (benchmarks/kernel_targets.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_linear import e4m3_over_256, quantize_rows
from .triton_common import gelu_mul_rounded, round_to

BLOCK = 64  # the fixed tile (BLOCK_M, BLOCK_N, BLOCK_K): the interpreter, fp32 experts, explicit tiles
# BLOCK_M -> the autotuned (BLOCK_N, num_warps, num_stages) on CUDA. 64 rows: memory-bound (a canvas of 256
# tokens x top-8 over 128 experts is ~16 pairs an expert), so narrow and deep tiles for more loads in flight;
# 128 rows (batch 8 and up): 8 warps for the two [128, BLOCK_N] fp32 accumulators. Left out: the tiles whose
# gate/up kernel spills on sm_80 (72-152 B: [64, 128] and [128, 64] on 4 warps, [128, 128] on 8).
TUNE = {64: ((64, 4, 3), (32, 4, 4), (64, 4, 4), (128, 8, 3)),
        128: ((64, 8, 3), (64, 8, 4), (32, 4, 3))}


@triton.jit
def _weights(w, W_FP8: tl.constexpr, DOT_BF16: tl.constexpr):
    """A weight tile [BK, BN] as the dot takes it: FP8 bytes as their values / 256 (exact in bf16; the channel scale
    x 256 multiplies the accumulator after the loop), in bf16 for the tensor cores or fp32 for full-precision dots."""
    if W_FP8:
        w = e4m3_over_256(w)
    return w.to(tl.bfloat16) if DOT_BF16 else w.to(tl.float32)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, pair_ptr, block_expert_ptr, act_ptr, xs_ptr, ws_ptr, H, I, TOPK,
                    stride_xn, stride_we, stride_wr, stride_an, stride_se,
                    IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, W_FP8: tl.constexpr, A_FP8: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + slots)
    valid = pair >= 0
    tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate channels
    col_ok = cols < I
    w_base = w_ptr + e.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + tok[:, None] * stride_xn + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        wmask = col_ok[None, :] & k_ok[:, None]
        wg = tl.load(w_base + cols[None, :] * stride_wr + ks[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (cols[None, :] + I) * stride_wr + ks[:, None], mask=wmask, other=0.0)
        if A_FP8:  # dynamic FP8: e4m3 x e4m3 products, fp32 accumulation; the scales come after the loop
            gate = tl.dot(a, wg, gate)
            up = tl.dot(a, wu, up)
        else:  # both tiles decoded before either dot (interleaved, ptxas spills ~7 KB a thread for fp32)
            wg = _weights(wg, W_FP8, DOT_BF16)
            wu = _weights(wu, W_FP8, DOT_BF16)
            if DOT_BF16:  # exact operands (bf16 activations and weights); full-rate tensor cores
                gate = tl.dot(a, wg, gate)
                up = tl.dot(a, wu, up)
            else:  # fp32 storage: full fp32 products, not TF32
                a = a.to(tl.float32)
                gate = tl.dot(a, wg, gate, input_precision="ieee")
                up = tl.dot(a, wu, up, input_precision="ieee")
    if W_FP8:  # this expert's gate and up channel scales, loaded after the loop (held across it, sm_80 spills)
        sg = tl.load(ws_ptr + e.to(tl.int64) * stride_se + cols, mask=col_ok, other=0.0).to(tl.float32)
        su = tl.load(ws_ptr + e.to(tl.int64) * stride_se + I + cols, mask=col_ok, other=0.0).to(tl.float32)
    if A_FP8:  # (acc x token scale) x channel scale, as vLLM's fused-MoE epilogue
        xs = tl.load(xs_ptr + tok, mask=valid, other=0.0)
        gate = gate * xs[:, None] * sg[None, :]
        up = up * xs[:, None] * su[None, :]
    elif W_FP8:  # weight-only: the tiles held q / 256
        gate = gate * (sg * 256.0)[None, :]
        up = up * (su * 256.0)[None, :]
    gate = round_to(gate, IS_BF16)  # the reference's GEMM output is in the storage dtype
    up = round_to(up, IS_BF16)
    act = gelu_mul_rounded(gate, up, IS_BF16)
    tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_an + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, pair_ptr, block_expert_ptr, rw_ptr, y_ptr, as_ptr, ws_ptr, H, I,
                 stride_an, stride_we, stride_wr, stride_yn, stride_se,
                 IS_BF16: tl.constexpr, DOT_BF16: tl.constexpr, W_FP8: tl.constexpr, A_FP8: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + slots)
    valid = pair >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden channels
    col_ok = cols < H
    w_base = w_ptr + e.to(tl.int64) * stride_we
    sd = tl.full((BLOCK_N,), 1.0, tl.float32)  # FP8 weights: this expert's output channel scales
    if W_FP8:
        sd = tl.load(ws_ptr + e.to(tl.int64) * stride_se + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(act_ptr + slots[:, None].to(tl.int64) * stride_an + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        wd = tl.load(w_base + cols[None, :] * stride_wr + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                     other=0.0)  # [BK, BN]
        if A_FP8:
            acc = tl.dot(a, wd, acc)
        elif DOT_BF16:
            acc = tl.dot(a, _weights(wd, W_FP8, DOT_BF16), acc)
        else:
            acc = tl.dot(a.to(tl.float32), _weights(wd, W_FP8, DOT_BF16), acc, input_precision="ieee")
    if A_FP8:
        a_s = tl.load(as_ptr + slots, mask=valid, other=0.0)  # the intermediate's per-row scale
        acc = acc * a_s[:, None] * sd[None, :]
    elif W_FP8:
        acc = acc * (sd * 256.0)[None, :]
    rw = tl.load(rw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)  # fp32 routing weight
    y = round_to(round_to(acc, IS_BF16) * rw[:, None], IS_BF16)
    safe = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(y_ptr + safe[:, None] * stride_yn + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _align_kernel(flat_ptr, pair_ptr, block_expert_ptr, NK, E, n_slots, n_blocks, BM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """`group_by_expert` in one program: per-expert counts, padded starts, each pair's slot (its expert's start +
    the pairs of that expert before it: the stable sort's order) and each block's expert."""
    es = tl.arange(0, BLOCK_E)
    ps = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, NK, BLOCK_P):
        ids = tl.load(flat_ptr + p0 + ps, mask=p0 + ps < NK, other=-1)
        counts += tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, axis=0)  # [E]
    start = pad_end - padded
    for s0 in range(0, n_slots, BLOCK_P):  # every slot padding first
        tl.store(pair_ptr + s0 + ps, tl.full((BLOCK_P,), -1, tl.int32), mask=s0 + ps < n_slots)
    tl.debug_barrier()
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, NK, BLOCK_P):
        ok = p0 + ps < NK
        hit = ((tl.load(flat_ptr + p0 + ps, mask=ok, other=-1)[:, None] == es[None, :])).to(tl.int32)  # [P, E]
        before = seen[None, :] + tl.cumsum(hit, axis=0) - hit
        dest = tl.sum((start[None, :] + before) * hit, axis=1)
        tl.store(pair_ptr + dest, (p0 + ps).to(tl.int32), mask=ok)
        seen += tl.sum(hit, axis=0)
    ends = tl.where(es < E, pad_end, 1 << 30)
    for b0 in range(0, n_blocks, BLOCK_P):
        blk = b0 + ps
        e = tl.sum((ends[None, :] <= (blk * BM)[:, None]).to(tl.int32), axis=1)  # first expert ending later
        tl.store(block_expert_ptr + blk, tl.where(e < E, e, -1), mask=blk < n_blocks)


def group_by_expert(flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids [N·k] -> (pair_of_slot [S] int32, -1 = padding; block_expert [S/BLOCK_M] int32, -1 = unused),
    in one launch, no host read. S = an upper bound on the padded total, so no count is read back."""
    n_blocks = triton.cdiv(flat.numel() + num_experts * (block_m - 1), block_m)
    pair_of_slot = flat.new_empty(n_blocks * block_m, dtype=torch.int32)
    block_expert = flat.new_empty(n_blocks, dtype=torch.int32)
    _align_kernel[(1,)](flat.contiguous(), pair_of_slot, block_expert, flat.numel(), num_experts,
                        pair_of_slot.numel(), n_blocks, BM=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                        BLOCK_P=64)
    return pair_of_slot, block_expert


def block_rows(pairs: int, num_experts: int) -> int:
    """BLOCK_M of the tuned path: 128 once the mean pairs per expert pass 64 (batch 8 of 256-token canvases at
    the released config: 128 an expert), else 64 (the smallest wgmma tile of a warp group)."""
    return 128 if pairs > BLOCK * num_experts else BLOCK


def _tuning(x: torch.Tensor, dynamic: bool, explicit: bool) -> bool:
    """The tuned path: bf16 activations on CUDA (compiled kernels), no tile asked for, no dynamic FP8."""
    return x.dtype == torch.bfloat16 and x.is_cuda and not dynamic and not explicit


def _tuned(kernel, block_m: int):
    """`kernel` autotuned over TUNE[block_m], keyed by (H, I, BLOCK_M): BLOCK_M stands for the batch, so a model
    tunes twice per kernel, at an engine's warm-up (outside CUDA-graph capture); Triton's on-disk cache keeps the
    picks for later processes on that GPU."""
    key = (kernel.__name__, block_m)
    if key not in _TUNED:
        configs = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st) for bn, w, st in TUNE[block_m]]
        _TUNED[key] = triton.autotune(configs, key=["H", "I", "BLOCK_M"], do_bench=_BENCH, cache_results=True)(kernel)
    return _TUNED[key]


def _device_bench(call, quantiles):
    """The autotuner's timer: Triton's, 5 ms of warm-up and 25 ms of repeats (its default is ~4x longer)."""
    import triton.testing

    return triton.testing.do_bench(call, warmup=5, rep=25, quantiles=quantiles)


_TUNED: dict = {}  # (kernel name, BLOCK_M) -> the autotuned kernel
_BENCH = _device_bench  # the autotuner's timer (a test runs the tuned path in the interpreter with a host one)


def launch_options(fp8: bool, dynamic: bool, is_bf16: bool) -> dict:
    """Triton launch options beyond the defaults for both kernels. fp32 dots on dequantized FP8 tiles: the
    default 3-stage pipelining spills ~5 KB per thread on sm_90 (benchmarks/kernel_targets.py); one stage
    spills nothing. Same math, only the load schedule."""
    return dict(num_stages=1) if fp8 and not dynamic and not is_bf16 else {}


def experts_triton(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up_proj: torch.Tensor,
                   down_proj: torch.Tensor, *, gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None, dynamic: bool = False,
                   block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [N, H], w [N, k] fp32, idx [N, k] (distinct per row), gate_up_proj [E, 2I, H], down_proj [E, H, I]
    -> [N, H] in x.dtype. Block sizes must be >= 16 (tl.dot). None given, or only a block_m of TUNE: the tuned
    path on CUDA; else BLOCK where none is given, and the given warps / stages. FP8 experts: float8_e4m3fn weights
    with gate_up_scale [E, 2I, 1] and down_scale [E, H, 1] (bf16 or fp32), weight-only or `dynamic`."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"experts_triton supports float32 and bfloat16, got {x.dtype}")
    fp8 = gate_up_scale is not None
    if dynamic and not fp8:
        raise ValueError("dynamic FP8 activations need FP8 expert weights and their scales")
    n, k = idx.shape
    num_experts, h = gate_up_proj.shape[0], x.shape[1]
    inter = down_proj.shape[2]
    x = x.contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    if fp8 and not dynamic:  # weight-only: the e4m3 bytes, decoded in the kernel
        gate_up_proj, down_proj = gate_up_proj.view(torch.uint8), down_proj.view(torch.uint8)
    idx_sorted, perm = idx.sort(dim=1)  # ascending experts per row: the reference's addition order
    rw = w.gather(1, perm).to(torch.float32).reshape(-1).contiguous()  # [N·k]
    is_bf16 = x.dtype == torch.bfloat16
    explicit = any(v is not None for v in (block_n, block_k, num_warps, num_stages)) or block_m not in (None, *TUNE)
    tuned = _tuning(x, dynamic, explicit)
    bm = block_m or (block_rows(n * k, num_experts) if tuned else BLOCK)
    pair_of_slot, block_expert = group_by_expert(idx_sorted.reshape(-1), num_experts, bm)
    gus = gate_up_scale.reshape(num_experts, -1).contiguous() if fp8 else x  # [E, 2I] (else unused)
    dns = down_scale.reshape(num_experts, -1).contiguous() if fp8 else x  # [E, H]
    xin, xs = quantize_rows(x) if dynamic else (x, x)  # [N, H] e4m3 and [N, 1] fp32 scales
    flags = dict(IS_BF16=is_bf16, DOT_BF16=is_bf16, W_FP8=fp8, A_FP8=dynamic, BLOCK_M=bm,
                 BLOCK_K=block_k or BLOCK)
    if tuned:  # BLOCK_N, warps and stages from the autotuner
        gate_up, down = _tuned(_gate_up_kernel, bm), _tuned(_down_kernel, bm)
    else:
        gate_up, down = _gate_up_kernel, _down_kernel
        flags.update(BLOCK_N=block_n or BLOCK, **launch_options(fp8, dynamic, is_bf16))
        flags.update({name: v for name, v in dict(num_warps=num_warps, num_stages=num_stages).items() if v is not None})
    act = torch.empty(pair_of_slot.numel(), inter, dtype=x.dtype, device=x.device)  # [S, I]
    grid = lambda meta: (block_expert.numel(), triton.cdiv(inter, meta["BLOCK_N"]))  # noqa: E731
    gate_up[grid](xin, gate_up_proj, pair_of_slot, block_expert, act, xs, gus, h, inter, k,
                  xin.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0), gus.stride(0), **flags)
    # Dynamic: the intermediate quantized per row (padding slots too: rows are independent, never read)
    act, a_s = quantize_rows(act) if dynamic else (act, act)
    y = torch.empty(n * k, h, dtype=x.dtype, device=x.device)  # [N·k, H]
    grid = lambda meta: (block_expert.numel(), triton.cdiv(h, meta["BLOCK_N"]))  # noqa: E731
    down[grid](act, down_proj, pair_of_slot, block_expert, rw, y, a_s, dns, h, inter,
               act.stride(0), down_proj.stride(0), down_proj.stride(1), y.stride(0), dns.stride(0), **flags)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    _combine_kernel[(n, triton.cdiv(h, 1024))](y, out, h, TOPK=k, IS_BF16=is_bf16, BLOCK=1024)
    return out


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, TOPK: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """out[n] = y[n, 0] + y[n, 1] + ... (y [N, k, H] contiguous): one rounding per addition, ascending experts
    (the reference's index_add_ order), in one launch where torch makes k."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.load(y_ptr + row * TOPK * H + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        acc = round_to(acc + tl.load(y_ptr + (row * TOPK + j) * H + cols, mask=mask, other=0.0).to(tl.float32),
                       IS_BF16)
    tl.store(out_ptr + row * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
