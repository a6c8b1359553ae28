"""The vocabulary pass for CPU: vocabulary tiles, online statistics, never a [C, V] tensor.

Owns: `vocab_pass_tiled`, same contract and outputs as `kernels/reference.py::vocab_pass` (tied head +
softcap, temperature, one categorical draw, argmax, entropy, self-conditioning soft embedding), computed
one vocabulary tile at a time for all rows: one bf16 head GEMM [N, H]x[H, T] per tile, fp32 online
statistics (running max, sum of exp, entropy numerator, argmax), a streaming categorical draw and the
soft embedding accumulated flash-attention style (rescaled when the running max grows).
Must not: know about the denoising loop, devices other than CPU (it reads a few row counts back to the
host, which is free on CPU and a sync on CUDA: CUDA uses the Triton kernel), or models.

Semantics kept from the reference: argmax of L (first index on ties), entropy of softmax(L) in fp32,
and soft = bf16(softmax_fp32(bf16(L))) @ E · scale with L rounded to the embedding dtype before the
softmax. Two differences, both within the reference's own rounding: the probabilities rounded to bf16
before the soft GEMM are unnormalised (scaled by exp(-running max); the normalisation is applied to
the fp32 accumulator at the end), and each tile's bf16 GEMM output is rounded to bf16 before the fp32
accumulation. Draws come from `generator` but are not the reference's draws (see `_draw`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import VocabPassOut

# A tile's float32 [N, T] buffers stay near this size (4 MiB: the 256-row canvas with T = 4096): large
# enough that the head GEMM runs at full speed, small enough that the ~4 live buffers stay in cache.
TILE_BYTES = 4 * 2**20


def auto_tile(rows: int, vocab_size: int, tile_bytes: int = TILE_BYTES) -> int:
    """Vocabulary columns per tile: a multiple of 256 (GEMM-friendly) with rows·T·4 ≈ tile_bytes."""
    t = max(256, (tile_bytes // (4 * max(rows, 1))) // 256 * 256)
    return min(t, vocab_size)


def _tile_max(x: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and first argmax of x [N, T]. torch's max-with-index is several times slower than a
    plain max on CPU, so: block maxima (one vectorised pass), then the first block holding the row
    max, then the first position inside that block (both on [N, block]-sized data)."""
    n, t = x.shape
    if t % block:
        return x.max(dim=1)
    blocks = x.view(n, t // block, block)  # [N, T/b, b]
    bmax = blocks.amax(dim=2)  # [N, T/b]
    mx = bmax.amax(dim=1)  # [N]
    first_block = (bmax == mx[:, None]).int().argmax(dim=1)  # [N] argmax returns the first maximal index
    seg = blocks[torch.arange(n, device=x.device), first_block]  # [N, b]
    inner = (seg == mx[:, None]).int().argmax(dim=1)  # [N]
    return mx, first_block * block + inner


def _draw(e: torch.Tensor, zt: torch.Tensor, total: torch.Tensor, u: torch.Tensor, pick: torch.Tensor,
          lo: int) -> None:
    """Streaming categorical draw: after the pass, pick[r] ~ softmax(L[r]) exactly.

    The tile holds mass zt of the running total (both in the same exp(-m) scale); the current pick is
    replaced by a draw from inside the tile with probability zt/total, so tile t ends up chosen with
    probability w_t/W_t · Π_{s>t} W_{s-1}/W_s = w_t/W. Inside the tile: inverse CDF (cumsum, search).
    Two uniforms per row per tile; only the replaced rows pay for the cumsum (usually a few per row
    over the whole pass). Not the reference's Gumbel draws: equal seeds give equal samples only
    between calls of this function with equal tiles."""
    rows = (u[0] * total < zt).nonzero().squeeze(1)  # [R]
    if rows.numel() == 0:
        return
    cdf = e.index_select(0, rows).cumsum_(dim=1)  # [R, T]
    target = u[1].index_select(0, rows).mul_(cdf[:, -1]).unsqueeze(1)  # [R, 1]
    j = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)  # [R]
    pick.index_copy_(0, rows, j + lo)


@torch.no_grad()
def vocab_pass_tiled(
    hidden: torch.Tensor,
    embed: torch.Tensor,
    *,
    softcap: float | None,
    temperature: float | torch.Tensor,
    embed_scale: torch.Tensor | float,
    generator: torch.Generator | None,
    want_soft: bool = True,
    tile: int | None = None,
    row_chunk: int | None = None,
) -> VocabPassOut:
    """`kernels.reference.vocab_pass` over vocabulary tiles of `tile` columns (default `auto_tile`).

    Extra memory: a few [N, T] float32 tiles plus the [N, H] float32 soft accumulator, whatever V is.
    `row_chunk` is accepted for signature compatibility with the reference and ignored (all rows go
    through each tile together: one E read per step)."""
    del row_chunk
    b, c, h = hidden.shape
    v = embed.shape[0]
    rows = hidden.reshape(b * c, h)  # [N, H]
    n = rows.shape[0]
    t_cols = tile if tile is not None else auto_tile(n, v)
    if t_cols < 1:
        raise ValueError(f"tile must be >= 1, got {t_cols}")
    dev, f32 = hidden.device, torch.float32
    low_precision = embed.dtype != f32  # L is rounded to the embedding dtype before the soft softmax
    scale = torch.as_tensor(embed_scale, device=embed.device).to(embed.dtype)  # 0-dim, like the reference

    m = torch.empty(n, dtype=f32, device=dev)  # running max of L
    z = torch.empty(n, dtype=f32, device=dev)  # Σ exp(L - m)
    s = torch.empty(n, dtype=f32, device=dev)  # Σ exp(L - m)·(L - m): entropy = log z - s/z
    arg = torch.empty(n, dtype=torch.long, device=dev)
    pick = torch.zeros(n, dtype=torch.long, device=dev)
    zb = torch.empty(n, dtype=f32, device=dev) if want_soft else None  # Σ exp(bf16(L) - m)
    acc = torch.zeros(n, h, dtype=f32, device=dev) if want_soft else None  # Σ exp(bf16(L) - m)·E

    for lo in range(0, v, t_cols):
        hi = min(v, lo + t_cols)
        et = embed[lo:hi]  # [T, H]
        logits = F.linear(rows, et).float()  # [N, T]; float() copies unless fp32 (then the buffer is ours)
        if softcap:
            logits.div_(softcap).tanh_().mul_(softcap)
        logits.div_(temperature)  # L
        tmax, targ = _tile_max(logits)  # [N]
        first = lo == 0
        if first:
            m_new, arg = tmax, targ
        else:
            m_new = torch.maximum(m, tmax)
            arg = torch.where(tmax > m, targ + lo, arg)  # strict: the earliest index wins ties
        shift = m_new.unsqueeze(1)  # [N, 1]

        stored = logits.to(embed.dtype) if (want_soft and low_precision) else None  # [N, T] bf16(L)
        d = logits.sub_(shift)  # [N, T] L - m (in place: L is not needed any more)
        e = torch.exp(d)  # [N, T]
        zt = e.sum(dim=1)  # [N]
        st = torch.mul(d, e, out=d).sum(dim=1)  # [N] Σ e·(L - m) (linalg.vecdot is slower on CPU)

        if want_soft:
            if stored is None:  # fp32 embedding: softmax(bf16(L)) is softmax(L); reuse e
                pb, zbt = e, zt
            else:
                eb = stored.float().sub_(shift).exp_()  # [N, T]
                zbt = eb.sum(dim=1)
                pb = eb.to(embed.dtype)  # [N, T]
                del eb
            prod = torch.matmul(pb, et).float()  # [N, H]

        if first:
            z, s = zt, st
            if want_soft:
                zb, acc = zbt, prod
        else:
            alpha = torch.exp(m - m_new)  # [N] ≤ 1: rescale what was summed under the old max
            s = alpha * (s + z * (m - m_new)) + st
            z = alpha * z + zt
            if want_soft:
                zb = alpha * zb + zbt
                acc = acc.mul_(alpha.unsqueeze(1)).add_(prod)
        m = m_new
        _draw(e, zt, z, torch.rand(2, n, generator=generator, device=dev), pick, lo)
        del logits, d, e, stored

    entropy = torch.log(z) - s / z
    soft = None
    if want_soft:
        soft = (acc / zb.unsqueeze(1)).to(embed.dtype) * scale  # the reference rounds, then scales
    return VocabPassOut(
        sample=pick.view(b, c),
        argmax=arg.view(b, c),
        entropy=entropy.view(b, c),
        soft=None if soft is None else soft.view(b, c, h),
    )
