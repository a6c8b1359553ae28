"""The GGML block encoders: llama.cpp's reference quantizers (ggml-quants.c, no importance matrix) for Q4_0, Q5_0,
Q8_0, Q4_K and Q6_K, vectorized over blocks in torch (what `dgemma quantize --type` writes: the `gguf` package has no
K-quant encoder), random valid blocks drawn as bytes (dummy weights), and whole models quantized (tests, dummies).
The layouts are kernels/ggml_blocks.py's. Must not: know tensors' names or files.

How close to llama.cpp: the same searches, candidates and rounding (`nearest_int` is round-half-to-even, as
`torch.round`; Q8_0 uses `roundf`, half away from zero). Sums run in torch's order, not C's, so a near-tie between
two candidate scales can resolve the other way (rare; both valid blocks). Q4_0, Q5_0 and Q8_0 are bit-exact with
gguf-py's `quantize` (tests check). The K-quant searches run all candidates at once as [S, C, n] tensors,
CHUNK_SUBBLOCKS rows at a time (in cache); a test pins their bytes to the first, unchunked version.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dgcli.kernels import nvfp4 as nvfp4_blocks
from dgcli.model.ggml import (BF16, BLOCKS, F16, F32, NAMES, QUANTIZED, Q4_0, Q4_K, Q5_0, Q6_K, Q8_0, QuantExperts,
                              QuantLinear, fits, q4k_pack_scales, row_bytes)

GROUP_MAX_EPS = 1e-15
CHUNK_SUBBLOCKS = 512  # sub-blocks per candidate search: [512, ~20, 32] fp32 temporaries fit in L2
# Rows quantized per chunk: the K-quant searches hold ~20 candidates per value, so a whole embedding at once
# would need tens of GB.
CHUNK_VALUES = 1 << 20


# llama.cpp's fallback where a row is not a multiple of 256 (llama_tensor_get_type's incompatible-shape switch)
FALLBACK = {Q4_K: Q5_0, Q6_K: Q8_0}


def type_for(qtype: int, k: int) -> int | None:
    """The type a row of k values gets when `qtype` is asked for: qtype, llama.cpp's fallback, or None."""
    for t in (qtype, FALLBACK.get(qtype)):
        if t is not None and fits(t, k):
            return t
    return None


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: half away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape[:-1], 2 * x.shape[-1])


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """[B, 32] -> [B, 34]: d = absmax / 127, q = roundf(x / d) (quantize_row_q8_0_ref)."""
    d = x.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16_bytes(d), q), dim=1)


def _q_legacy(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q5_0 (quantize_row_q4_0_ref / q5_0_ref): d = (the value of largest magnitude) / -levels/2,
    q = trunc(x / d + levels/2 + 0.5) clamped to levels - 1 -> (fp16 d bytes [B, 2], q uint8 [B, 32])."""
    mx = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # first of the largest |x|
    d = mx / -(levels // 2)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + (levels // 2 + 0.5)).clamp(0, levels - 1).to(torch.uint8)
    return _f16_bytes(d), q


def q4_0(x: torch.Tensor) -> torch.Tensor:
    """[B, 32] -> [B, 18]."""
    d, q = _q_legacy(x, 16)
    return torch.cat((d, q[:, :16] | (q[:, 16:] << 4)), dim=1)


def q5_0(x: torch.Tensor) -> torch.Tensor:
    """[B, 32] -> [B, 22]: the 5th bits as a little-endian uint32, then Q4_0's nibbles."""
    d, q = _q_legacy(x, 32)
    bits = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=x.device)
    qh = ((q >> 4).view(-1, 4, 8).int() * bits).sum(-1).to(torch.uint8)  # [B, 4]
    return torch.cat((d, qh, (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)), dim=1)


def _chunked(fn, x: torch.Tensor, wts: torch.Tensor | None, nmax: int, cands: int) -> tuple[torch.Tensor, ...]:
    """Run a per-sub-block search over CHUNK_SUBBLOCKS rows at a time, its [S, C, n] temporaries in one
    workspace made once: they stay in cache (fresh ~1 MB tensors each chunk would cost a page fault per 4 KB);
    together ~8x faster than one [S, C, n] pass over a whole 1 M-value chunk. Rows are independent and
    torch's row sums do not depend on how many rows there are, so the bytes do not change."""
    rows = max(1, min(CHUNK_SUBBLOCKS, x.shape[0]))
    ws = torch.empty(3, rows, cands, x.shape[1], dtype=torch.float32, device=x.device)
    parts = [fn(x[i:i + rows], None if wts is None else wts[i:i + rows], nmax, ws[:, :min(rows, x.shape[0] - i)])
             for i in range(0, x.shape[0], rows)]
    return tuple(torch.cat(p) for p in zip(*parts)) if len(parts) > 1 else parts[0]


def _make_qkx2(x: torch.Tensor, wts: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants over sub-blocks x [S, n] with weights [S, n]: (scale [S], the_min [S] (>= 0, the value
    subtracted), L [S, n] uint8). Candidates: the plain min/max grid, then nstep+1 rescaled grids each refit by
    weighted least squares; the first of the least weighted squared errors wins (the C loop's strict <)."""
    return _chunked(_qkx2_rows, x, wts, nmax, 21)


def _qkx2_rows(x: torch.Tensor, wts: torch.Tensor, nmax: int, ws: torch.Tensor, rmin: float = -1.0,
               rdelta: float = 0.1, nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Every float op below is the one the first version did, on the same operands in the same order (a test
    # pins its bytes: any change could flip a near-tie); only the [S, C, n] temporaries live in `ws`.
    s = x.shape[0]
    mn = x.amin(dim=1).clamp(max=0)  # [S]
    mx = x.amax(dim=1)
    rng = mx - mn
    flat = rng == 0
    rng_safe = torch.where(flat, torch.ones_like(rng), rng)
    sum_w = wts.sum(dim=1)
    sum_x = (wts * x).sum(dim=1)
    xs = x - mn[:, None]  # [S, n]
    steps = rmin + rdelta * torch.arange(nstep + 1, dtype=torch.float32, device=x.device)  # [C]
    isc = (steps[None, :] + nmax) / rng_safe[:, None]  # [S, C]
    lc = torch.mul(isc[:, :, None], xs[:, None, :], out=ws[0]).round_().clamp_(0, nmax)  # [S, C, n]
    x3, w3 = x[:, None, :], wts[:, None, :]
    t = torch.mul(w3, lc, out=ws[1])  # w·l
    sum_l = t.sum(-1)
    t2 = torch.mul(t, lc, out=ws[2])
    sum_l2 = t2.sum(-1)
    sum_xl = torch.mul(t, x3, out=t2).sum(-1)
    det = sum_w[:, None] * sum_l2 - sum_l * sum_l
    det_safe = torch.where(det > 0, det, torch.ones_like(det))
    sc = (sum_w[:, None] * sum_xl - sum_x[:, None] * sum_l) / det_safe
    m = (sum_l2 * sum_x[:, None] - sum_l * sum_xl) / det_safe
    pos = m > 0
    sc = torch.where(pos, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), sc)
    m = torch.where(pos, torch.zeros_like(m), m)
    torch.mul(sc[:, :, None], lc, out=t).add_(m[:, :, None]).sub_(x3)
    err = torch.mul(w3, t.mul_(t), out=t).sum(-1)  # w·(sc·l + m − x)²
    err = torch.where(det > 0, err, torch.full_like(err, float("inf")))
    # candidate 0: iscale = nmax / range, scale = 1 / iscale, min as is; its L is the grid at step 0
    # (steps[10] is exactly 0.0, so (0 + nmax) / range is the same float and so is the rounded L)
    isc0 = nmax / rng_safe
    step0 = round(-rmin / rdelta)
    scale0 = 1 / isc0
    err0 = (wts * (scale0[:, None] * lc[:, step0] + mn[:, None] - x) ** 2).sum(dim=1)
    best = torch.cat((err0[:, None], err), dim=1).argmin(dim=1)  # first minimum: candidate 0 wins ties
    bc = torch.where(best == 0, step0, best - 1)[:, None]  # candidate 0's L is grid step0's
    L = lc[torch.arange(s, device=x.device), bc[:, 0]]  # [S, n]
    scale = torch.where(best == 0, scale0, sc.gather(1, bc)[:, 0])
    the_min = -torch.where(best == 0, mn, m.gather(1, bc)[:, 0])
    # a flat sub-block: L = 0, scale 0, the_min = -min
    L = torch.where(flat[:, None], torch.zeros_like(L), L)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    the_min = torch.where(flat, -mn, the_min)
    return scale, the_min, L.to(torch.uint8)


def q4_k(x: torch.Tensor) -> torch.Tensor:
    """[B, 256] -> [B, 144] (quantize_row_q4_K_ref): per 32-value sub-block make_qkx2_quants(nmax 15) with
    weights rms + |x|; scales and mins quantized to 6 bits against their maxima; values re-rounded against
    the stored (fp16 x 6-bit) scale and min."""
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    av = torch.sqrt((sub * sub).sum(dim=1, keepdim=True) / 32)
    scales, mins, L = _make_qkx2(sub, av + sub.abs(), 15)
    scales, mins, L = scales.view(nb, 8), mins.view(nb, 8), L.view(nb, 8, 32)
    max_scale = scales.amax(dim=1, keepdim=True).clamp(min=0)
    max_min = mins.amax(dim=1, keepdim=True).clamp(min=0)
    inv_scale = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1), 0)
    inv_min = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1), 0)
    ls = torch.round(inv_scale * scales).clamp(max=63).to(torch.uint8)  # nearest_int then MIN(63): >= 0 here
    lm = torch.round(inv_min * mins).clamp(max=63).to(torch.uint8)
    d16 = (max_scale / 63).to(torch.float16)
    dmin16 = (max_min / 63).to(torch.float16)
    d = d16.float() * ls.float()  # [B, 8]
    dm = dmin16.float() * lm.float()
    requant = torch.round((x.view(nb, 8, 32) + dm[..., None]) / torch.where(d == 0, 1, d)[..., None]).clamp(0, 15)
    L = torch.where((d == 0)[..., None], L, requant.to(torch.uint8))  # d == 0: make_qkx2's L kept
    L = L.view(nb, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)
    head = torch.cat((d16.view(torch.uint8).view(nb, 2), dmin16.view(torch.uint8).view(nb, 2)), dim=1)
    return torch.cat((head, q4k_pack_scales(ls, lm), qs), dim=1)


def _make_qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants(rmse_type 1: weights x²) over sub-blocks x [S, n] -> (scale [S], L [S, n] in 0..2nmax-1).
    Candidates: iscale = -(nmax + 0.1·is) / max for is = 0, -9..-1, 1..9, each least-squares fitted; the first
    with the largest sumlx²/suml2 wins (the C loop's strict >)."""
    return _chunked(_qx_rows, x, None, nmax, 19)


def _qx_rows(x: torch.Tensor, _: None, nmax: int, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.shape[0]  # as _qkx2_rows: the first version's float ops, temporaries in `ws`
    amax_i = x.abs().argmax(dim=1, keepdim=True)  # first of the largest |x|, as the C loop's strict >
    mx = x.gather(1, amax_i)[:, 0]  # [S] signed
    tiny = mx.abs() < GROUP_MAX_EPS
    mx_safe = torch.where(tiny, torch.ones_like(mx), mx)
    steps = torch.tensor([0] + list(range(-9, 0)) + list(range(1, 10)), dtype=torch.float32, device=x.device)
    isc = -(nmax + 0.1 * steps[None, :]) / mx_safe[:, None]  # [S, C]
    isc[:, 0] = -nmax / mx_safe  # candidate 0 as C computes it (no 0.1·0 term)
    lc = torch.mul(isc[:, :, None], x[:, None, :], out=ws[0]).round_().clamp_(-nmax, nmax - 1)  # [S, C, n]
    w = x * x
    # the first version's products w·x·l and w·l·l, left to right
    wx3, w3 = (w * x)[:, None, :], w[:, None, :]
    sumlx = torch.mul(wx3, lc, out=ws[1]).sum(-1)
    suml2 = torch.mul(w3, lc, out=ws[2]).mul_(lc).sum(-1)
    l2_safe = torch.where(suml2 > 0, suml2, torch.ones_like(suml2))
    crit = torch.where(suml2 > 0, sumlx * sumlx / l2_safe, torch.zeros_like(sumlx))
    best = crit.argmax(dim=1)  # first maximum
    scale = torch.where(suml2 > 0, sumlx / l2_safe, torch.zeros_like(sumlx)).gather(1, best[:, None])[:, 0]
    L = lc[torch.arange(s, device=x.device), best] + nmax  # [S, n]
    L = torch.where(tiny[:, None], torch.zeros_like(L), L)
    scale = torch.where(tiny, torch.zeros_like(scale), scale)
    return scale, L.to(torch.uint8)


def q6_k(x: torch.Tensor) -> torch.Tensor:
    """[B, 256] -> [B, 210] (quantize_row_q6_K_ref): per 16-value sub-block make_qx_quants(nmax 32); the
    signed scale of largest magnitude sets d = max_scale / -128; scales to int8; values re-rounded against the
    stored scale. A block whose scales are all ~0 is all zero bytes."""
    nb = x.shape[0]
    scales, L = _make_qx(x.reshape(nb * 16, 16), 32)
    scales, L = scales.view(nb, 16), L.view(nb, 256)
    pick = scales.abs().argmax(dim=1, keepdim=True)  # first of the largest |scale|
    max_scale = scales.gather(1, pick)  # [B, 1]
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = -128 / torch.where(zero, torch.ones_like(max_scale), max_scale)
    d16 = (1 / iscale).to(torch.float16)
    sc = torch.round(iscale * scales).clamp(max=127).to(torch.int8)  # MIN(127, nearest_int): >= -128 here
    d = (d16.float() * sc.float()).repeat_interleave(16, dim=1)  # [B, 256]
    requant = torch.round(x / torch.where(d == 0, 1, d)).clamp(-32, 31) + 32
    L = torch.where(d == 0, L, requant.to(torch.uint8)).view(nb, 2, 4, 32)  # [B, half, quarter, 32]
    ql = (torch.cat((L[:, :, 0], L[:, :, 1]), -1) & 15) | ((torch.cat((L[:, :, 2], L[:, :, 3]), -1) & 15) << 4)
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = torch.cat((ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(torch.uint8),
                     d16.view(torch.uint8).view(nb, 2)), dim=1)
    return torch.where(zero, torch.zeros_like(out), out)


def random_blocks(shape: tuple[int, ...], qtype: int, k: int, generator: torch.Generator | None = None,
                  std: float | None = None) -> torch.Tensor:
    """Random valid blocks uint8 [*shape, row_bytes(qtype, k)] drawn directly as bytes (no floats quantized:
    fast enough for a 26B dummy): value bytes uniform, 6-bit scales in 32..63, and fp16 d (dmin) fixed per
    tensor so that values spread about ±std·sqrt(3) (d, dmin finite and > 0; std default 1/sqrt(k), the
    dummy init's)."""
    std = std if std is not None else k ** -0.5
    elems, nbytes = BLOCKS[qtype]
    nblk = k // elems
    out = torch.randint(0, 256, (*shape, nblk, nbytes), dtype=torch.uint8, generator=generator)
    amp = std * 3 ** 0.5

    def f16(value: float) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.float16).view(torch.uint8)

    if qtype == Q8_0:
        out[..., 0:2] = f16(amp / 127)
    elif qtype in (Q4_0, Q5_0):
        out[..., 0:2] = f16(amp / (8 if qtype == Q4_0 else 16))
    elif qtype == Q4_K:
        # w = d·sc·q − dmin·m with q in 0..15: centred when dmin·m ~ d·sc·7.5; sc, m in 32..63
        out[..., 0:2] = f16(2 * amp / (15 * 48))
        out[..., 2:4] = f16(amp / 48)
        sc_mn = torch.randint(32, 64, (*shape, nblk, 16), dtype=torch.int16, generator=generator).to(torch.uint8)
        out[..., 4:16] = q4k_pack_scales(sc_mn[..., :8], sc_mn[..., 8:])
    elif qtype == Q6_K:
        out[..., 208:210] = f16(amp / (32 * 48))
        out[..., 192:208] = (torch.randint(32, 64, out[..., 192:208].shape, dtype=torch.int16, generator=generator)
                             .to(torch.uint8))
    else:
        raise ValueError(f"no random blocks for ggml type {qtype}")
    return out.reshape(*shape, row_bytes(qtype, k))


def quantize(w: torch.Tensor, qtype: int) -> torch.Tensor:
    """w float [..., K] (K a multiple of the block size) -> uint8 [..., row_bytes(qtype, K)] in ggml's layout,
    rounded as llama.cpp's reference quantizer rounds (no importance matrix)."""
    lead, k = w.shape[:-1], w.shape[-1]
    if qtype in (F32, F16, BF16):
        dt = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[qtype]
        return w.to(dt).contiguous().view(torch.uint8).reshape(*lead, row_bytes(qtype, k))
    if qtype == nvfp4_blocks.GGUF_NVFP4:  # one e4m3 scale per 16 (absmax / 6, no global scale: ggml's quantizer's way)
        from dgcli.model.nvfp4 import quantize_rows

        packed, scale, _ = quantize_rows(w.detach().float().reshape(-1, 1, k), torch.ones(w[..., 0].numel(), 1))
        return nvfp4_blocks.to_gguf_blocks(packed[:, 0], scale[:, 0]).reshape(*lead, k // 64 * 36)
    if qtype not in QUANTIZED:
        raise ValueError(f"ggml type {qtype}: not one of {sorted(NAMES)}")
    elems, nbytes = BLOCKS[qtype]
    if k % elems:
        raise ValueError(f"{NAMES[qtype]} needs rows of a multiple of {elems} values, not {k}")
    blocks = w.detach().reshape(-1, elems).float()
    fn = {Q4_0: q4_0, Q5_0: q5_0, Q8_0: q8_0, Q4_K: q4_k, Q6_K: q6_k}[qtype]
    step = max(1, CHUNK_VALUES // elems)
    out = torch.cat([fn(blocks[i:i + step]) for i in range(0, blocks.shape[0], step)]) if blocks.numel() else \
        torch.empty(0, nbytes, dtype=torch.uint8)
    return out.reshape(*lead, row_bytes(qtype, k))


# ---- whole models (tests, dummy weights) -----------------------------------------------------------------------

# The linears a GGUF stores quantized (llama.cpp quantizes every 2-D weight but the router, ffn_gate_inp)
TARGETS = re.compile(r"^(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|"
                     r"self_conditioning\.(gate|up|down)_proj)$")


def targets(model: nn.Module) -> list[str]:
    """The names of the linears stored quantized (and every layer's experts are)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and TARGETS.match(n)]


@torch.no_grad()
def to_ggml_(model: nn.Module, pick, blocks, dtype: torch.dtype) -> nn.Module:
    """Swap the target linears and experts for GGML modules in place: `pick(k)` the type of rows of k values (None:
    left as they are), `blocks(w, type)` their bytes (quantized from `w`, or drawn for a meta `w`)."""
    for name in targets(model):
        old = model.get_submodule(name)
        t = pick(old.in_features)
        if t is not None:
            model.set_submodule(name, QuantLinear(blocks(old.weight, t), t, old.in_features, old.out_features, dtype))
    for layer in model.layers:
        old = layer.experts
        e, two_i, h = old.gate_up_proj.shape
        tg, td = pick(h), pick(two_i // 2)
        if tg is not None and td is not None:
            layer.experts = QuantExperts(blocks(old.gate_up_proj, tg), tg, blocks(old.down_proj, td), td, h, two_i // 2,
                                         dtype)
    return model


def quantize_model_(model: nn.Module, qtype: int, dtype: torch.dtype | None = None) -> nn.Module:
    """Quantize a materialised plain model's target linears and experts to `qtype` in place (rows that do not fit
    take llama.cpp's fallback type, or stay as they are); scales in `dtype` (default: the embedding's)."""
    return to_ggml_(model, lambda k: type_for(qtype, k), quantize, dtype or model.embed_tokens.weight.dtype)
