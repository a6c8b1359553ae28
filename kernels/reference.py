"""Torch reference of the vocabulary pass: the spec its kernels are tested against.

Owns: `vocab_pass`, everything the entropy-bound sampler needs from the vocabulary for one denoising step (tied head
+ softcap and temperature as `processed_logits`, one categorical draw, argmax, entropy, the next step's
self-conditioning soft embedding), in row chunks so the [B, C, V] float32 logits never exist. Must not: know about
the denoising loop, the model or devices. Numerics follow transformers' DiffusionGemma (spec §5.3, §5.8, §7.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A chunk's float32 logits stay within this many bytes (32 MiB: 32 rows at V = 262,144); with its log-probs and
# float64 CDF a pass takes ~100 MiB more whatever the canvas length, at the price of reading E once per chunk.
CHUNK_BYTES = 32 * 2**20


@dataclass
class VocabPassOut:
    sample: torch.Tensor  # [B, C] int64: one draw from softmax(L) per position (inverse CDF at `uniform`)
    argmax: torch.Tensor  # [B, C] int64: argmax of L (= argmax of the raw logits)
    entropy: torch.Tensor  # [B, C] float32: entropy of softmax(L) in nats
    soft: torch.Tensor | None  # [B, C, H] embedding dtype: the next step's self-conditioning input


def row_temperature(temperature: float | torch.Tensor, b: int, c: int, device: torch.device) -> torch.Tensor:
    """The temperature as a float32 divisor for [B·C, ...] rows: 0-dim when one value serves the batch, [B·C, 1]
    when `temperature` is a [B] tensor (one per batch row, as rows at different steps of their blocks have)."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    if t.dim() == 0 or t.numel() == 1:
        return t.reshape(())
    if t.shape != (b,):
        raise ValueError(f"temperature has shape {tuple(t.shape)}; give one value or one per batch row ({b})")
    return t.repeat_interleave(c)[:, None]


def processed_logits(logits: torch.Tensor, softcap: float | None, temperature: float | torch.Tensor) -> torch.Tensor:
    """L = softcap·tanh(R / softcap) / temperature, in place on the float32 raw logits R (a buffer the caller owns)."""
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits.div_(temperature)


def auto_row_chunk(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk of float32 logits [rows, V] fits in `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def vocab_pass(hidden: torch.Tensor, embed: torch.Tensor, *, softcap: float | None, temperature: float | torch.Tensor,
               embed_scale: torch.Tensor | float, uniform: torch.Tensor, want_soft: bool = True,
               row_chunk: int | None = None) -> VocabPassOut:
    """One denoising step's vocabulary work for canvas hidden states [B, C, H] and the tied embedding [V, H].

    Per position: raw logits R = softcap·tanh(float32(h·Eᵀ)/softcap) (the matmul in the model dtype, as the
    reference's lm_head), L = R / temperature; returns a draw from softmax(L), argmax(L), the entropy of softmax(L)
    and, if `want_soft`, soft = (bf16(softmax_fp32(bf16(L))) @ E) · embed_scale, bf16 meaning the embedding dtype
    (the reference stores L in it between steps). The draw is an inverse CDF at `uniform` [B, C] (float64 in [0, 1),
    from the sampler's counter-based stream): the first j with Σ_{i≤j} exp(L_i - M) > u·Σ_i exp(L_i - M), the sums
    in float64. Every path makes this draw, so the same uniforms give the same tokens up to rounding at a CDF
    boundary. `temperature`: one value, a 0-dim tensor (no host value: graph capture) or one per batch row [B].
    `row_chunk` (default `auto_row_chunk(V)`) changes nothing but memory.
    """
    b, c, h = hidden.shape
    v = embed.shape[0]
    rows = hidden.reshape(b * c, h)  # [N, H]
    n = rows.shape[0]
    u = uniform.reshape(n).to(device=hidden.device, dtype=torch.float64)  # [N]
    temp = row_temperature(temperature, b, c, hidden.device)  # 0-dim or [N, 1]
    step = row_chunk if row_chunk is not None else auto_row_chunk(v)
    if step < 1:
        raise ValueError(f"row_chunk must be >= 1, got {step}")
    scale = torch.as_tensor(embed_scale, device=embed.device).to(embed.dtype)  # 0-dim, like the reference

    sample = torch.empty(n, dtype=torch.long, device=hidden.device)  # [N]
    argmax = torch.empty(n, dtype=torch.long, device=hidden.device)  # [N]
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
    soft = torch.empty(n, h, dtype=embed.dtype, device=hidden.device) if want_soft else None  # [N, H]

    # Chunk bounds; a last chunk of 1 row joins the one before: a 1-row product takes oneDNN's GEMV path,
    # whose rounding differs from a row of a GEMM (transformers runs [B·C, V] at once; for 2 rows and up a
    # row's bf16 GEMM result does not depend on the other rows, measured).
    bounds = list(range(0, n, step))
    if len(bounds) > 1 and n - bounds[-1] == 1:
        bounds.pop()
    for lo, hi in zip(bounds, bounds[1:] + [n]):
        # float() copies unless the model runs in fp32; then F.linear's output is ours to modify anyway.
        logits = F.linear(rows[lo:hi], embed).float()  # [r, V]
        logits = processed_logits(logits, softcap, temp if temp.dim() == 0 else temp[lo:hi])  # L
        argmax[lo:hi] = logits.argmax(dim=-1)

        # Entropy as torch.distributions.Categorical computes it (what the reference's accept and
        # stop rules use): normalised log-probs, then softmax of those.
        logp = logits - logits.logsumexp(dim=-1, keepdim=True)  # [r, V]
        p = torch.softmax(logp, dim=-1)  # [r, V]
        entropy[lo:hi] = -(p.mul_(logp)).sum(dim=-1)
        del logp, p

        # Inverse CDF: the first column whose cumulative mass exceeds u·total (u < 1, so some column
        # with mass does, up to the rounding of u·total; `min` keeps that rare case on the last such column).
        mx = logits.amax(dim=-1, keepdim=True)  # [r, 1]
        p = torch.exp(logits - mx).double()  # [r, V]
        cdf = p.cumsum_(dim=-1)  # [r, V]
        j = torch.searchsorted(cdf, (u[lo:hi] * cdf[:, -1])[:, None], right=True)[:, 0]  # [r]
        sample[lo:hi] = torch.minimum(j, (cdf < cdf[:, -1:]).sum(dim=-1))
        del p, cdf

        if soft is not None:
            stored = logits.to(embed.dtype)  # [r, V] what the reference keeps between steps
            probs = torch.softmax(stored, dim=-1, dtype=torch.float32).to(embed.dtype)  # [r, V]
            soft[lo:hi] = torch.matmul(probs, embed) * scale  # [r, H]
            del stored, probs
        del logits

    return VocabPassOut(sample=sample.view(b, c), argmax=argmax.view(b, c), entropy=entropy.view(b, c),
                        soft=None if soft is None else soft.view(b, c, h))
