"""The CPU pass's draw (kernels/categorical.py): the chosen groups' logits by one GEMM per distinct group (the block
read in place) against the gather of every row's block, bit for bit; in bf16, the logits against the fp32 block
product (one bf16 step), each row's own."""

from __future__ import annotations

import pytest
import torch

from dgcli.kernels import categorical


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


# ---- bf16: the chosen groups' logits (the gather's bmm), within a bf16 step of the block product -------------

def _bf16(seed: int, n: int, h: int, v: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g).bfloat16(), (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            torch.randint(0, v // 64, (n,), generator=g))


def _block_product(rows, embed, group, width):  # [N, W] fp32 products of the same bf16 inputs, rounded to bf16
    e = embed.view(-1, width, embed.shape[1])[group].float()  # [N, W, H]
    return torch.bmm(e, rows.float()[:, :, None])[:, :, 0].bfloat16().float()


@pytest.mark.parametrize("n, h, v, width", [(37, 1024, 4096, 64), (5, 160, 1024, 64), (9, 2048, 512, 32),
                                            (3, 64, 192, 96), (1, 96, 128, 16)])
def test_bf16_logits_are_the_block_product_within_a_bf16_step(n, h, v, width):
    rows, embed, _ = _bf16(h + width, n, h, v)
    group = torch.randint(0, v // width, (n,), generator=torch.Generator().manual_seed(n))
    group[0] = v // width - 1  # the last group
    if n > 2:
        group[2] = group[1]  # rows sharing a group
    got = categorical.group_logits(rows, embed, group, width, None, 1.0)
    assert got.dtype == torch.float32 and got.shape == (n, width)
    want = _block_product(rows, embed, group, width)
    bound = torch.maximum(got.abs(), want.abs()) * 2**-7 + 1e-5  # one bf16 step, plus fp32 noise near zero
    assert ((got - want).abs() <= bound).all()
    temp = torch.rand(n, 1, generator=torch.Generator().manual_seed(1)) + 0.5
    out = categorical.group_logits(rows, embed, group, width, 30.0, temp)
    assert torch.equal(out, (30.0 * torch.tanh(got / 30.0)) / temp)  # softcap and temperature after, as the reference


def test_bf16_logits_are_each_rows_own():
    rows, embed, group = _bf16(3, 48, 256, 2048)
    group[5:20] = 7  # a run of rows on one block
    full = categorical.group_logits(rows, embed, group, 64, None, 1.0)
    for lo, hi in ((0, 1), (5, 6), (11, 30), (47, 48)):  # a row's logits do not depend on the others
        assert torch.equal(categorical.group_logits(rows[lo:hi], embed, group[lo:hi], 64, None, 1.0), full[lo:hi])
