"""The C bf16 GEMM (kernels/gemm_bf16.py) against float64 products of the same bf16 inputs, within the bound its
arithmetic allows (`_bound`), for odd shapes (N not a multiple of 16, odd K) and 1 to 30 rows; batch-, block- and
thread-invariant bits; the grouped call equal to its segments one by one, empty experts included; NaN kept to its
row; the routed experts against the reference within bf16 tolerance; the modules a bf16 session swaps in, and the
oneDNN experts (the reference's bits) with the kernel switched off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import gemm_bf16, moe_cpu, reference_ops
from dgcli.model.gemma import Experts
from dgcli.model.packed import NativeExperts, PackedExperts, pack_for_cpu

pytestmark = pytest.mark.skipif(not gemm_bf16.available(), reason="no AVX512-BF16 C compiler target here")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x·w| elementwise, for y = bf16(s), s the fp32 sum of K exact products (bf16 x bf16 fits fp32):
    K additions each rounded to nearest (u = 2^-24) give |s - x·w| <= e = K 2^-24 Σ|x||w|; rounding s to bf16
    (u = 2^-8) adds 2^-8 |s| <= 2^-8 (|x·w| + e). Flushed denormals (vdpbf16ps and vcvtneps2bf16 treat them as 0)
    cost under 2^-126 per step: the absolute term."""
    exact = x.double() @ w.double().T
    e = x.shape[-1] * 2.0**-24 * (x.abs().double() @ w.abs().double().T)
    return 2.0**-8 * exact.abs() + (1 + 2.0**-8) * e + (x.shape[-1] + 2) * 2.0**-126


def _randn(*shape, g):
    return torch.randn(*shape, generator=g).bfloat16()


@pytest.mark.parametrize("k", [1, 7, 32, 160, 161])
@pytest.mark.parametrize("n", [8, 16, 40, 330])
def test_linear_is_the_product(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = _randn(n, k, g=g)
    p = gemm_bf16.pack(w)
    assert p.shape == (-(-n // 16), -(-k // 2), 16, 2) and torch.equal(gemm_bf16.unpack(p, n, k), w)
    for m in (1, 2, 5, 11, 12, 13, 24, 30):
        x = _randn(m, k, g=g)
        y = gemm_bf16.linear(x, p, n)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        exact = x.double() @ w.double().T
        assert ((y.double() - exact).abs() <= _bound(x, w)).all()
        # and F.linear's bf16 output within two such roundings of it
        assert ((y.double() - F.linear(x, w).double()).abs() <= 2 * _bound(x, w)).all()


def test_bits_do_not_depend_on_the_batch_the_block_or_threads():
    g = torch.Generator().manual_seed(1)
    w, x = _randn(330, 160, g=g), _randn(40, 160, g=g)
    p = gemm_bf16.pack(w)
    whole = gemm_bf16.linear(x, p, 330)
    for r in (0, 7, 8, 39):  # first, last and next-block rows (blocks of 8 here), alone
        assert torch.equal(gemm_bf16.linear(x[r:r + 1], p, 330), whole[r:r + 1])
    assert torch.equal(gemm_bf16.linear(x[7:30], p, 330), whole[7:30])
    big = _randn(300, 160, g=g)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm_bf16.linear(big, p, 330)
        torch.set_num_threads(2)
        assert torch.equal(gemm_bf16.linear(big, p, 330), one)  # 300x330x160 is split over threads
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one[:40], gemm_bf16.linear(big[:40], p, 330))


def test_grouped_is_its_segments():
    g = torch.Generator().manual_seed(3)
    e, n, k = 5, 40, 24
    w = _randn(e, n, k, g=g)
    p = gemm_bf16.pack(w)
    x = _randn(9, k, g=g)
    rows = torch.tensor([4, 0, 8, 8, 1, 2, 3, 5, 6, 7, 1, 0], dtype=torch.int64)
    ends = torch.tensor([3, 3, 7, 12, 12], dtype=torch.int64)  # experts 1 and 4 get nothing
    y = gemm_bf16.grouped(x, rows, p, ends, n)
    lo = 0
    for j, hi in enumerate(ends.tolist()):
        assert torch.equal(y[lo:hi], gemm_bf16.linear(x[rows[lo:hi]], p[j], n))
        lo = hi
    assert torch.equal(gemm_bf16.grouped(x[rows], None, p, ends, n), y)  # without row indices: the rows in order
    s = torch.rand(12, 1, generator=g)  # rows weighted as they are stored: torch's mixed-dtype mul_'s bits
    assert torch.equal(gemm_bf16.grouped(x, rows, p, ends, n, s), y.clone().mul_(s))
    assert gemm_bf16.grouped(x, rows, p, ends, n, s[:5]) is None
    assert gemm_bf16.grouped(x, rows[:0], p, torch.zeros(e, dtype=torch.int64), n).shape == (0, n)


def test_nan_stays_in_its_row():
    g = torch.Generator().manual_seed(6)
    w, x = _randn(40, 64, g=g), _randn(5, 64, g=g)
    x[2, 17] = float("nan")
    y = gemm_bf16.linear(x, gemm_bf16.pack(w), 40)
    assert y[2].isnan().all() and not y[[0, 1, 3, 4]].isnan().any()


def test_what_it_leaves_to_torch(monkeypatch):
    """Arguments that do not fit the packed weight, or the kernel switched off, get None, never a wild read."""
    p, x = gemm_bf16.pack(_randn(2, 40, 24, g=torch.Generator())), torch.randn(5, 24).bfloat16()
    ends = torch.tensor([2, 5])
    assert gemm_bf16.linear(x.float(), p[0], 40) is None  # another dtype
    assert gemm_bf16.linear(x[:, :22], p[0], 40) is None  # K differs
    assert gemm_bf16.linear(x, p[0], 49) is None  # more columns than packed (3 panels)
    assert gemm_bf16.grouped(x, None, p, ends.int(), 40) is None  # int32 ends
    assert gemm_bf16.grouped(x, None, p, ends[:1], 40) is None  # one end for two experts
    monkeypatch.setenv("DGEMMA_GEMM_NATIVE", "0")
    assert gemm_bf16.linear(x, p[0], 40) is None
    assert not gemm_bf16.agrees(64, 48, 1)  # off: no agreement, and none remembered for later
    monkeypatch.delenv("DGEMMA_GEMM_NATIVE")
    assert gemm_bf16.agrees(64, 48, 1) == gemm_bf16._agrees(64, 48, 1)


def test_experts_against_the_reference():
    """Only the GEMMs differ from the reference (activation, weighting and sums are its own): within a few bf16
    roundings of the output's scale; each token alone gets the same bits."""
    g = torch.Generator().manual_seed(4)
    e, h, i, k, t = 8, 64, 48, 2, 21
    gu, dn = (torch.randn(e, 2 * i, h, generator=g) / 8).bfloat16(), (torch.randn(e, h, i, generator=g) / 7).bfloat16()
    x = _randn(t, h, g=g)
    w, idx = torch.randn(t, e, generator=g).softmax(-1).topk(k)
    pg, pd = gemm_bf16.pack(gu), gemm_bf16.pack(dn)
    with torch.inference_mode():
        got = moe_cpu.experts_native(x, w, idx, pg, pd, i, gemm_bf16)
        ref = reference_ops.experts_reference(x, w, idx, gu, dn)
        assert torch.equal(NativeExperts(pg, pd, h, i, gemm_bf16)(x, w, idx), got)
        alone = moe_cpu.experts_native(x[5:6], w[5:6], idx[5:6], pg, pd, i, gemm_bf16)
        assert moe_cpu.experts_native(x[:0], w[:0], idx[:0], pg, pd, i, gemm_bf16).shape == (0, h)
    assert got.dtype == torch.bfloat16 and torch.equal(alone, got[5:6])
    # one bf16 rounding of gate_up moves the activation by ~2^-8 relative, which the down GEMM carries through
    err = (got.float() - ref.float()).abs()
    assert err.max() <= 2.0**-5 * ref.float().abs().max() and err.mean() <= 2.0**-8 * ref.float().abs().mean()


@pytest.mark.parametrize("e, h, i, k", [(12, 1024, 512, 4), (4, 2816, 704, 2)])
def test_experts_have_the_references_bits_where_the_gemm_agrees(e, h, i, k):
    """The 200 M benchmark config's experts and the released config's shapes (H 1024 / 2816, I 512 / 704: K split in
    oneDNN's chunks), 64 tokens, expert 0 with one row: every output the reference's (its per-expert F.linear
    loop), where `agrees` holds for both shapes."""
    t = 64
    threads = torch.get_num_threads()
    if not (gemm_bf16.agrees(2 * i, h, threads) and gemm_bf16.agrees(h, i, threads)):
        pytest.skip("oneDNN sums in another order on this CPU: sessions keep oneDNN's experts")
    g = torch.Generator().manual_seed(5)
    gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    dn = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    x = _randn(t, h, g=g)
    w = torch.randn(t, k, generator=g).softmax(-1)
    idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] + 1 for _ in range(t)])  # experts 1..e-1
    idx[0] = torch.arange(k)  # expert 0: one row (oneDNN's one-row kernel)
    with torch.inference_mode():
        got = moe_cpu.experts_native(x, w, idx, gemm_bf16.pack(gu), gemm_bf16.pack(dn), i, gemm_bf16)
        assert torch.equal(got, reference_ops.experts_reference(x, w, idx, gu, dn))


def test_a_bf16_model_packs_its_experts_here_with_the_references_bits_where_they_agree(monkeypatch):
    """pack_for_cpu swaps bf16 experts for the C GEMM's panels (not both layouts) where `agrees` finds F.linear's bits
    for their shapes: then the experts give the plain model's bits; where it does not (an AMX CPU), oneDNN's
    experts, unless DGEMMA_BF16_FAST=1 asks for the C GEMM anyway (within a bf16 rounding); DGEMMA_GEMM_NATIVE=0:
    oneDNN's."""
    g = torch.Generator().manual_seed(7)
    e, h, i, t = 4, 64, 32, 9

    def model():
        cfg = SimpleNamespace(num_experts=e, moe_intermediate_size=i, hidden_size=h)
        m = torch.nn.Sequential(Experts(cfg)).bfloat16()
        with torch.no_grad():
            for prm in m.parameters():
                prm.copy_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(prm.numel())) / 8)
        return m

    def packed(**env):
        with monkeypatch.context() as mp:
            for var, value in env.items():
                mp.setenv(var, value)
            m = model()
            return m if pack_for_cpu(m) else None

    x, (w, idx) = _randn(t, h, g=g), torch.randn(t, e, generator=g).softmax(-1).topk(2)
    with torch.inference_mode():
        ref = model()[0](x, w, idx)
    threads = torch.get_num_threads()
    default = packed()
    if gemm_bf16.agrees(2 * i, h, threads) and gemm_bf16.agrees(h, i, threads):
        assert type(default[0]) is NativeExperts and default[0].gemm is gemm_bf16
    else:
        assert default is None or type(default[0]) is PackedExperts
    onednn = packed(DGEMMA_GEMM_NATIVE="0")
    assert onednn is None or type(onednn[0]) is PackedExperts
    for m in (default, onednn):
        if m is not None:
            with torch.inference_mode():
                assert torch.equal(m[0](x, w, idx), ref)  # the reference's bits, whichever GEMM runs
    monkeypatch.setattr(gemm_bf16, "agrees", lambda n, k, threads: False)  # as on a CPU whose oneDNN sums otherwise
    fallback = packed()
    assert fallback is None or type(fallback[0]) is PackedExperts
    fast = packed(DGEMMA_BF16_FAST="1")
    if torch.cpu._is_amx_tile_supported():  # oneDNN's AMX GEMM is the faster one there: asking changes nothing
        assert fast is None or type(fast[0]) is PackedExperts
        return
    assert type(fast[0]) is NativeExperts
    with torch.inference_mode():
        got = fast[0](x, w, idx)
    assert (got.float() - ref.float()).abs().max() <= 2.0**-5 * ref.float().abs().max()


@pytest.mark.parametrize("n, k", [(1024, 1024), (1024, 512), (1408, 2816), (2816, 704), (320, 160)])
def test_it_sums_as_onednn_does_here(n, k):
    """At the 200 M, released and bundled configs' expert shapes (gate_up [2I, H], down [H, I]), 1-40 and 85 rows:
    F.linear's bits, every output, where `agrees` says so (its probes are a few of these row counts); where it does
    not, no session takes this GEMM by default (the test above)."""
    if not gemm_bf16.agrees(n, k, torch.get_num_threads()):
        pytest.skip("oneDNN sums in another order on this CPU: sessions keep oneDNN's experts (tested above)")
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    p = gemm_bf16.pack(w)
    for m in [*[1] * 24, *range(2, 41), 85]:  # one row: oneDNN's other kernel (its own k chunks), 24 tries
        x = torch.randn(m, k, generator=g).bfloat16()
        assert torch.equal(gemm_bf16.linear(x, p, n), torch.nn.functional.linear(x, w)), m


def test_a_cpu_without_avx512_bf16_builds_a_library_that_says_so():
    """Elsewhere (AVX-512 without BF16, AVX2, other architectures) the source still builds, to a library whose
    gemm_ok() is 0: kept in the cache, so no process retries the compiler; the oneDNN experts run."""
    from dgcli.kernels import native

    lib = native.build("gemm_bf16_test_nobf16", gemm_bf16._SOURCE, gemm_bf16._SIGNATURE, flags=("-mno-avx512bf16",))
    assert lib is not None and lib.gemm_ok() == 0
    assert gemm_bf16._native().gemm_ok() == 1  # this machine's own build
