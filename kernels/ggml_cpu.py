"""GGML-quantized weights computed on CPU without dequantizing whole matrices per step.

Owns: `prepare` (a GGUF block tensor -> the form kept in memory, built once at load), `linear`, `experts`
(the `experts_reference` semantics over routed experts only) and `dequantize_prepared` (tests).
Must not: know GGUF files or tensor names (dgcli/model/gguf.py), or route (the model's router does).

The forms (all built at load; the file's bytes are not kept):
- Q4_K -> torch's int4 CPU kernel (`torch._weight_int4pack_mm_for_cpu`: w = (q − 8)·scale + zero per group of
  32 along K, fp32 accumulation). A Q4_K sub-block of 32 is one group: scale = d·sc, zero = 8·d·sc − dmin·m
  (exact in fp32, stored in the activation dtype: bf16 rounds them, relative error <= 2^-9 each). 0.625 bytes
  per value with bf16 scales (Q4_K: 0.5625; 1.11x).
- Q8_0 -> the same int4 kernel on two nibble planes: q + 128 = 16a + b, so d·q = (a − 8)·16d + 8d + (b − 8)·d:
  plane a (scale 16d, zero 8d) and plane b (scale d, zero 0) side by side along K, x fed twice. One kernel call;
  the only rounding is d to bf16 (16d, 8d are then exact). 1.25 bytes per value (Q8_0: 1.0625; 1.18x).
- Q6_K -> kept as its bytes; each call dequantizes row tiles of ~1 MB into a fresh buffer and runs F.linear on
  them (its 16-value sub-blocks do not map onto the kernel's groups of 32; it is the rare type in a Q4_K_M file).
Rows are padded to a multiple of 64 for the kernel (its packed layout is blocks of 64 rows: real shapes need no
padding). Activations in fp32 (or scales not in x's dtype) take the tile path: the kernel's fp32 path is scalar
code, ~70x slower than its bf16 one here. Q4_0 (scale d, zero 0) and Q5_0 (two planes, as Q8_0) use the kernel
too: llama.cpp writes Q5_0 for a Q4_K_M tensor whose rows are not a multiple of 256.

Numbers (this 2-core AVX-512-BF16 EPYC, 1 thread, [1408, 2816] weights; benchmarks/bench_ggml.py has the rest):
int4 kernel 0.27 / 1.53 / 24.7 ms at 1 / 16 / 256 rows, bf16 F.linear 0.41 / 0.91 / 9.5 ms. The kernel reads
3.5x fewer bytes but multiplies in fp32 FMAs, so it wins only while a GEMM is bound by its weight reads (a few
rows, e.g. an expert's share of a 16-row canvas) and loses 1.7-2.6x from ~16 rows on. Dequantizing bf16 tiles
in eager torch (9-21 ms per 4 M values) and running oneDNN's GEMM on them did not beat the kernel even at 256
rows; a torch.compile'd dequantization (4.7 ms per 4 M values, but ~36 s to compile per shape) would.
Error of the bf16 path: only scale and zero are rounded (to bf16), as issue 27 says, but one rounding is shared
by a group's 32 weights, so it does not average out as rounding each weight to bf16 does: output relative RMS
vs the exact weights 2.5e-3 (zero-mean inputs) and 4.0e-3 (mean-1 inputs) against 2.4e-3 / 2.7e-3 for bf16
F.linear of the same weights (Q4_K; Q4_0 / Q5_0 / Q8_0 have exact zeros and match bf16 F.linear).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

Q4_0, Q5_0, Q8_0, Q4_K, Q6_K = 2, 6, 8, 12, 14
PLANES = (Q5_0, Q8_0)  # 5- and 8-bit types: two nibble planes side by side along K
GROUP = 32  # the int4 kernel's group size: one Q4_K sub-block, one Q8_0 block
ROW_BLOCK = 64  # the int4 packed layout's row block
TILE_VALUES = 1 << 18  # values dequantized per tile on the tile path (1 MB in fp32)


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

    def expert(self, e: int) -> "Prepared":
        """Matrix e of a stack [E, ...]."""
        return self._replace(packed=self.packed[e], sz=None if self.sz is None else self.sz[e])

    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.sz is None else self.sz.nbytes)


def _pad_rows(n: int) -> int:
    return -(-n // ROW_BLOCK) * ROW_BLOCK


def _int4_parts(raw: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One matrix's bytes [n, row_bytes] -> (q uint8 [n, Kp] in 0..15, scale fp32 [n, Kp/32], zero fp32 [n, Kp/32])
    with w = (q − 8)·scale + zero (Q8_0: the two planes summed)."""
    from dgcli.model.ggml import _blocks, _f16, q40_values, q4k_nibbles, q4k_scale_min, q50_high

    n = raw.shape[0]
    b = _blocks(raw, qtype)  # [n, nb, bytes]
    if qtype == Q4_K:
        sc, mn = q4k_scale_min(b[..., 4:16])
        scale = _f16(b[..., 0:2]) * sc.float()  # [n, nb, 8], exact
        zero = 8 * scale - _f16(b[..., 2:4]) * mn.float()
        return q4k_nibbles(b[..., 16:]).reshape(n, k), scale.reshape(n, -1), zero.reshape(n, -1)
    d = _f16(b[..., 0:2])[..., 0]  # [n, nb]
    if qtype == Q4_0:  # (q − 8)·d: scale d, zero 0
        return q40_values(b[..., 2:]).reshape(n, k), d, torch.zeros_like(d)
    if qtype == Q5_0:  # q = 16a + b: d·(q − 16) = (a − 8)·16d + 128d + (b − 8)·d − 8d
        u = q40_values(b[..., 6:]) | (q50_high(b[..., 2:6]) << 4)  # [n, nb, 32] in 0..31
        zeros = (128 * d, -8 * d)
    else:  # Q8_0, q + 128 = 16a + b: d·q = (a − 8)·16d + 8d + (b − 8)·d
        u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # [n, nb, 32]
        zeros = (8 * d, torch.zeros_like(d))
    q = torch.cat(((u >> 4).reshape(n, k), (u & 15).reshape(n, k)), dim=1)  # [n, 2k]
    return q, torch.cat((16 * d, d), dim=1), torch.cat(zeros, dim=1)


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
    if qtype == Q6_K:
        return Prepared("raw", qtype, n, k, raw.contiguous(), None)
    if qtype not in (Q4_0, Q5_0, Q8_0, Q4_K):
        raise ValueError(f"ggml type {qtype}: no CPU compute form (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K)")
    lead = raw.shape[:-2]
    np_, kp = _pad_rows(n), k * (2 if qtype in PLANES else 1)
    mats = raw.reshape(-1, *raw.shape[-2:])
    packed = torch.empty(len(mats), np_, kp // 2, dtype=torch.uint8)
    sz = torch.empty(len(mats), kp // GROUP, np_, 2, dtype=dtype)
    for i, m in enumerate(mats):  # one matrix at a time: the working copies stay small
        q, scale, zero = _int4_parts(m, qtype, k)
        if np_ != n:  # padding rows: q = 8, scale = zero = 0 -> weight 0
            q = torch.cat((q, q.new_full((np_ - n, q.shape[1]), 8)))
            scale = torch.cat((scale, scale.new_zeros(np_ - n, scale.shape[1])))
            zero = torch.cat((zero, zero.new_zeros(np_ - n, zero.shape[1])))
        packed[i] = _pack_int4(q)  # [Np, Kp/2]
        sz[i] = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # [Kp/32, Np, 2]
    packed, sz = packed.reshape(*lead, np_, kp // 2), sz.reshape(*lead, kp // GROUP, np_, 2)
    return Prepared("int4", qtype, n, k, packed, sz)


def prepared_bytes(qtype: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes `prepare` holds for one [n, k] matrix of qtype (memory preflight without building anything)."""
    if qtype == Q6_K:
        return n * k // 256 * 210
    kp = k * (2 if qtype in PLANES else 1)
    return _pad_rows(n) * (kp // 2 + kp // GROUP * 2 * dtype.itemsize)


def _dequant_rows(p: Prepared, r0: int, r1: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows r0..r1 of one matrix [r1 - r0, k] in dtype (for int4 forms r0 a multiple of 64). bf16: the
    arithmetic runs in bf16 with one fp32-internal rounding per addcmul (the weights a bf16 GEMM would get)."""
    if p.kind == "raw":
        from dgcli.model.ggml import dequantize

        return dequantize(p.packed[r0:r1], p.qtype, p.k).to(dtype)
    kp = p.packed.shape[-1] * 2
    hi = min(_pad_rows(r1), p.packed.shape[0])
    v = p.packed.reshape(-1, kp, ROW_BLOCK // 2)[r0 // ROW_BLOCK:hi // ROW_BLOCK]  # [blocks, Kp, 32]
    q = torch.stack((v & 15, v >> 4), dim=1).transpose(2, 3).reshape(hi - r0, kp // GROUP, GROUP)  # [rows, g, 32]
    sz = p.sz[:, r0:hi].to(dtype)  # [Kp/32, rows, 2]
    w = torch.addcmul(sz[..., 1].t().unsqueeze(-1), q.to(dtype) - 8, sz[..., 0].t().unsqueeze(-1))
    w = w.reshape(hi - r0, kp)
    if p.qtype in PLANES:
        w = w[:, :p.k] + w[:, p.k:]
    return w[:r1 - r0]


def dequantize_prepared(p: Prepared) -> torch.Tensor:
    """The whole matrix (or stack) in fp32 [..., n, k]."""
    lead = p.packed.shape[:-2]
    if lead:
        return torch.stack([dequantize_prepared(p.expert(e)) for e in range(p.packed.shape[0])])
    return _dequant_rows(p, 0, p.n)


def _kernel_ok(x: torch.Tensor, p: Prepared) -> bool:
    return p.kind == "int4" and x.dtype in (torch.bfloat16, torch.float16) and p.sz.dtype == x.dtype \
        and x.device.type == "cpu"


def linear(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    """x [..., k] @ W.T -> [..., n] in x.dtype for one prepared matrix W [n, k]."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, p.k)
    if _kernel_ok(x, p):
        xin = torch.cat((x2, x2), dim=1) if p.qtype in PLANES else x2.contiguous()
        y = torch._weight_int4pack_mm_for_cpu(xin, p.packed, GROUP, p.sz)  # [M, Np]
        y = y[:, :p.n] if y.shape[1] != p.n else y
    else:  # tiles of rows dequantized one at a time into x's dtype (the whole matrix never is)
        step = max(ROW_BLOCK, TILE_VALUES // p.k // ROW_BLOCK * ROW_BLOCK)
        y = torch.cat([F.linear(x2, _dequant_rows(p, r0, min(r0 + step, p.n), x.dtype))
                       for r0 in range(0, p.n, step)], dim=1)
    return y.reshape(*lead, p.n)


def experts(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, gate_up: Prepared, down: Prepared,
            inter: int) -> torch.Tensor:
    """Routed experts x [N, H], w [N, k] fp32, idx [N, k] -> [N, H] in x.dtype, `experts_reference`'s math
    (gate rows first, gelu tanh, fp32 routing product rounded to x.dtype, a token's k contributions added in
    ascending expert order): pairs sorted into per-expert segments (kernels/moe_cpu.py), one GEMM pair per
    expert that got tokens, so only those experts' weights are read."""
    from .moe_cpu import _combine_sorted, _pairs

    n, k = idx.shape
    if n == 0:
        return torch.zeros_like(x)
    flat, w_sorted = _pairs(idx, w)  # [N*k], [N, k]
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.packed.shape[0]).tolist()
    xs = x.index_select(0, order // k)  # [N*k, H]
    ys, lo = [], 0
    for e, c in enumerate(counts):
        if c:
            gu = linear(xs[lo:lo + c], gate_up.expert(e))  # [c, 2I]
            ys.append(linear(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], down.expert(e)))  # [c, H]
            lo += c
    return _combine_sorted(torch.cat(ys), order, w_sorted, x.dtype)
