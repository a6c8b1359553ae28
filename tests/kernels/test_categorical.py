"""The CPU pass's draw (kernels/categorical.py) by its fast paths against its torch ops, bit for bit: the inverse-CDF
searches as C calls (kernels/sampler_native.py) and the chosen groups' logits by one GEMM per distinct group (the
block read in place) against the gather of every row's block. In bf16, the C call's logits against the fp32 block
product (one bf16 step) and the head's GEMM (its summation order), each row's own on any thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import categorical, sampler_native

needs_c = pytest.mark.skipif(sampler_native._native() is None, reason="no C compiler here")


def _inputs(seed: int, kind: int):
    g = torch.Generator().manual_seed(seed)
    n, groups, w = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 40), (1, 20), (1, 70)))
    gmax = torch.randn(n, groups, generator=g) * 20
    gsum = torch.rand(n, groups, generator=g) * w
    logits = torch.randn(n, w, generator=g) * 5
    if kind == 1:  # groups and columns without mass
        gsum[torch.rand(n, groups, generator=g) < 0.5] = 0
        logits[torch.rand(n, w, generator=g) < 0.5] = float("-inf")
    elif kind == 2:  # groups at -inf, a row without any mass
        gmax[torch.rand(n, groups, generator=g) < 0.3] = float("-inf")
        gsum[0] = 0
    elif kind == 3:  # NaN sums: both searches see the same bits
        gsum[torch.rand(n, groups, generator=g) < 0.1] = float("nan")
    u = torch.rand(n, dtype=torch.float64, generator=g)
    u[0] = 0.0
    u[-1] = 1 - 2**-53
    return gmax, gsum, u, w, logits


@needs_c
def test_the_c_searches_draw_the_torch_searches_bits(monkeypatch):
    picks = set()
    for seed in range(400):
        gmax, gsum, u, w, logits = _inputs(seed, seed % 4)

        def draw(rows, embed, group, width, softcap, temperature):  # as the CPU pass calls it: logits_fn None
            return logits + gmax.gather(1, group[:, None]) - 1.0
        monkeypatch.setattr(categorical, "group_logits", draw)
        fast = categorical.draw_from_groups(gmax, gsum, u, w, None, None, None, 1.0)
        with monkeypatch.context() as m:
            m.setenv("DGEMMA_SAMPLER_NATIVE", "0")
            slow = categorical.draw_from_groups(gmax, gsum, u, w, None, None, None, 1.0)
        assert torch.equal(fast, slow), seed
        picks.update(slow.tolist())
    assert len(picks) > 200  # draws all over the groups and columns, not a constant
    # a device kernel's draw (logits_fn given) keeps the torch ops
    calls = []
    monkeypatch.setattr(sampler_native, "locate_group", lambda *a: calls.append(a))
    categorical.draw_from_groups(gmax, gsum, u, w, None, None, None, 1.0, logits_fn=draw)
    assert not calls


@pytest.mark.parametrize("groups", [[3] * 16, [5, 1] * 8, list(range(16)), [2] * 15 + [7]])
@pytest.mark.parametrize("h", [24, 160])
def test_one_gemm_per_group_gives_the_gathers_bits(groups, h, monkeypatch):
    g = torch.Generator().manual_seed(h)
    embed = torch.randn(1024, h, generator=g)
    rows = torch.randn(len(groups), h, generator=g)
    group = torch.tensor(groups)
    temp = torch.rand(len(groups), 1, generator=g) + 0.5
    taken = []
    by_group = categorical._by_group
    monkeypatch.setattr(categorical, "_by_group", lambda *a: taken.append(by_group(*a)) or taken[-1])
    monkeypatch.setattr(categorical, "RUN_BYTES", 0)  # always one GEMM per group
    fast = categorical.group_logits(rows, embed, group, 64, 30.0, temp)
    monkeypatch.setattr(categorical, "RUN_BYTES", 2**60)  # always the gather
    slow = categorical.group_logits(rows, embed, group, 64, 30.0, temp)
    assert taken == [True, False]
    assert torch.equal(fast, slow)
    # and both are the rows' own logits (a group's 64 columns of the head)
    want = torch.stack([rows[i] @ embed[k * 64:(k + 1) * 64].T for i, k in enumerate(groups)])
    torch.testing.assert_close(slow, (30.0 * torch.tanh(want / 30.0)) / temp, rtol=1e-5, atol=1e-5)


def test_the_gather_stays_where_it_costs_less(monkeypatch):
    """Many distinct groups for few rows, and bf16 blocks (torch's bf16 bmm on a broadcast block is slower than the
    gather), keep the gather."""
    rows, embed = torch.randn(16, 160), torch.randn(1024, 160)
    out = torch.empty(16, 64)
    blocks = embed.view(16, 64, 160)
    assert not categorical._by_group(rows, blocks, torch.arange(16), out)  # 16 groups: the gather
    assert categorical._by_group(rows, blocks, torch.zeros(16, dtype=torch.long), out)  # 1 group: in place
    calls = []
    monkeypatch.setattr(categorical, "_by_group", lambda *a: calls.append(a))
    categorical.group_logits(rows, embed.bfloat16(), torch.zeros(16, dtype=torch.long), 64, None, 1.0)
    assert not calls


# ---- bf16: the chosen groups' logits by one C call (kernels/sampler_native.py), each block read in place ----------

def _bf16(seed: int, n: int, h: int, v: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g).bfloat16(), (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            torch.randint(0, v // 64, (n,), generator=g))


def _block_product(rows, embed, group, width):  # [N, W] fp32 products of the same bf16 inputs, rounded to bf16
    e = embed.view(-1, width, embed.shape[1])[group].float()  # [N, W, H]
    return torch.bmm(e, rows.float()[:, :, None])[:, :, 0].bfloat16().float()


@needs_c
@pytest.mark.parametrize("n, h, v, width", [(37, 1024, 4096, 64), (5, 160, 1024, 64), (9, 2048, 512, 32),
                                            (3, 64, 192, 96), (1, 96, 128, 16)])
def test_bf16_c_logits_are_the_block_product_within_a_bf16_step(n, h, v, width):
    rows, embed, _ = _bf16(h + width, n, h, v)
    group = torch.randint(0, v // width, (n,), generator=torch.Generator().manual_seed(n))
    group[0] = v // width - 1  # the last group
    if n > 2:
        group[2] = group[1]  # rows sharing a group
    got = sampler_native.group_logits_bf16(rows, embed, group, width)
    assert got is not None and got.dtype == torch.float32 and got.shape == (n, width)
    assert torch.equal(got, got.bfloat16().float())  # bf16 values
    want = _block_product(rows, embed, group, width)
    # one bf16 step (2^-7 relative at most) from the fp32 product rounded, plus fp32 summation noise near zero
    bound = torch.maximum(got.abs(), want.abs()) * 2**-7 + 1e-5
    assert ((got - want).abs() <= bound).all()
    # and through group_logits, softcap and temperature after as the torch path applies them
    temp = torch.rand(n, 1, generator=torch.Generator().manual_seed(1)) + 0.5
    out = categorical.group_logits(rows, embed, group, width, 30.0, temp)
    assert torch.equal(out, (30.0 * torch.tanh(got / 30.0)) / temp)


@needs_c
def test_bf16_c_logits_are_each_rows_own_and_thread_invariant():
    rows, embed, group = _bf16(3, 48, 256, 2048)
    group[5:20] = 7  # a run of rows on one block
    full = sampler_native.group_logits_bf16(rows, embed, group, 64)
    for lo, hi in ((0, 1), (5, 6), (11, 30), (47, 48)):  # a row's logits do not depend on the others
        assert torch.equal(sampler_native.group_logits_bf16(rows[lo:hi], embed, group[lo:hi], 64), full[lo:hi])
    before = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(sampler_native.group_logits_bf16(rows, embed, group, 64), full), t
    finally:
        torch.set_num_threads(before)


@needs_c
def test_bf16_c_logits_track_the_heads_gemm():
    """The tile statistics come from the head GEMM F.linear(rows, E_tile) (oneDNN): the C call sums in its order
    (k by bf16 pairs in chunks of 512 or 1024), bit for bit on the 2-core EPYC it was fitted on; elsewhere (another
    ISA, another oneDNN) a rare logit may sit one bf16 step off, as torch's own bmm does."""
    rows, embed, group = _bf16(5, 256, 1024, 4096)
    head = F.linear(rows, embed).float()  # [N, V]
    want = head.gather(1, group[:, None] * 64 + torch.arange(64))
    got = sampler_native.group_logits_bf16(rows, embed, group, 64)
    off = got != want
    assert off.float().mean() < 1e-3
    assert ((got - want).abs()[off] <= want.abs()[off] * 2**-7 + 1e-5).all()


@needs_c
def test_bf16_c_logits_decline_and_the_switch_keeps_the_gather(monkeypatch):
    rows, embed, group = _bf16(7, 6, 160, 1024)
    assert sampler_native.group_logits_bf16(rows[:, :150].contiguous(), embed[:, :150].contiguous(), group, 64) \
        is None  # H % 32
    assert sampler_native.group_logits_bf16(rows.float(), embed.float(), group, 64) is None  # fp32: its own path
    assert sampler_native.group_logits_bf16(rows, embed.t().contiguous().t(), group, 64) is None  # strided E
    assert sampler_native.group_logits_bf16(rows, embed[:1000], group % 15, 64) is None  # V % width
    assert sampler_native.group_logits_bf16(rows, embed, group + 16, 64) is None  # a group past V: C checks
    gather = torch.bmm(rows[:, None, :], embed.view(16, 64, 160)[group].transpose(1, 2))[:, 0].float()
    for var in ("DGEMMA_NATIVE", "DGEMMA_SAMPLER_NATIVE"):
        with monkeypatch.context() as m:
            m.setenv(var, "0")
            assert sampler_native.group_logits_bf16(rows, embed, group, 64) is None
            assert torch.equal(categorical.group_logits(rows, embed, group, 64, None, 1.0), gather)
