"""The CPU pass's draw (kernels/categorical.py): in fp32, a row's logits are its own whatever its batch-mates (the
gather of every row's block, one bmm); in bf16, the logits against the fp32 block
product (one bf16 step), each row's own."""

from __future__ import annotations

import pytest
import torch

from dgcli.kernels import categorical


@pytest.mark.parametrize("groups", [[3] * 16, [5, 1] * 8, list(range(16)), [2] * 15 + [7]])
@pytest.mark.parametrize("h", [160, 512])
def test_a_rows_logits_do_not_depend_on_its_batch_mates(groups, h):
    """fp32: however many rows share a group (one block read in place by all of them, or each row's block
    gathered), each row's logits are the ones it gets alone, bit for bit, and its group's 64 columns of the head."""
    g = torch.Generator().manual_seed(h)
    embed = torch.randn(1024, h, generator=g)
    rows = torch.randn(len(groups), h, generator=g)
    group = torch.tensor(groups)
    temp = torch.rand(len(groups), 1, generator=g) + 0.5
    together = categorical.group_logits(rows, embed, group, 64, 30.0, temp)
    alone = torch.cat([categorical.group_logits(rows[i:i + 1], embed, group[i:i + 1], 64, 30.0, temp[i:i + 1])
                       for i in range(len(groups))])
    assert torch.equal(together, alone)
    want = torch.stack([rows[i] @ embed[k * 64:(k + 1) * 64].T for i, k in enumerate(groups)])
    torch.testing.assert_close(together, (30.0 * torch.tanh(want / 30.0)) / temp, rtol=1e-5, atol=1e-5)


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
