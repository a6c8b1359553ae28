"""The fused vocabulary pass: the CPU tiled path (kernels/vocab_pass_cpu.py) and the Triton kernels
(kernels/vocab_pass.py: compiled on a GPU, interpreted on CPU without one) against
kernels/reference.py::vocab_pass, plus seeded goodness-of-fit tests of their draws. Entropy near zero (what
the stop rule reads) is checked in absolute terms, on converged rows built for it."""

from __future__ import annotations

import math
from importlib.util import find_spec

import pytest
import torch

from dgcli.kernels.reference import vocab_pass
from dgcli.kernels.vocab_pass_cpu import auto_tile, vocab_pass_tiled

TRITON = find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed (Linux x86-64 only)")

# (dtype, entropy atol, entropy rtol, soft atol, soft rtol):
# fp32 — only summation order differs (online sums vs one softmax): measured <= 3e-6 nats; soft to 1e-5.
# bf16 — entropy measured <= 3e-6 too; the rtol above ENT_NEAR_ZERO allows a tile GEMM that rounds a logit
#   1 bf16 ulp away from the full GEMM (not seen on CPU, possible with tensor cores), which moves H about in
#   proportion to H. The soft embedding: the CPU tiled path runs the reference's softmax and GEMM on the same
#   bf16 values, bit-equal (checked with torch.equal below, not with these tolerances); the Triton path's
#   own softmax and fp32 GEMM order leave an entry a bf16 step off now and then (see
#   test_triton_soft_within_two_bf16_steps): these tolerances (3 bf16 steps, 2e-2 absolute near zero) are
#   the shared check's.
TOLS = [(torch.float32, 1e-5, 0.0, 1e-5, 1e-5), (torch.bfloat16, 1e-4, 1e-2, 2e-2, 3 * 2**-8)]
# Below ENT_NEAR_ZERO nats the entropy feeds the stop rule (canvas mean < confidence_threshold = 0.005),
# so it is checked in absolute terms, never relative: |kernel - reference| <= ENT_ATOL_NEAR_ZERO. 1e-4 is
# 50x under the threshold and ~80x over what both kernels reach on converged rows (<= 1.3e-6, fp32 and
# bf16: fp32 rounding of L - max), and it rejects entropy from bf16-rounded logits (off by 2e-4..3e-3).
ENT_NEAR_ZERO, ENT_ATOL_NEAR_ZERO = 0.05, 1e-4


def unif(hidden, seed):
    """One uniform per position [B, C] (what the sampler's counter stream hands a vocabulary pass)."""
    return torch.rand(hidden.shape[:2], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def make(b, c, h, v, dtype, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(v, h, generator=g) * 0.5).to(dtype)  # [V, H]
    hidden = (torch.randn(b, c, h, generator=g) * sharp).to(dtype)  # [B, C, H]
    return hidden, embed, torch.tensor(math.sqrt(h)).to(dtype)


def check_entropy(got, want, ent_atol, ent_rtol):
    """Absolute near zero entropy (see ENT_NEAR_ZERO), atol + rtol·H above it."""
    got = got.cpu()
    near = want < ENT_NEAR_ZERO
    tol = torch.where(near, min(ent_atol, ENT_ATOL_NEAR_ZERO), ent_atol + ent_rtol * want)
    err = (got - want).abs()
    bad = err > tol
    assert not bad.any(), (f"entropy off at {int(bad.sum())} positions: worst |err| {float(err.max()):.2e}; "
                           f"near zero {float(err[near].max()) if near.any() else 0.0:.2e} (tol {ENT_ATOL_NEAR_ZERO:g})")


def check(out, want, dtype, ent_atol, ent_rtol, soft_atol, soft_rtol, want_soft=True, logits=None):
    assert out.sample.shape == out.argmax.shape == out.entropy.shape == want.argmax.shape
    assert out.argmax.dtype == out.sample.dtype == torch.long and out.entropy.dtype == torch.float32
    if dtype == torch.float32:
        assert torch.equal(out.argmax.cpu(), want.argmax)
    else:  # a 1-ulp bf16 logit difference may swap near-ties: compare where the top-2 margin is clear
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.02 * top2[..., 0].abs() + 1e-3
        assert torch.equal(out.argmax.cpu()[clear], want.argmax[clear]) and clear.float().mean() > 0.5
    check_entropy(out.entropy, want.entropy, ent_atol, ent_rtol)
    assert (out.sample >= 0).all()
    if want_soft:
        assert out.soft.dtype == dtype and out.soft.shape == want.soft.shape
        torch.testing.assert_close(out.soft.cpu().float(), want.soft.float(), atol=soft_atol, rtol=soft_rtol)
    else:
        assert out.soft is None


def logits_of(hidden, embed, softcap=30.0, temperature=0.7):
    raw = torch.nn.functional.linear(hidden, embed).float()
    return (torch.tanh(raw / softcap) * softcap if softcap else raw) / temperature


def reference(hidden, embed, scale, softcap=30.0, temperature=0.7, want_soft=True):
    return vocab_pass(hidden, embed, softcap=softcap, temperature=temperature, embed_scale=scale,
                      uniform=unif(hidden, 1), want_soft=want_soft)


# ---- CPU tiled path ------------------------------------------------------------------------------------

# (B, C, H, V, tile): V not a multiple of the tile, a tile of 1 column (every column its own tile),
# a tile larger than V, tiles that are multiples of the 64-column argmax block, the automatic tile.
CPU_SHAPES = [(2, 5, 16, 37, 8), (1, 3, 8, 23, 1), (1, 4, 12, 50, 1000), (1, 6, 16, 300, 128), (1, 9, 16, 257, None)]


@pytest.mark.parametrize("dtype,ent_atol,ent_rtol,soft_atol,soft_rtol", TOLS)
@pytest.mark.parametrize("b,c,h,v,tile", CPU_SHAPES)
@pytest.mark.parametrize("softcap", [30.0, None])
def test_tiled_matches_reference(dtype, ent_atol, ent_rtol, soft_atol, soft_rtol, b, c, h, v, tile, softcap):
    hidden, embed, scale = make(b, c, h, v, dtype)
    out = vocab_pass_tiled(hidden, embed, softcap=softcap, temperature=torch.tensor(0.7), embed_scale=scale,
                           uniform=unif(hidden, 2), tile=tile)
    want = reference(hidden, embed, scale, softcap, torch.tensor(0.7))
    check(out, want, dtype, ent_atol, ent_rtol, soft_atol, soft_rtol, logits=logits_of(hidden, embed, softcap))
    assert (out.sample < v).all()
    if dtype == torch.bfloat16:
        assert torch.equal(out.soft, want.soft)


def transformers_soft(hidden, embed, scale, softcap, temperature):
    """The soft embedding as transformers builds it (generation: processed logits stored in the embedding
    dtype; modeling: softmax(dim=-1, dtype=float32).to(E.dtype) @ E · embed_scale), all at once."""
    stored = (logits_of(hidden, embed, softcap, temperature)).to(embed.dtype)  # [B, C, V]
    return torch.matmul(stored.softmax(dim=-1, dtype=torch.float32).to(embed.dtype), embed) * scale


# (B, C, H, V, tile, sharp): vocabularies of several default tiles and of odd tiles (the earlier online design
# rounded each tile's unnormalised probabilities: ~40 % of the entries one bf16 step off, more with more tiles),
# one row (a GEMV in both), a batch, peaked rows.
SOFT_SHAPES = [(1, 32, 64, 32768, None, 1.0), (2, 9, 32, 5000, 999, 1.0), (1, 1, 48, 3000, 256, 1.0),
               (1, 24, 64, 8192, 1024, 6.0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,c,h,v,tile,sharp", SOFT_SHAPES)
def test_tiled_soft_is_the_references_bit_for_bit(dtype, b, c, h, v, tile, sharp):
    """Low-precision soft embedding: the same bits as the reference pass and as transformers' own ops,
    whatever the tiling (the probabilities come from torch's softmax of whole rows, the GEMM is one
    [N, V]x[V, H] product); the step's other outputs are unchanged by it."""
    hidden, embed, scale = make(b, c, h, v, dtype, seed=4, sharp=sharp)
    kw = dict(softcap=30.0, temperature=torch.tensor(0.6), embed_scale=scale, uniform=unif(hidden, 3))
    out = vocab_pass_tiled(hidden, embed, tile=tile, **kw)
    assert out.soft.dtype == dtype
    assert torch.equal(out.soft, vocab_pass(hidden, embed, **kw).soft)
    assert torch.equal(out.soft, transformers_soft(hidden, embed, scale, 30.0, torch.tensor(0.6)))
    bare = vocab_pass_tiled(hidden, embed, tile=tile, want_soft=False, **kw)
    assert bare.soft is None and torch.equal(bare.sample, out.sample) and torch.equal(bare.entropy, out.entropy)


@pytest.mark.parametrize("rows,v,spread", [(64, 32768, 3.0), (8, 262144, 8.0), (33, 5000, 0.5), (7, 3, 50.0)])
def test_bf16_softmax_is_the_rounded_fp32_softmax(rows, v, spread):
    """The tiled pass runs torch's bf16 softmax on the rounded logits (no fp32 copy): on CPU it must give the
    bits of softmax(dtype=float32) rounded to bf16, the reference's (transformers') ops."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, v, generator=g) * spread).bfloat16()
    x[0, :2] = 40.0  # a peaked row with a tie
    assert torch.equal(torch.softmax(x, dim=-1), x.softmax(dim=-1, dtype=torch.float32).to(torch.bfloat16))


def test_tiled_without_soft_and_ties():
    hidden, embed, scale = make(1, 4, 8, 64, torch.float32)
    embed[40] = embed[3]  # exact duplicate rows: equal logits, the first index must win
    hidden[0, 0] = embed[3] * 4
    out = vocab_pass_tiled(hidden, embed, softcap=None, temperature=1.0, embed_scale=scale, uniform=unif(hidden, 0),
                           want_soft=False, tile=16)
    want = reference(hidden, embed, scale, None, 1.0, want_soft=False)
    check(out, want, torch.float32, 1e-5, 0, 0, 0, want_soft=False)
    assert out.argmax[0, 0] == 3


def test_tiled_rounds_logits_to_the_embedding_dtype_before_the_soft_softmax():
    """Sharp tempered logits: softmax(bf16(L)) and softmax(L) differ visibly; only the former may match."""
    hidden, embed, scale = make(1, 6, 16, 64, torch.bfloat16, seed=3, sharp=8.0)
    out = vocab_pass_tiled(hidden, embed, softcap=30.0, temperature=0.41, embed_scale=scale, uniform=unif(hidden, 0), tile=16)
    want = reference(hidden, embed, scale, 30.0, 0.41)
    assert torch.equal(out.soft, want.soft)
    raw = torch.tanh(torch.nn.functional.linear(hidden, embed).float() / 30.0) * 30.0 / 0.41
    unrounded = (torch.softmax(raw, -1).to(embed.dtype) @ embed) * scale  # fp32 L: the wrong semantics
    assert (unrounded.float() - want.soft.float()).abs().max() > 0.1  # measured 0.23: the rounding shows


def test_auto_tile_is_bounded():
    assert auto_tile(256, 262144) == 4096 and auto_tile(1, 37) == 37 and auto_tile(10**6, 10**6) == 256


def chi2_ok(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square of `samples` against `probs` and its 0.999 quantile (Wilson-Hilferty)."""
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    keep = probs * n >= 5  # pool cells too small for the chi-square approximation
    obs = torch.cat((counts[keep], counts[~keep].sum()[None]))
    exp = torch.cat((probs[keep] * n, (probs[~keep].sum() * n)[None])).double()
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    q = df * (1 - 2 / (9 * df) + 3.090 * math.sqrt(2 / (9 * df))) ** 3
    return stat, q


def gof_case(rows: int, v: int, h: int = 8):
    """`rows` identical positions: every draw comes from the same distribution softmax(L)."""
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(v, h, generator=g)  # [V, H]
    hidden = torch.randn(1, 1, h, generator=g).expand(1, rows, h).contiguous()  # [1, rows, H]
    L = torch.tanh(hidden[0, 0] @ embed.T / 30.0) * 30.0 / 0.8
    return hidden, embed, torch.softmax(L.double(), -1)


def test_tiled_draws_fit_the_distribution():
    hidden, embed, probs = gof_case(6000, 13)
    out = vocab_pass_tiled(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=1.0,
                           uniform=unif(hidden, 11), want_soft=False, tile=3)  # 5 tiles
    stat, q = chi2_ok(out.sample, probs)
    assert stat < q, (stat, q)
    again = vocab_pass_tiled(hidden, embed, softcap=30.0, temperature=0.8, embed_scale=1.0,
                             uniform=unif(hidden, 11), want_soft=False, tile=3)
    assert torch.equal(out.sample, again.sample)  # seeded: reproducible


def test_tiled_draws_detect_a_wrong_distribution():
    """The goodness-of-fit check can fail: draws at another temperature are rejected."""
    hidden, embed, probs = gof_case(6000, 13)
    out = vocab_pass_tiled(hidden, embed, softcap=30.0, temperature=0.5, embed_scale=1.0,
                           uniform=unif(hidden, 11), want_soft=False, tile=3)
    stat, q = chi2_ok(out.sample, probs)
    assert stat > q


@pytest.mark.slow
@pytest.mark.parametrize("dtype,ent_atol,ent_rtol,soft_atol,soft_rtol", TOLS)
def test_compiled_tiles_match_the_reference_and_the_eager_tiles(dtype, ent_atol, ent_rtol, soft_atol, soft_rtol):
    """`--compile` path: the tile math through torch.compile (one compile per dtype and tile shape; two
    tile widths here, V not a multiple of the tile). Same reference tolerances; against the eager tiles,
    equal argmax and samples (the same uniforms; only an fp32-rounding tie could move one), entropy to fp32
    rounding."""
    hidden, embed, scale = make(1, 9, 16, 300, dtype)
    kw = dict(softcap=30.0, temperature=torch.tensor(0.7), embed_scale=scale, tile=128)
    out = vocab_pass_tiled(hidden, embed, uniform=unif(hidden, 2), compile_tiles=True, **kw)
    check(out, reference(hidden, embed, scale, 30.0, torch.tensor(0.7)), dtype, ent_atol, ent_rtol, soft_atol, soft_rtol,
          logits=logits_of(hidden, embed))
    eager = vocab_pass_tiled(hidden, embed, uniform=unif(hidden, 2), **kw)
    assert torch.equal(out.argmax, eager.argmax)
    torch.testing.assert_close(out.entropy, eager.entropy, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.sample, eager.sample)
    again = vocab_pass_tiled(hidden, embed, uniform=unif(hidden, 2), compile_tiles=True, **kw)
    assert torch.equal(out.sample, again.sample)


# ---- Triton kernels (compiled on a GPU, interpreted on CPU) ----------------------------------------------

# (B, C, H, V, splits): C not a multiple of the 16-row block, V not a multiple of the 16-column tile,
# several splits (one shorter than the others), H not a multiple of the 16-wide K block.
TRITON_SHAPES = [(1, 7, 24, 37, 2), (2, 9, 16, 101, 3), (1, 17, 20, 50, 1)]


@needs_triton
@pytest.mark.parametrize("dtype,ent_atol,ent_rtol,soft_atol,soft_rtol", TOLS)
@pytest.mark.parametrize("b,c,h,v,splits", TRITON_SHAPES)
def test_triton_matches_reference(dtype, ent_atol, ent_rtol, soft_atol, soft_rtol, b, c, h, v, splits, triton_device):
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale = make(b, c, h, v, dtype)
    out = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), softcap=30.0, temperature=0.7,
                            embed_scale=scale, uniform=unif(hidden, 0), splits=splits,
                            block_m=16, block_n=16, block_k=16, row_chunk=4)  # several row chunks
    check(out, reference(hidden, embed, scale), dtype, ent_atol, ent_rtol, soft_atol, soft_rtol, logits=logits_of(hidden, embed))
    assert (out.sample < v).all()


@needs_triton
# Interpreted Triton: 3-8 s a case, so one shape in the fast run, the other two in the full run.
@pytest.mark.parametrize("c,h,v,sharp", [(32, 64, 4096, 1.0), pytest.param(32, 64, 4096, 4.0, marks=pytest.mark.slow),
                                         pytest.param(16, 32, 20000, 1.0, marks=pytest.mark.slow)])
def test_triton_soft_within_two_bf16_steps(c, h, v, sharp, triton_device):
    """The Triton soft embedding in bf16: normalised probabilities rounded once (exp(bf16(L) - bf16(max))
    divided by the row's sum), an fp32 GEMM over the whole vocabulary, one rounding: the reference's
    (transformers') computation in another summation order and with another exp. Not bit for bit: a
    probability whose fp32 value lies within the two softmaxes' fp32 difference of a bf16 rounding
    boundary rounds the other way (torch's CPU softmax is itself ~1e-5 relative off the exact row sum at
    large V), and the GEMMs' fp32 sums differ in their last bits. Bound: nearly every entry equal, the
    others one bf16 step off, two where the entry is small against its row (a cancelling sum); measured
    over 24 cases of these shapes: 12 of 33,792 entries off, at most 2 steps, at most 0.002 of the row's
    RMS. Checked: 2 steps (2^-6 of the magnitude) + 2^-12 of the row's RMS, <= 0.5 % of the entries."""
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale = make(1, c, h, v, torch.bfloat16, seed=0, sharp=sharp)
    kw = dict(softcap=30.0, temperature=0.7, embed_scale=scale, uniform=unif(hidden, 0))
    out = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), **kw).soft.cpu()
    want = vocab_pass(hidden, embed, **kw).soft
    assert out.dtype == torch.bfloat16 and torch.equal(want, transformers_soft(hidden, embed, scale, 30.0, 0.7))
    rms = want.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    assert ((out.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 2**-12 * rms).all()
    assert (out != want).float().mean() <= 0.005


@needs_triton
def test_triton_no_softcap_no_soft_and_ties(triton_device):
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale = make(1, 5, 16, 40, torch.float32)
    embed[35] = embed[2]
    hidden[0, 1] = embed[2] * 4
    out = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), softcap=None,
                            temperature=torch.tensor(1.3),
                            embed_scale=scale, uniform=unif(hidden, 0), want_soft=False, splits=3,
                            block_m=16, block_n=16, block_k=16)
    check(out, reference(hidden, embed, scale, None, 1.3, want_soft=False), torch.float32, 1e-5, 0, 0, 0, want_soft=False)
    assert out.argmax[0, 1] == 2


@needs_triton
def test_triton_draws_fit_the_distribution(triton_device):
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, probs = gof_case(2048, 13)
    out = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), softcap=30.0, temperature=0.8,
                            embed_scale=1.0,
                            uniform=unif(hidden, 11), want_soft=False, splits=1, block_m=64, block_n=16, block_k=16)
    stat, q = chi2_ok(out.sample.cpu(), probs)
    assert stat < q, (stat, q)
    wrong = torch.softmax(torch.log(probs) * 0.8 / 0.5, -1)  # the same logits at temperature 0.5
    assert chi2_ok(out.sample.cpu(), wrong)[0] > q


# ---- near-zero entropy (a converged canvas): what the stop rule reads --------------------------------------


def peaked(c, h, v, dtype, seed=0):
    """Canvas rows h_i = g_i·E[t_i] + noise with the gain g_i growing along the canvas, so one token
    dominates more and more: entropies from nats down to 1e-6..4e-3, several around the 0.005 threshold.
    Every value is a short dyadic fraction, so the head GEMM is exact in fp32 whatever its summation
    order: the kernels and the reference see identical (bf16) logits and only their entropy math differs."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randint(-8, 9, (v, h), generator=g) / 16  # [V, H]
    target = torch.randint(0, v, (c,), generator=g)  # [C]
    gain = 1.0 + torch.arange(c) / 8  # [C]
    hidden = embed[target] * gain[:, None] + torch.randint(-2, 3, (c, h), generator=g) / 64  # [C, H]
    return hidden[None].to(dtype), embed.to(dtype), torch.tensor(4.0).to(dtype)


def near_zero_case(dtype, softcap, temperature):
    hidden, embed, scale = peaked(48, 16, 101, dtype)
    assert torch.equal(torch.nn.functional.linear(hidden.double(), embed.double()).float(),
                       torch.nn.functional.linear(hidden.float(), embed.float())), "test design: exact GEMM"
    want = reference(hidden, embed, scale, softcap, temperature, want_soft=False).entropy
    near = want < ENT_NEAR_ZERO
    # the case must hold converged rows, several of them around the 0.005-nat stop threshold
    assert near.sum() >= 7 and ((want > 1e-3) & (want < 1e-2)).sum() >= 3, want
    return hidden, embed, scale, want


NEAR_ZERO = [(dtype, softcap, t) for dtype in (torch.float32, torch.bfloat16) for softcap in (30.0, None)
             for t in (0.7, 0.4)]  # 0.4: t_min, the temperature a converged block runs at


@pytest.mark.parametrize("dtype,softcap,temperature", NEAR_ZERO)
def test_tiled_entropy_is_exact_near_zero(dtype, softcap, temperature):
    hidden, embed, scale, want = near_zero_case(dtype, softcap, temperature)
    out = vocab_pass_tiled(hidden, embed, softcap=softcap, temperature=torch.tensor(temperature), embed_scale=scale,
                           uniform=unif(hidden, 2), want_soft=False, tile=16)
    check_entropy(out.entropy, want, ENT_ATOL_NEAR_ZERO, 0.0)


@needs_triton
@pytest.mark.parametrize("dtype,softcap,temperature", NEAR_ZERO)
def test_triton_entropy_is_exact_near_zero(dtype, softcap, temperature, triton_device):
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale, want = near_zero_case(dtype, softcap, temperature)
    out = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), softcap=softcap, temperature=temperature,
                            embed_scale=scale, uniform=unif(hidden, 0), want_soft=False, splits=3,
                            block_m=16, block_n=16, block_k=16)
    check_entropy(out.entropy, want, ENT_ATOL_NEAR_ZERO, 0.0)


def test_near_zero_tolerance_rejects_a_biased_entropy():
    """The check has power: entropy of softmax(bf16(L)) (logits rounded to bf16 before the statistics, a
    plausible kernel bias) fails it on the same converged rows."""
    hidden, embed, scale, want = near_zero_case(torch.bfloat16, 30.0, 0.4)
    biased = torch.distributions.Categorical(logits=logits_of(hidden, embed, 30.0, 0.4).bfloat16().float()).entropy()
    with pytest.raises(AssertionError, match="entropy off"):
        check_entropy(biased, want, ENT_ATOL_NEAR_ZERO, 0.0)


# ---- one draw whichever path runs ---------------------------------------------------------------------------

# Draws a path may make differently: those whose target u lies within this distance (in CDF units) of a
# boundary of the reference's float64 CDF. The paths' logits and sums agree to ~1e-6 relative (fp32 sums
# in another order). bf16 uses the same width: on CPU the tiled head GEMMs and the interpreter's tl.dot
# round each logit exactly as the full GEMM does (fp32 accumulation over the same K, then one rounding),
# so the bf16 logits agree bit for bit here. A GPU whose tensor-core GEMM rounds a logit one bf16 ulp
# away moves a boundary by ~2^-8 of the neighbouring probabilities; there the width must grow, say so.
TIE = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


def near_a_boundary(hidden, embed, u, softcap, temperature, tie):
    """bool [B, C]: u within `tie` of a boundary of the reference CDF (a numerical tie between paths)."""
    logits = torch.nn.functional.linear(hidden, embed).float()
    logits = torch.tanh(logits / softcap) * softcap / temperature
    cdf = logits.double().softmax(-1).cumsum(-1)  # [B, C, V]
    return ((cdf - u[..., None]).abs() < tie).any(-1)


# ~5 s each (the interpreted Triton kernels): bf16, the released checkpoints' dtype, in the fast run.
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_every_path_makes_the_same_draw_from_the_same_uniforms(dtype, triton_device):
    """Reference, CPU tiles (7 columns: a group per tile; 128, 192: 64-column groups; automatic: one tile) and
    the Triton kernels (several splits and tile widths) pick the same token from the same uniform,
    except for numerical ties, which must be rare for the check to mean anything."""
    b, c, h, v = 2, 80, 32, 500  # 160 draws over a vocabulary several groups and tiles wide
    hidden, embed, _ = make(b, c, h, v, dtype, seed=3, sharp=0.6)  # spread-out distributions: every draw counts
    u = unif(hidden, 4)
    kw = dict(softcap=30.0, temperature=0.9, embed_scale=1.0, uniform=u, want_soft=False)
    want = vocab_pass(hidden, embed, **kw).sample
    tie = near_a_boundary(hidden, embed, u, 30.0, 0.9, TIE[dtype])
    assert int(tie.sum()) <= 0.02 * b * c, "too many ties: the comparison would say little"
    probs = torch.nn.functional.linear(hidden, embed).float().div(0.9).softmax(-1)
    assert float(probs.max(-1).values.mean()) < 0.5, "distributions must be spread for the draw to matter"
    paths = {f"tiled T={t}": vocab_pass_tiled(hidden, embed, tile=t, **kw).sample for t in (7, 128, 192, None)}
    if TRITON:
        from dgcli.kernels.vocab_pass import vocab_pass_triton

        for bn, splits in ((16, 3), (64, 2), (32, 1)):
            got = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), splits=splits, block_m=16,
                                    block_n=bn, block_k=16, **kw).sample.cpu()
            paths[f"triton N={bn} splits={splits}"] = got
    for name, got in paths.items():
        differ = (got != want) & ~tie
        assert not differ.any(), f"{name}: {int(differ.sum())} draws differ from the reference's away from ties"


def test_one_temperature_per_batch_row_equals_separate_passes(triton_device):
    """Rows of a batch at different steps of their blocks carry their own temperature ([B] tensor): each
    row's outputs equal a pass of that row alone at its temperature, on every path."""
    hidden, embed, scale = make(3, 6, 16, 90, torch.float32, seed=5)
    temps = torch.tensor([0.8, 0.45, 1.3])
    u = unif(hidden, 3)
    paths = [lambda **k: vocab_pass(**k), lambda **k: vocab_pass_tiled(tile=32, **k)]
    if TRITON:
        from dgcli.kernels.vocab_pass import vocab_pass_triton

        def on_device(hidden, embed, **k):
            out = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), splits=2, block_m=16,
                                    block_n=16, block_k=16, **k)
            return type(out)(**{f: None if t is None else t.cpu() for f, t in vars(out).items()})

        paths.append(on_device)
    for fn in paths:
        out = fn(hidden=hidden, embed=embed, softcap=30.0, temperature=temps, embed_scale=scale, uniform=u)
        for b in range(3):
            one = fn(hidden=hidden[b:b + 1], embed=embed, softcap=30.0, temperature=float(temps[b]),
                     embed_scale=scale, uniform=u[b:b + 1])
            assert torch.equal(out.sample[b], one.sample[0]) and torch.equal(out.argmax[b], one.argmax[0])
            torch.testing.assert_close(out.entropy[b], one.entropy[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(out.soft[b], one.soft[0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out.entropy[0], out.entropy[1])  # the temperatures did differ per row


@needs_triton
def test_triton_rows_do_not_depend_on_their_batch_mates(triton_device):
    """The default vocabulary split counts are constants (not functions of the row count or the device), so a
    row's outputs are the same bits alone and inside a larger batch (batch invariance on CUDA too)."""
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale = make(1, 80, 16, 300, torch.float32, seed=6)
    u = unif(hidden, 2)
    kw = dict(softcap=30.0, temperature=0.9, embed_scale=scale, block_m=16, block_n=16, block_k=16)
    full = vocab_pass_triton(hidden.to(triton_device), embed.to(triton_device), uniform=u, **kw)
    part = vocab_pass_triton(hidden[:, :9].to(triton_device), embed.to(triton_device), uniform=u[:, :9], **kw)
    assert torch.equal(full.entropy[:, :9].cpu(), part.entropy.cpu())
    assert torch.equal(full.sample[:, :9].cpu(), part.sample.cpu())
    assert torch.equal(full.soft[:, :9].cpu(), part.soft.cpu())


def test_triton_a_row_alone_and_in_a_batch_of_8(triton_device):
    """Eight canvases, each at its own temperature, in one pass (in row chunks, as a large batch runs) and
    each alone: the same draws, argmax, entropy and soft embedding, bit for bit. The default tiles (on CUDA
    the autotuned soft kernel, whose configuration may differ between 16 and 128 rows)."""
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale = make(8, 16, 32, 300, torch.bfloat16, seed=8, sharp=0.6)
    temps = torch.linspace(0.5, 1.2, 8)
    u = unif(hidden, 5)
    dev = lambda t: t.to(triton_device)  # noqa: E731
    kw = dict(softcap=30.0, embed_scale=scale)
    batch = vocab_pass_triton(dev(hidden), dev(embed), temperature=dev(temps), uniform=u, row_chunk=48, **kw)
    for b in range(8):
        one = vocab_pass_triton(dev(hidden[b:b + 1]), dev(embed), temperature=dev(temps[b:b + 1]), uniform=u[b:b + 1],
                                **kw)
        for field in ("sample", "argmax", "entropy", "soft"):
            assert torch.equal(getattr(batch, field)[b].cpu(), getattr(one, field)[0].cpu()), (b, field)
    assert len(set(batch.sample.flatten().tolist())) > 40  # spread-out draws: the comparison says something


@pytest.mark.slow
def test_triton_at_the_real_hidden_size():
    """H = 2816 (the released config's hidden size; V cut to 1,000 for the interpreter), bf16, default tiles:
    against the reference within the shared tolerances (H = 2816 sums 44 K blocks per logit)."""
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    hidden, embed, scale = make(1, 16, 2816, 1000, torch.bfloat16, seed=9, sharp=0.05)
    out = vocab_pass_triton(hidden, embed, softcap=30.0, temperature=0.7, embed_scale=scale, uniform=unif(hidden, 0))
    check(out, reference(hidden, embed, scale), torch.bfloat16, *TOLS[1][1:], logits=logits_of(hidden, embed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_canvas_gets_the_same_bits_in_a_large_batch_as_alone(dtype):
    """50 canvases of 6 rows (300 rows: more than one chunk of whole canvases goes through the tiles at a time):
    every output of every canvas, bit for bit, is what the canvas gets alone (its temperature and uniforms)."""
    g = torch.Generator().manual_seed(3)
    b, c, h, v = 50, 6, 16, 700
    hidden = torch.randn(b, c, h, generator=g).to(dtype)
    embed = torch.randn(v, h, generator=g).to(dtype)
    temp, uniform = torch.rand(b, generator=g) + 0.5, torch.rand(b, c, generator=g, dtype=torch.float64)
    kw = dict(softcap=30.0, embed_scale=torch.tensor(4.0), want_soft=True)
    whole = vocab_pass_tiled(hidden, embed, temperature=temp, uniform=uniform, **kw)
    for i in (0, 41, 42, 49):
        alone = vocab_pass_tiled(hidden[i:i + 1], embed, temperature=temp[i:i + 1], uniform=uniform[i:i + 1], **kw)
        for f in ("sample", "argmax", "entropy", "soft"):
            assert torch.equal(getattr(whole, f)[i:i + 1], getattr(alone, f)), (i, f)


@pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed (Linux x86-64 only)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_gemm_is_a_plain_batch_invariant_gemm(dtype, triton_device):
    """The soft embedding's GEMM takes the probabilities as they are (computed once per logit, not once per output
    block): p·E in fp32 within fp32 rounding, and a row's bits the same alone as in a batch."""
    from dgcli.kernels.vocab_pass import soft_gemm

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, 300, generator=g), -1).to(dtype).to(triton_device)
    embed = torch.randn(300, 40, generator=g).to(dtype).to(triton_device)
    got = soft_gemm(p, embed)
    assert got.dtype == torch.float32 and got.shape == (5, 40)
    torch.testing.assert_close(got, p.float() @ embed.float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(soft_gemm(p[2:3], embed), got[2:3])
