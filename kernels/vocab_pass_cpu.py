"""The vocabulary pass for CPU: `vocab_pass_tiled`, the contract of `reference.vocab_pass` computed one vocabulary
tile at a time for all rows (one head GEMM [N, H]x[H, T] per tile, fp32 online statistics, the streaming draw of
kernels/categorical.py), never a [C, V] float32 tensor. Must not: know about the denoising loop or models, or run on
CUDA (it reads row counts back to the host).

The low-precision soft embedding is the reference's own ops on the same values, so its bits are the reference's:
each tile writes bf16(L) into one [N, V] buffer (the tensor transformers keeps between steps), torch's softmax
overwrites it with the bf16 probabilities, then one GEMM over the whole vocabulary. Why not online: a bf16
probability is rounded after normalising by the full row's sum; rounding per tile moved ~40 % of the soft
embedding's entries by a bf16 step. In fp32 it stays online (rescaled as the running max grows).
Memory: the [C, V] bf16 buffer plus a tile's buffers (144 MiB at V = 262,144, C = 256, against the row-chunked
reference's 169 MiB; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .categorical import draw_from_groups
from .reference import VocabPassOut, processed_logits, row_temperature

# A tile's float32 [N, T] buffers stay near this size (4 MiB: the 256-row canvas with T = 4096): large
# enough that the head GEMM runs at full speed, small enough that the ~4 live buffers stay in cache.
TILE_BYTES = 4 * 2**20
TILE_ROWS = 256  # the rows the default tile width is sized for (one real canvas); more rows: more memory
# Columns per group of the draw's statistics (when the tile width is a multiple of it; else one group
# per tile): the draw recomputes one group per row at the end, [N, GROUP, H] gathered embedding rows.
GROUP = 64
# The low-precision soft embedding's softmax runs over this many bytes of float32 [rows, V] at a time
# (its float32 input copy and its output: twice this at once).
SOFTMAX_BYTES = 4 * 2**20


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


def tile_stats(raw: torch.Tensor, softcap: float | None, temperature: torch.Tensor,
               soft_dtype: torch.dtype | None, width: int,
               store: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One vocabulary tile's statistics relative to its own max (the caller rescales them to the running max: no
    state here). raw [N, T] head output -> tmax [N] (max of L), targ [N] (its first index), zt = Σ exp(L - tmax),
    st = Σ exp(L - tmax)·(L - tmax), gz [N, ceil(T/width)] (zt per group of `width` columns: the draw's statistics),
    and for the soft embedding `keep` [N, T]: in fp32 exp(L - tmax) (the online weights), else round(L) in
    soft_dtype (what the reference's softmax reads), written into `store` when given. Elementwise plus row
    reductions: `--compile` fuses it into a couple of passes."""
    logits = processed_logits(raw.float(), softcap, temperature)  # [N, T] L (in place on an fp32 raw: it is dropped)
    tmax, targ = _tile_max(logits)  # [N]
    shift = tmax.unsqueeze(1)  # [N, 1]
    stored = None
    if soft_dtype not in (None, torch.float32):  # [N, T] round(L)
        stored = logits.to(soft_dtype) if store is None else store.copy_(logits)
    d = logits.sub_(shift)  # [N, T] L - tmax (in place: L is not needed any more)
    e = torch.exp(d)  # [N, T]
    zt = e.sum(dim=1)  # [N]
    pad = -e.shape[1] % width
    gz = (F.pad(e, (0, pad)) if pad else e).view(e.shape[0], -1, width).sum(dim=2)  # [N, groups]
    st = torch.mul(d, e, out=d).sum(dim=1)  # [N] Σ e·(L - tmax) (linalg.vecdot is slower on CPU)
    keep = None if soft_dtype is None else e if stored is None else stored  # fp32: softmax(round(L)) is softmax(L)
    return tmax, targ, zt, st, gz, keep


@functools.cache
def compiled_tile_stats():
    """`tile_stats` through torch.compile (built once per process; inductor caches it across runs)."""
    return torch.compile(tile_stats, dynamic=False)


def soft_from_stored(stored: torch.Tensor, embed: torch.Tensor, scale: torch.Tensor,
                     chunk_bytes: int = SOFTMAX_BYTES) -> torch.Tensor:
    """The reference's soft embedding from the rounded logits `stored` [N, V] (overwritten with the probabilities):
    torch's fp32 softmax a few rows at a time, each rounded back into `stored`, then one GEMM and the scale in the
    embedding dtype: transformers' ops on transformers' values."""
    n, v = stored.shape
    step = max(1, chunk_bytes // (4 * v))
    for lo in range(0, n, step):
        if stored.dtype == torch.bfloat16:
            # torch's bf16 softmax on CPU computes in fp32 and rounds once: the same bits as the fp32 softmax
            # rounded (checked in tests/kernels), without the fp32 copy of the rows and the fp32 output.
            stored[lo:lo + step] = torch.softmax(stored[lo:lo + step], dim=-1)
        else:
            stored[lo:lo + step] = stored[lo:lo + step].softmax(dim=-1, dtype=torch.float32)  # rounds as .to()
    return torch.matmul(stored, embed) * scale  # [N, H]


@torch.no_grad()
def vocab_pass_tiled(hidden: torch.Tensor, embed: torch.Tensor, *, softcap: float | None,
                     temperature: float | torch.Tensor, embed_scale: torch.Tensor | float, uniform: torch.Tensor,
                     want_soft: bool = True, tile: int | None = None, compile_tiles: bool = False) -> VocabPassOut:
    """`reference.vocab_pass` over vocabulary tiles of `tile` columns (default `auto_tile(TILE_ROWS, V)`: ~16 MiB of
    tiles per 256 rows). `compile_tiles` runs each tile's elementwise math through torch.compile (`--compile`).
    Batch rows go through in chunks of about TILE_ROWS rows (whole canvases, so a chunk's tiles stay in cache); a
    row's numbers depend on neither its chunk nor the tile width (the soft GEMM's rows are independent for N >= 2)."""
    b, c, h = hidden.shape
    per = max(1, TILE_ROWS // c)  # batch rows (canvases) per chunk
    if b > per and tile is None:
        many = torch.is_tensor(temperature) and temperature.numel() > 1  # one temperature per batch row
        outs = [vocab_pass_tiled(hidden[k:k + per], embed, softcap=softcap,
                                 temperature=temperature[k:k + per] if many else temperature,
                                 embed_scale=embed_scale, uniform=uniform[k:k + per], want_soft=want_soft,
                                 compile_tiles=compile_tiles) for k in range(0, b, per)]
        cat = lambda f: None if getattr(outs[0], f) is None else torch.cat([getattr(o, f) for o in outs])  # noqa: E731
        return VocabPassOut(sample=cat("sample"), argmax=cat("argmax"), entropy=cat("entropy"), soft=cat("soft"))
    v = embed.shape[0]
    rows = hidden.reshape(b * c, h)  # [N, H]
    n = rows.shape[0]
    # The default width is that of one 256-row canvas whatever the batch: a row's numbers (online sums,
    # the soft embedding's rounding) then do not depend on how many rows share the pass.
    t_cols = tile if tile is not None else auto_tile(TILE_ROWS, v)
    if t_cols < 1:
        raise ValueError(f"tile must be >= 1, got {t_cols}")
    dev = hidden.device
    scale = torch.as_tensor(embed_scale, device=embed.device).to(embed.dtype)  # 0-dim, like the reference
    # a tensor (0-dim, or [N, 1] per row), so that a compiled tile function does not recompile per temperature
    temp = row_temperature(temperature, b, c, dev)
    stats = compiled_tile_stats() if compile_tiles else tile_stats
    soft_dtype = embed.dtype if want_soft else None
    # Low-precision soft embedding: the rounded logits of every tile, for the reference's own softmax and GEMM.
    stored = torch.empty(n, v, dtype=embed.dtype, device=dev) if want_soft and embed.dtype != torch.float32 else None
    width = GROUP if t_cols % GROUP == 0 else t_cols
    gmax, gsum = [], []  # per tile: [N, groups] reference max and Σ exp(L - max) of each group

    m = z = s = acc = arg = None  # running max of L, Σ exp(L - m), Σ exp(L - m)(L - m), fp32 soft, argmax
    for lo in range(0, v, t_cols):
        hi = min(v, lo + t_cols)
        et = embed[lo:hi]  # [T, H]
        raw = F.linear(rows, et)  # [N, T] in the embedding dtype
        if stored is not None and not compile_tiles:  # round(L) straight into the [N, V] buffer
            tmax, targ, zt, st, gz, keep = stats(raw, softcap, temp, soft_dtype, width, stored[:, lo:hi])
        else:
            tmax, targ, zt, st, gz, keep = stats(raw, softcap, temp, soft_dtype, width)
        gmax.append(tmax[:, None].expand_as(gz))
        gsum.append(gz)
        if m is None:  # first tile: its max is the running max
            m, arg, a_t = tmax, targ, None
            z, s = zt, st
        else:
            m_new = torch.maximum(m, tmax)
            arg = torch.where(tmax > m, targ + lo, arg)  # strict: the earliest index wins ties
            alpha, a_t = torch.exp(m - m_new), torch.exp(tmax - m_new)  # [N] ≤ 1 each
            st = a_t * (st + zt * (tmax - m_new))  # this tile's sums in the running max's scale
            zt = a_t * zt
            s = alpha * (s + z * (m - m_new)) + st
            z = alpha * z + zt
            m = m_new
        if stored is not None:
            if compile_tiles:  # the compiled tile function returns round(L); eager wrote it in place
                stored[:, lo:hi] = keep
        elif want_soft:  # fp32: Σ exp(L - m)·E online; its normaliser is z
            prod = torch.matmul(keep, et)  # [N, H]
            acc = prod if a_t is None else acc.mul_(alpha.unsqueeze(1)).add_(prod.mul_(a_t.unsqueeze(1)))
        del raw, keep

    entropy = torch.log(z) - s / z
    soft = None
    if stored is not None:
        soft = soft_from_stored(stored, embed, scale)  # before the draw: the [N, V] buffer goes first
        del stored
    elif want_soft:
        soft = (acc / z.unsqueeze(1)) * scale
    u = uniform.reshape(n).to(device=dev, dtype=torch.float64)  # [N]
    if len(gmax) > 1:  # one tile: its statistics as they are (an expanded max: the same values)
        gmax, gsum = [torch.cat(gmax, dim=1)], [torch.cat(gsum, dim=1)]
    pick = draw_from_groups(gmax[0], gsum[0], u, width, rows, embed, softcap, temp)
    return VocabPassOut(sample=pick.view(b, c), argmax=arg.view(b, c), entropy=entropy.view(b, c),
                        soft=None if soft is None else soft.view(b, c, h))
