"""Torch references for the fused kernels; each function here is the spec its kernel is tested against.

Owns: `vocab_pass`, everything the entropy-bound sampler needs from the vocabulary for one denoising
step (tied head + softcap, temperature, one categorical draw, argmax, entropy, and the next step's
self-conditioning soft embedding), computed in row chunks so the [B, C, V] float32 logits never exist.
Must not: know about the denoising loop, the accept/stop rules, the model or devices beyond the
tensors it is given. Numerics follow transformers' DiffusionGemma (spec §5.3, §5.8, §7.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A chunk's float32 logits stay within this many bytes (32 MiB: 32 rows at V = 262,144). Each chunk
# holds about three such fp32 buffers at once (logits, log-probs, noise), so the extra memory of a
# pass is ~100 MiB whatever the canvas length. The price: the head and the soft-embedding matmul
# read E once per chunk (8x per step for C = 256); the fused kernel is meant to remove that.
CHUNK_BYTES = 32 * 2**20


@dataclass
class VocabPassOut:
    sample: torch.Tensor  # [B, C] int64: one draw from softmax(L) per position
    argmax: torch.Tensor  # [B, C] int64: argmax of L (= argmax of the raw logits)
    entropy: torch.Tensor  # [B, C] float32: entropy of softmax(L) in nats
    soft: torch.Tensor | None  # [B, C, H] embedding dtype: the next step's self-conditioning input


def auto_row_chunk(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk of float32 logits [rows, V] fits in `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def vocab_pass(
    hidden: torch.Tensor,
    embed: torch.Tensor,
    *,
    softcap: float | None,
    temperature: float | torch.Tensor,
    embed_scale: torch.Tensor | float,
    generator: torch.Generator | None,
    want_soft: bool = True,
    row_chunk: int | None = None,
) -> VocabPassOut:
    """One denoising step's vocabulary work for canvas hidden states `hidden` [B, C, H] and the tied
    embedding `embed` [V, H].

    Per position: raw logits R = softcap·tanh(float32(h·Eᵀ)/softcap) (the matmul in the model dtype,
    as the reference's lm_head), processed logits L = R / temperature; returns a categorical sample
    of softmax(L) (Gumbel-max, noise from `generator`), argmax(L), the entropy of softmax(L) and, if
    `want_soft`, soft = (bf16(softmax_fp32(bf16(L))) @ E) · embed_scale, where bf16 means "cast to
    the embedding dtype" (the reference stores L in that dtype between steps).

    Rows are processed `row_chunk` at a time (default: `auto_row_chunk(V)`). Draws depend on the
    chunking, so equal seeds give equal samples only with equal `row_chunk` (the default is a
    function of V alone). `temperature` may be a 0-dim float32 tensor on the device: the reference
    divides by such a tensor, and a tensor keeps the step free of host values (graph capture).
    """
    b, c, h = hidden.shape
    v = embed.shape[0]
    rows = hidden.reshape(b * c, h)  # [N, H]
    n = rows.shape[0]
    step = row_chunk if row_chunk is not None else auto_row_chunk(v)
    if step < 1:
        raise ValueError(f"row_chunk must be >= 1, got {step}")
    scale = torch.as_tensor(embed_scale, device=embed.device).to(embed.dtype)  # 0-dim, like the reference

    sample = torch.empty(n, dtype=torch.long, device=hidden.device)  # [N]
    argmax = torch.empty(n, dtype=torch.long, device=hidden.device)  # [N]
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
    soft = torch.empty(n, h, dtype=embed.dtype, device=hidden.device) if want_soft else None  # [N, H]

    for lo in range(0, n, step):
        hi = min(n, lo + step)
        # float() copies unless the model runs in fp32; then F.linear's output is ours to modify anyway.
        logits = F.linear(rows[lo:hi], embed).float()  # [r, V]
        if softcap:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        logits = logits.div_(temperature)  # L, the processed logits
        argmax[lo:hi] = logits.argmax(dim=-1)

        # Entropy as torch.distributions.Categorical computes it (what the reference's accept and
        # stop rules use): normalised log-probs, then softmax of those.
        logp = logits - logits.logsumexp(dim=-1, keepdim=True)  # [r, V]
        p = torch.softmax(logp, dim=-1)  # [r, V]
        entropy[lo:hi] = -(p.mul_(logp)).sum(dim=-1)
        del logp, p

        # Gumbel-max: argmax(L - log E), E ~ Exp(1), is an exact draw from softmax(L). The clamp
        # only guards against E == 0, which would make an arbitrary token win outright.
        noise = torch.empty_like(logits).exponential_(generator=generator)  # [r, V]
        noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_().add_(logits)
        sample[lo:hi] = noise.argmax(dim=-1)
        del noise

        if soft is not None:
            stored = logits.to(embed.dtype)  # [r, V] what the reference keeps between steps
            probs = torch.softmax(stored, dim=-1, dtype=torch.float32).to(embed.dtype)  # [r, V]
            soft[lo:hi] = torch.matmul(probs, embed) * scale  # [r, H]
            del stored, probs
        del logits

    return VocabPassOut(
        sample=sample.view(b, c),
        argmax=argmax.view(b, c),
        entropy=entropy.view(b, c),
        soft=None if soft is None else soft.view(b, c, h),
    )
