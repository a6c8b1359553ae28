"""GGML-quantized weights computed on CPU, kept quantized in memory: no dequantized copy outlives a call.

Owns: `prepare` (a GGUF block tensor -> the form kept in memory, built once at load), `linear`, `experts`
(`experts_reference`'s semantics) and `dequantize_prepared`. Must not: know GGUF files or tensor names
(dgcli/checkpoint/), or route.

The forms. Q4_K, Q4_0 -> torch's int4 CPU layout (`torch._weight_int4pack_mm_for_cpu`: w = (q − 8)·scale + zero per
group of 32 along K): a Q4_K sub-block is one group, scale = d·sc, zero = 8·d·sc − dmin·m (exact in fp32, stored in
the activations' dtype: bf16 rounds them, <= 2^-9 each); rows padded to a multiple of 64. Q5_0, Q8_0, Q6_K -> kept
as their bytes ('raw': a GGUF file's own map, no copy; the C kernel decodes them per 64-row block).
The paths, for bf16 x: the int8 C kernel (kernels/ggml_q8.py, its own stated numerics) where the CPU has AVX-512
VNNI + VBMI, for int4 forms from Q8_ROWS rows (a GGUF step ~1.8x faster, benchmarks/RESULTS.md), for raw ones at
every row count; otherwise (DGEMMA_KERNELS=torch, no compiler) int4 forms take torch's int4 kernel below GEMM_ROWS
rows (3.5x fewer bytes than bf16, fp32 FMAs) and above it bf16 tiles of ~4 M weights unpacked by torch ops in
per-thread scratch, then x @ W.T (each weight the kernel's exact weight rounded once to bf16). fp32 x, and raw
forms without C, take tiles of the file's weights dequantized into x's dtype (the int4 kernel's fp32 path is ~70x
slower). Relative RMS error against the file's weights (Q4_K [1408, 2816], 256 rows): kernel 2.5e-3, GEMM
path 3.0e-3, a bf16 checkpoint 2.4e-3.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import ggml_q8
from .ggml_blocks import Q4_0, Q4_K, _blocks, _f16, dequantize, q4k_nibbles, q4k_scale_min, q40_values, row_bytes
from .moe_cpu import _sorted_pairs, _sum_slots

RAW = ggml_q8.BLOCK_TYPES  # Q5_0, Q8_0, Q6_K: used as stored
GROUP = 32  # the int4 kernel's group size: one Q4_K sub-block, one Q4_0 block
ROW_BLOCK = 64  # the int4 packed layout's row block
TILE_VALUES = 1 << 18  # values dequantized per tile on the tile path (1 MB in fp32)
GEMM_ROWS = 64  # from this many rows of bf16 x the torch paths take bf16 tiles, not torch's int4 kernel
# From this many rows of bf16 x the int8 path where the CPU has VNNI (below: torch's int4 kernel reads the nibbles
# once, 1.5x faster at 1-2 rows)
Q8_ROWS = 3
GEMM_TILE_VALUES = 1 << 22  # weight values per bf16 tile (8 MB + 4 MB int8 scratch): fewer, larger ops
_NIB = 0x0F0F0F0F0F0F0F0F  # low nibble of each byte of an int64 word
_scratch = threading.local()  # per thread: the GEMM path's reused (int8, bf16) tile buffers


class Prepared(NamedTuple):
    """A quantized matrix (or stack [E, ...] of them) in its compute form: `kind` 'int4' (`packed` uint8
    [..., Np, Kp/2] in torch's int4 layout, `sz` [..., Kp/32, Np, 2] scale and zero) or 'raw' (`packed` the
    GGUF bytes [..., n, row_bytes], sz None); n rows of k values each."""
    kind: str
    qtype: int
    n: int
    k: int
    packed: torch.Tensor
    sz: torch.Tensor | None

    def expert(self, e: int) -> "Prepared":  # matrix e of a stack [E, ...] (not _replace: ~3x its cost per call)
        return Prepared(self.kind, self.qtype, self.n, self.k, self.packed[e], None if self.sz is None else self.sz[e])

    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.sz is None else self.sz.nbytes)


def _pad_rows(n: int) -> int:
    return -(-n // ROW_BLOCK) * ROW_BLOCK


def _int4_parts(raw: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One matrix's bytes [n, row_bytes] -> (q uint8 [n, k] in 0..15, scale fp32 [n, k/32], zero fp32 [n, k/32])
    with w = (q − 8)·scale + zero."""
    n = raw.shape[0]
    b = _blocks(raw, qtype)  # [n, nb, bytes]
    if qtype == Q4_K:
        sc, mn = q4k_scale_min(b[..., 4:16])
        scale = _f16(b[..., 0:2]) * sc.float()  # [n, nb, 8], exact
        zero = 8 * scale - _f16(b[..., 2:4]) * mn.float()
        return q4k_nibbles(b[..., 16:]).reshape(n, k), scale.reshape(n, -1), zero.reshape(n, -1)
    d = _f16(b[..., 0:2])[..., 0]  # Q4_0, (q − 8)·d: scale d, zero 0 [n, nb]
    return q40_values(b[..., 2:]).reshape(n, k), d, torch.zeros_like(d)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [Np, K] (Np a multiple of 64) -> torch's CPU int4 layout, what
    `torch._convert_weight_to_int4pack_for_cpu(q.int(), 1)` returns (tests check it), without its int32 copy:
    per block of 64 rows, for each k, 32 bytes holding row j (low nibble) and row j + 32 (high nibble)."""
    np_, k = q.shape
    v = q.view(np_ // ROW_BLOCK, 2, ROW_BLOCK // 2, k)
    return (v[:, 0] | (v[:, 1] << 4)).transpose(1, 2).contiguous().view(np_, k // 2)


def prepare(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Prepared:
    """GGUF block bytes [..., n, row_bytes] -> the compute form (see the module docstring); scales and zeros in
    `dtype` (the activations' dtype: bf16 for the kernel, fp32 keeps them exact for the tile path)."""
    n = raw.shape[-2]
    if qtype in RAW:
        return Prepared("raw", qtype, n, k, raw.contiguous(), None)
    if qtype not in (Q4_0, Q4_K):
        raise ValueError(f"ggml type {qtype}: no CPU compute form (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K)")
    lead = raw.shape[:-2]
    np_ = _pad_rows(n)
    mats = raw.reshape(-1, *raw.shape[-2:])
    packed = torch.empty(len(mats), np_, k // 2, dtype=torch.uint8)
    sz = torch.empty(len(mats), k // GROUP, np_, 2, dtype=dtype)
    for i, m in enumerate(mats):  # one matrix at a time: the working copies stay small
        q, scale, zero = _int4_parts(m, qtype, k)
        if np_ != n:  # padding rows: q = 8, scale = zero = 0 -> weight 0
            q = torch.cat((q, q.new_full((np_ - n, q.shape[1]), 8)))
            scale = torch.cat((scale, scale.new_zeros(np_ - n, scale.shape[1])))
            zero = torch.cat((zero, zero.new_zeros(np_ - n, zero.shape[1])))
        packed[i] = _pack_int4(q)  # [Np, k/2]
        sz[i] = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # [k/32, Np, 2]
    packed, sz = packed.reshape(*lead, np_, k // 2), sz.reshape(*lead, k // GROUP, np_, 2)
    return Prepared("int4", qtype, n, k, packed, sz)


def prepared_bytes(qtype: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes `prepare` holds for one [n, k] matrix of qtype (memory preflight without building anything)."""
    if qtype in RAW:
        return n * row_bytes(qtype, k)
    return _pad_rows(n) * (k // 2 + k // GROUP * 2 * dtype.itemsize)


def prepared_shapes(qtype: int, n: int, k: int, lead: tuple = ()) -> tuple[tuple, tuple]:
    """The shapes of an int4 form's `packed` and `sz` for a stack `lead` of [n, k] matrices (as `prepare` makes)."""
    return (*lead, _pad_rows(n), k // 2), (*lead, k // GROUP, _pad_rows(n), 2)


def _dequant_rows(p: Prepared, r0: int, r1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows r0..r1 of one matrix [r1 - r0, k] in dtype (for int4 forms r0 a multiple of 64). bf16: the
    arithmetic runs in bf16 with one fp32-internal rounding per addcmul (the weights a bf16 GEMM would get)."""
    if p.kind == "raw":
        return dequantize(p.packed[r0:r1], p.qtype, p.k).to(dtype)
    kp = p.packed.shape[-1] * 2
    hi = min(_pad_rows(r1), p.packed.shape[0])
    v = p.packed.reshape(-1, kp, ROW_BLOCK // 2)[r0 // ROW_BLOCK:hi // ROW_BLOCK]  # [blocks, Kp, 32]
    q = torch.stack((v & 15, v >> 4), dim=1).transpose(2, 3).reshape(hi - r0, kp // GROUP, GROUP)  # [rows, g, 32]
    sz = p.sz[:, r0:hi].to(dtype)  # [Kp/32, rows, 2]
    w = torch.addcmul(sz[..., 1].t().unsqueeze(-1), q.to(dtype) - 8, sz[..., 0].t().unsqueeze(-1)).reshape(hi - r0, kp)
    return w[:r1 - r0]


def dequantize_prepared(p: Prepared) -> torch.Tensor:
    """The whole matrix (or stack) in fp32 [..., n, k]."""
    lead = p.packed.shape[:-2]
    if lead:
        return torch.stack([dequantize_prepared(p.expert(e)) for e in range(p.packed.shape[0])])
    return _dequant_rows(p, 0, p.n)


def _buf(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch buffer `name`: numel values of dtype (grown when too small, never shrunk)."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    b = bufs.get(name)
    if b is None or b.numel() < numel or b.dtype != dtype:
        with torch.inference_mode(False):  # a normal tensor, written in place by calls in inference mode or not
            b = bufs[name] = torch.empty(numel, dtype=dtype)
    return b[:numel]


def _int4_tile_t(p: Prepared, b0: int, b1: int, dtype: torch.dtype) -> torch.Tensor:
    """Row blocks b0..b1 of an int4 form as W.T [k, (b1 - b0)·64] in dtype, in this thread's reused buffer (valid
    until the next call): `_dequant_rows(...)` in fp32 rounded once to dtype."""
    kp, nb, k, tn = p.packed.shape[-1] * 2, b1 - b0, p.k, (b1 - b0) * ROW_BLOCK
    u8, wbuf = _buf("u8", nb * kp * ROW_BLOCK, torch.uint8), _buf("w", nb * kp * ROW_BLOCK, dtype)
    v = p.packed.reshape(-1, kp * ROW_BLOCK // 2)[b0:b1].view(torch.int64)  # [nb, Kp·4]: words of [Kp, 32] bytes
    u = u8[:nb * kp * ROW_BLOCK].view(nb, 2, kp, ROW_BLOCK // 2)  # [nb, low/high nibble (rows j / j + 32), Kp, 32]
    lo, hi = (u[:, h].reshape(nb, -1).view(torch.int64) for h in (0, 1))
    torch.bitwise_and(v, _NIB, out=lo)
    torch.bitwise_right_shift(v, 4, out=hi).bitwise_and_(_NIB)
    q = u.view(torch.int8).sub_(8)
    w = wbuf[:k * tn].view(k, nb, 2, ROW_BLOCK // 2)
    w.copy_(q.permute(2, 0, 1, 3))  # [k, nb, 2, 32] = W.T [k, tn], exact (|value| <= 128)
    w3 = w.view(k // GROUP, GROUP, tn)
    sz = p.sz[:, b0 * ROW_BLOCK:b1 * ROW_BLOCK]  # contiguous copies below: a strided operand costs ~7x here
    scale, zero = (sz[..., i].to(dtype).contiguous().unsqueeze(1) for i in (0, 1))
    torch.addcmul(zero, w3, scale, out=w3)
    return w.view(k, tn)


def _gemm_int4(x2: torch.Tensor, p: Prepared) -> torch.Tensor:
    """x2 [M, k] @ W.T through bf16 tiles of W (~GEMM_TILE_VALUES values each, unpacked by torch ops) -> [M, Np]."""
    blocks = p.packed.shape[-2] // ROW_BLOCK
    step = max(1, GEMM_TILE_VALUES // (p.k * ROW_BLOCK))
    ys = [x2 @ _int4_tile_t(p, b0, min(b0 + step, blocks), x2.dtype) for b0 in range(0, blocks, step)]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)


def _kernel_int4(x2: torch.Tensor, p: Prepared) -> torch.Tensor:
    """x2 [M, k] @ W.T through torch's int4 kernel -> [M, Np]."""
    return torch._weight_int4pack_mm_for_cpu(x2.contiguous(), p.packed, GROUP, p.sz)


def linear(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    """x [..., k] @ W.T -> [..., n] in x.dtype for one prepared matrix W [n, k] (~200 calls a decoder pass)."""
    x2 = x if x.dim() == 2 and x.shape[1] == p.k else x.reshape(-1, p.k)
    y = None
    if x.dtype == torch.bfloat16 and x.is_cpu:  # the thresholds were measured against oneDNN's bf16 GEMM
        if p.kind == "int4" and p.sz.dtype == torch.bfloat16:
            if x2.shape[0] >= Q8_ROWS and ggml_q8.available():  # int8 (its own numerics)
                y = ggml_q8.product(x2, p.packed, p.sz, p.k)
            if y is None:
                y = _gemm_int4(x2, p) if x2.shape[0] >= GEMM_ROWS else _kernel_int4(x2, p)
        elif p.kind == "raw" and ggml_q8.available():
            y = ggml_q8.blocks_product(x2, p.packed, p.qtype, p.k, p.n)
    elif p.kind == "int4" and x.dtype == torch.float16 and p.sz.dtype == x.dtype and x.is_cpu:
        y = _kernel_int4(x2, p)  # fp16 keeps torch's int4 kernel
    if y is None:  # tiles of rows dequantized one at a time into x's dtype (the whole matrix never is)
        step = max(ROW_BLOCK, TILE_VALUES // p.k // ROW_BLOCK * ROW_BLOCK)
        y = torch.cat([F.linear(x2, _dequant_rows(p, r0, min(r0 + step, p.n), x.dtype))
                       for r0 in range(0, p.n, step)], dim=1)
    y = y[:, :p.n]  # rows padded to a multiple of 64 are not the matrix's
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], p.n)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Prepared, down: Prepared,
            inter: int) -> torch.Tensor:
    """Routed experts x [N, H], w [N, k] fp32, idx [N, k] -> [N, H] in x.dtype, `experts_reference`'s math and bits:
    one GEMM pair per expert that got tokens (only those are read), the gather, GELU gate, weighting and sums over
    all routed rows at once (per expert they cost ~25 % of a layer's experts at 2 threads)."""
    k = idx.shape[1]
    flat, order, ws = _sorted_pairs(idx, w)  # pairs grouped by expert, their fp32 weights in that order
    counts = [(e, c) for e, c in enumerate(torch.bincount(flat, minlength=gate_up.packed.shape[0]).tolist()) if c]
    if not counts:  # no tokens
        return torch.zeros_like(x)
    xs, bounds = x.index_select(0, order // k), [0]  # [R, H]: each expert's rows together
    for _, c in counts:
        bounds.append(bounds[-1] + c)
    gu_e, dn_e = _experts_of(gate_up), _experts_of(down)
    gu = _cat([linear(xs[a:b], gu_e(e)) for (e, _), a, b in zip(counts, bounds, bounds[1:])])  # [R, 2I]
    act = F.gelu(gu[:, :inter], approximate="tanh").mul_(gu[:, inter:])  # [R, I]
    y = _cat([linear(act[a:b], dn_e(e)) for (e, _), a, b in zip(counts, bounds, bounds[1:])])  # [R, H]
    return _sum_slots(y.mul_(ws), order, k)  # the fp32 product rounded once; ascending experts, one rounding each


def _cat(ys: list[torch.Tensor]) -> torch.Tensor:
    return ys[0] if len(ys) == 1 else torch.cat(ys)


def _experts_of(p: Prepared):
    """e -> matrix e of the stack p, its views cut in one call each (`unbind`: ~3x cheaper than indexing per
    expert)."""
    packed, sz = p.packed.unbind(0), (None,) * len(p.packed) if p.sz is None else p.sz.unbind(0)
    return lambda e: Prepared(p.kind, p.qtype, p.n, p.k, packed[e], sz[e])

