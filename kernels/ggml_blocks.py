"""GGML block formats (Q8_0, Q4_K, Q6_K; Q4_0, Q5_0) as bytes: their layouts and the decoders (`dequantize` equals the
`gguf` package's); kernels/ggml_cpu.py, dgcli/model/ggml.py and dgcli/checkpoint/ build on them.
Must not: read or write files, know tensor names, or compute with the weights.

Type ids are ggml's `GGMLType` values (llama.cpp writes Q5_0 where a Q4_K_M tensor's rows are not a multiple of
256, as this model's down projections'; the `--weights q4_k` dummy uses Q4_0 there). A quantized matrix [..., rows,
K] is held as uint8 [..., rows, K // BLOCK * BYTES]: each row its blocks in order, the GGUF file's bytes.

Block layouts (ggml-common.h), little-endian:
- Q4_0 (32 values, 18 bytes): fp16 d, 16 bytes of nibbles (value j low, j + 16 high); w = d·(q − 8).
- Q5_0 (32 values, 22 bytes): fp16 d, uint32 of 5th bits (bit j: value j), Q4_0's nibbles; w = d·(q − 16).
- Q8_0 (32 values, 34 bytes): fp16 d, int8 q[32]; w = d·q.
- Q4_K (256 values, 144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
  nibbles (bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c+1 in the high ones); w = d·sc·q − dmin·m.
- Q6_K (256 values, 210 bytes): 128 bytes low nibbles, 64 bytes high 2-bit pairs, int8 scales[16] (one per 16
  values), fp16 d; w = d·scale·(q − 32).
"""

from __future__ import annotations

import torch

F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 6, 8, 12, 14, 30
NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K",
         BF16: "BF16"}  # the types dgemma runs (ggml.h's names)
# type -> (elements per block, bytes per block), as ggml.h / gguf-py's GGML_QUANT_SIZES give them
BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144),
          Q6_K: (256, 210), BF16: (1, 2)}
QUANTIZED = (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k elements."""
    elems, nbytes = BLOCKS[qtype]
    return k // elems * nbytes


def fits(qtype: int, k: int) -> bool:
    """Can a row of k values be stored in qtype (k a multiple of its block)?"""
    return k % BLOCKS[qtype][0] == 0


def _blocks(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [..., n * BYTES] -> [R, n, BYTES] (a view where possible)."""
    nbytes = BLOCKS[qtype][1]
    return raw.reshape(-1, raw.shape[-1] // nbytes, nbytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian -> [..., 1] float32 (fp16 values)."""
    return b.contiguous().view(torch.float16).float()


def q4k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes [..., 12] -> 6-bit scales and mins, uint8 [..., 8] each (get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc, mn


def q4k_pack_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The inverse of `q4k_scale_min`: 6-bit sc, mn uint8 [..., 8] -> [..., 12]."""
    lo = torch.cat((sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6)), dim=-1)
    return torch.cat((lo, (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)), dim=-1)


def q4k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 nibble bytes [..., 128] -> q uint8 [..., 8, 32] (sub-block, value)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat((q & 15, q >> 4), dim=-2).reshape(*qs.shape[:-1], 8, 32)


def q40_values(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0 / Q5_0 nibble bytes [..., 16] -> low 4 bits uint8 [..., 32] (value order)."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def q50_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's 4 bytes of 5th bits [..., 4] -> uint8 [..., 32] in {0, 1} (bit j of the little-endian word)."""
    bits = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) & bits) != 0).to(torch.uint8).reshape(*qh.shape[:-1], 32)


def q6k_values(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's ql [..., 128] and qh [..., 64] -> q uint8 [..., 256] in 0..63 (value order)."""
    lead = ql.shape[:-1]
    lo = ql.reshape(*lead, 2, 1, 64)
    lo = torch.cat((lo & 15, lo >> 4), dim=-2).reshape(*lead, 2, 4, 32)  # [.., half, quarter, 32]
    hi = qh.reshape(*lead, 2, 1, 32)
    hi = torch.cat([(hi >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)  # [.., half, quarter, 32]
    return (lo | (hi << 4)).reshape(*lead, 256)


def dequantize(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [..., row_bytes(qtype, k)] -> float32 [..., k]; equal to `gguf.quants.dequantize` (same fp32
    products in the same order)."""
    lead = raw.shape[:-1]
    if qtype in (F32, F16, BF16):
        dt = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[qtype]
        return raw.contiguous().view(dt).float().reshape(*lead, k)
    b = _blocks(raw, qtype)
    if qtype in (Q4_0, Q5_0):
        q = q40_values(b[..., -16:])
        if qtype == Q5_0:
            q = q | (q50_high(b[..., 2:6]) << 4)
        out = _f16(b[..., 0:2]) * (q.view(torch.int8) - (8 if qtype == Q4_0 else 16)).float()
    elif qtype == Q8_0:
        out = b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])
    elif qtype == Q4_K:
        sc, mn = q4k_scale_min(b[..., 4:16])
        d = (_f16(b[..., 0:2]) * sc.float()).unsqueeze(-1)  # [R, n, 8, 1]
        dm = (_f16(b[..., 2:4]) * mn.float()).unsqueeze(-1)
        out = d * q4k_nibbles(b[..., 16:]).float() - dm
    elif qtype == Q6_K:
        d = (_f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
        q = q6k_values(b[..., :128], b[..., 128:192]).view(torch.int8) - 32  # [R, n, 256]
        out = d * q.reshape(*q.shape[:-1], 16, 16).float()
    else:
        raise ValueError(f"ggml type {qtype}: not one of {sorted(NAMES)}")
    return out.reshape(*lead, k)
