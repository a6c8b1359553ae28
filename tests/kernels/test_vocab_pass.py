"""kernels/reference.vocab_pass against a naive full-materialisation computation written from the spec
(§5.3 self-conditioning, §5.8 head + softcap, §7.2 temperature / sample / entropy)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels.reference import CHUNK_BYTES, auto_row_chunk, vocab_pass


def unif(hidden, seed):
    """One uniform per position [B, C] (what the sampler's counter stream hands a vocabulary pass)."""
    return torch.rand(hidden.shape[:2], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def naive(hidden, embed, *, softcap, temperature, embed_scale):
    """Everything at once, [B, C, V] float32 included, the way transformers computes it."""
    raw = F.linear(hidden, embed).float()  # [B, C, V]
    if softcap:
        raw = torch.tanh(raw / softcap) * softcap
    L = raw / temperature  # [B, C, V]
    entropy = torch.distributions.Categorical(logits=L).entropy()  # [B, C], the reference's entropy
    probs = L.to(embed.dtype).softmax(dim=-1, dtype=torch.float32).to(embed.dtype)  # [B, C, V]
    soft = torch.matmul(probs, embed) * torch.as_tensor(embed_scale).to(embed.dtype)  # [B, C, H]
    return L, entropy, soft


def make(b, c, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(v, h, generator=g) * 0.5).to(dtype)  # [V, H]
    hidden = torch.randn(b, c, h, generator=g).to(dtype)  # [B, C, H]
    return hidden, embed, torch.tensor(math.sqrt(h)).to(dtype)


# (B, C, H, V, row_chunk): C*B not a multiple of the chunk, V not a power of two, a chunk of 1 row,
# a chunk larger than all rows, the automatic chunk.
SHAPES = [(2, 5, 16, 37, 3), (1, 7, 8, 101, 1), (3, 4, 12, 50, 1000), (1, 9, 16, 257, None)]


@pytest.mark.parametrize("b,c,h,v,chunk", SHAPES)
@pytest.mark.parametrize("softcap", [30.0, None])
def test_matches_naive_fp32(b, c, h, v, chunk, softcap):
    hidden, embed, scale = make(b, c, h, v, torch.float32)
    out = vocab_pass(hidden, embed, softcap=softcap, temperature=0.7, embed_scale=scale,
                     uniform=unif(hidden, 1), row_chunk=chunk)
    L, entropy, soft = naive(hidden, embed, softcap=softcap, temperature=0.7, embed_scale=scale)
    assert out.argmax.shape == out.sample.shape == out.entropy.shape == (b, c)
    assert out.argmax.dtype == out.sample.dtype == torch.long and out.entropy.dtype == torch.float32
    assert torch.equal(out.argmax, L.argmax(-1))
    # fp32 throughout; only summation order may differ between the chunked and the full matmul.
    torch.testing.assert_close(out.entropy, entropy, rtol=1e-5, atol=1e-6)
    assert out.soft.shape == (b, c, h) and out.soft.dtype == torch.float32
    torch.testing.assert_close(out.soft, soft, rtol=1e-5, atol=1e-6)
    assert ((out.sample >= 0) & (out.sample < v)).all()


@pytest.mark.parametrize("b,c,h,v,chunk", SHAPES)
def test_matches_naive_bf16(b, c, h, v, chunk):
    hidden, embed, scale = make(b, c, h, v, torch.bfloat16)
    out = vocab_pass(hidden, embed, softcap=30.0, temperature=0.45, embed_scale=scale,
                     uniform=unif(hidden, 1), row_chunk=chunk)
    L, entropy, soft = naive(hidden, embed, softcap=30.0, temperature=0.45, embed_scale=scale)
    # A bf16 GEMM over a subset of rows may round a logit differently (1 bf16 ulp ~ 0.4 %) than over
    # all rows, so argmax is only required to agree where the top-2 margin exceeds that.
    top2 = L.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.02 * top2[..., 0].abs() + 1e-3
    assert torch.equal(out.argmax[clear], L.argmax(-1)[clear])
    # Entropy: equal here (the same formula; the chunked bf16 GEMM rounded like the full one). The rtol
    # allows a logit 1 bf16 ulp off, which moves H about in proportion to H; near zero the stop rule
    # (mean < 0.005 nats) reads H absolutely, so there only 1e-4 nats.
    near = entropy < 0.05
    tol = torch.where(near, 1e-4, 1e-4 + 1e-2 * entropy)
    assert ((out.entropy - entropy).abs() <= tol).all(), (out.entropy - entropy).abs().max()
    assert out.soft.dtype == torch.bfloat16
    # The soft embedding is a bf16 matmul of bf16 probabilities, times 53-ish: 2 bf16 ulps.
    torch.testing.assert_close(out.soft.float(), soft.float(), rtol=2 * 2**-8, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,temperature", [(30.0, 0.4), (None, 0.7)])
def test_entropy_near_zero_matches_fp64(dtype, softcap, temperature):
    """Converged rows (one token dominating, entropies down to ~1e-6 nats, several near the 0.005 stop
    threshold): the reference's entropy against the fp64 entropy of the same logits, absolutely. Short
    dyadic inputs make the head GEMM exact, so both see the same logits. Measured <= 1e-6 (fp32 rounding
    of L - logsumexp(L)); 1e-5 leaves 10x and is 500x under the threshold."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randint(-8, 9, (101, 16), generator=g) / 16  # [V, H]
    gain = 1.0 + torch.arange(48) / 8  # [C] growing: ever sharper rows
    hidden = embed[torch.randint(0, 101, (48,), generator=g)] * gain[:, None]
    hidden = (hidden + torch.randint(-2, 3, (48, 16), generator=g) / 64)[None].to(dtype)  # [1, C, H]
    embed = embed.to(dtype)
    out = vocab_pass(hidden, embed, softcap=softcap, temperature=temperature, embed_scale=1.0, uniform=unif(hidden, 0),
                     want_soft=False, row_chunk=5)
    raw = F.linear(hidden.double(), embed.double()).to(dtype).double()  # the exact sum, in the model dtype
    assert torch.equal(raw, F.linear(hidden, embed).double()), "test design: exact GEMM"
    if softcap:
        raw = torch.tanh(raw / softcap) * softcap
    want = torch.distributions.Categorical(logits=raw / temperature).entropy()  # fp64
    near = want < 0.05
    assert near.sum() >= 7 and ((want > 1e-3) & (want < 1e-2)).sum() >= 3, want
    err = (out.entropy.double() - want).abs()
    assert err[near].max() <= 1e-5 and err.max() <= 1e-5, err.max()


def test_soft_semantics_round_logits_to_embedding_dtype():
    """The soft embedding must come from L stored in the embedding dtype (bf16), not from fp32 L:
    large tempered logits make the two visibly different, and only the bf16 one may match."""
    hidden, embed, scale = make(1, 6, 16, 64, torch.bfloat16, seed=3)
    hidden = hidden * 8  # sharp logits: bf16 rounding of L changes softmax noticeably
    out = vocab_pass(hidden, embed, softcap=30.0, temperature=0.41, embed_scale=scale, uniform=unif(hidden, 0), row_chunk=2)
    L, _, soft = naive(hidden, embed, softcap=30.0, temperature=0.41, embed_scale=scale)
    fp32_soft = torch.matmul(L.softmax(-1).to(embed.dtype), embed) * scale
    err_ref = (out.soft.float() - soft.float()).abs().max()
    err_fp32 = (out.soft.float() - fp32_soft.float()).abs().max()
    assert err_ref < err_fp32


def test_want_soft_false_and_tensor_temperature():
    hidden, embed, scale = make(2, 3, 8, 40, torch.float32)
    a = vocab_pass(hidden, embed, softcap=30.0, temperature=0.6, embed_scale=scale,
                   uniform=unif(hidden, 5), want_soft=False)
    b = vocab_pass(hidden, embed, softcap=30.0, temperature=torch.tensor(0.6), embed_scale=scale,
                   uniform=unif(hidden, 5), want_soft=True)
    assert a.soft is None and b.soft is not None
    assert torch.equal(a.sample, b.sample) and torch.equal(a.entropy, b.entropy)


def test_sample_is_the_inverse_cdf_at_the_given_uniforms():
    """The sample is the first j with cdf_j > u (cdf of softmax(L) in float64), whatever the chunking;
    other uniforms give other samples."""
    hidden, embed, scale = make(2, 6, 8, 33, torch.float32)
    u = unif(hidden, 7)
    L, _, _ = naive(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=scale)
    cdf = L.double().softmax(-1).cumsum(-1)  # [B, C, V]
    want = (cdf <= u[..., None]).sum(-1)  # [B, C] the first index whose cdf exceeds u
    for chunk in (1, 5, 12):
        out = vocab_pass(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=scale, uniform=u, row_chunk=chunk)
        assert torch.equal(out.sample, want)
    other = vocab_pass(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=scale, uniform=unif(hidden, 8))
    assert not torch.equal(out.sample, other.sample)
    # u = 0 draws the first token with mass; u just below 1 the last one (never past the vocabulary).
    edge = vocab_pass(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=scale,
                      uniform=torch.full((2, 6), 1 - 2**-53, dtype=torch.float64))
    assert torch.equal(edge.sample, torch.full((2, 6), 32))
    first = vocab_pass(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=scale,
                       uniform=torch.zeros(2, 6, dtype=torch.float64))
    assert torch.equal(first.sample, torch.zeros(2, 6, dtype=torch.long))


def chi2_p_value(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return stat.item(), torch.special.gammaincc(df, stat / 2).item()


@pytest.mark.parametrize("temperature", [0.8, 2.0])
def test_sample_frequencies_fit_softmax(temperature):
    """Chi-square goodness of fit of 30,000 draws (one row repeated, chunks of 777 rows) against
    softmax(L), df = 10. Fixed seeds, so the outcome is fixed; we require p > 1e-4. Observed:
    chi2 = 5.68, p = 0.84 (T=0.8) and chi2 = 9.95, p = 0.45 (T=2.0). The same draws must *reject*
    softmax at a temperature 10 % off (observed p < 1e-7), which shows the test has power."""
    v, h, n = 11, 6, 30_000
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(v, h, generator=g) * 0.4  # [V, H]; small, so every cell expects > 5 draws
    row = torch.randn(h, generator=g)  # [H]
    hidden = row.expand(1, n, h).contiguous()  # [1, N, H]
    out = vocab_pass(hidden, embed, softcap=30.0, temperature=temperature, embed_scale=1.0,
                     uniform=unif(hidden, 0), want_soft=False, row_chunk=777)
    observed = torch.bincount(out.sample.view(-1), minlength=v).double()  # [V]

    def expected(t):
        L, _, _ = naive(hidden[:, :1], embed, softcap=30.0, temperature=t, embed_scale=1.0)
        return L[0, 0].double().softmax(-1) * n  # [V]

    assert expected(temperature).min() > 5, "test design: chi-square needs >= 5 expected draws per cell"
    stat, p_value = chi2_p_value(observed, expected(temperature))
    print(f"T={temperature}: chi2={stat:.2f}, df={v - 1}, p={p_value:.3g}")
    assert p_value > 1e-4, f"sample frequencies do not fit softmax(L): chi2={stat:.1f}, p={p_value:.2g}"
    for wrong in (temperature * 1.1, temperature / 1.1):
        assert chi2_p_value(observed, expected(wrong))[1] < 1e-4


def test_auto_row_chunk_bounds_the_fp32_chunk():
    assert auto_row_chunk(262_144) == 32  # the real vocabulary: 32 rows x 1 MiB
    for v in (37, 1000, 262_144, 10**9):
        rows = auto_row_chunk(v)
        assert rows >= 1
        assert rows == 1 or rows * v * 4 <= CHUNK_BYTES


def test_rejects_bad_chunk():
    hidden, embed, scale = make(1, 2, 4, 5, torch.float32)
    with pytest.raises(ValueError):
        vocab_pass(hidden, embed, softcap=None, temperature=1.0, embed_scale=scale, uniform=unif(hidden, 0), row_chunk=0)
