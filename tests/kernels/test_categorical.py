"""The CPU pass's draw (kernels/categorical.py) by its fast paths against its torch ops, bit for bit: the inverse-CDF
searches as C calls (kernels/sampler_native.py) and the chosen groups' logits by one GEMM per distinct group (the
block read in place) against the gather of every row's block."""

from __future__ import annotations

import pytest
import torch

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
