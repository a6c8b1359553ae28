"""The counter-based random stream (dgcli/sampling/draws.py): exact 32-bit arithmetic, the statistics of
its uniforms and ids, and that a value depends only on its own counters (the property that makes a
request's draws independent of kernel path, batch-mates and order)."""

from __future__ import annotations

import math

import pytest
import torch

from dgcli.sampling import draws

M32 = 0xFFFFFFFF


def py_mix(x: int) -> int:
    """lowbias32 in plain Python integers: the reference for the int64-carried version."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_hash(seed: int, *words: int) -> int:
    h = py_mix((seed & M32) ^ 0x9E3779B9)
    for w in (seed >> 32, *words):
        h = py_mix(((h ^ py_mix(((w & M32) + 0x9E3779B9) & M32)) + 0x7F4A7C15) & M32)
    return h


def test_int64_arithmetic_is_exact_32_bit():
    xs = torch.cat([torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0)),
                    torch.tensor([0, 1, 0xFFFF, 0x10000, M32, M32 - 1])])
    assert [int(v) for v in draws._mix(xs)] == [py_mix(int(x)) for x in xs]
    for seed in (0, 7, 2**32 + 5, 2**63 - 1):
        got = draws._hash(seed, 2, torch.arange(5)[:, None], 3, torch.arange(4))  # [5, 4]
        assert got.tolist() == [[py_hash(seed, 2, b, 3, p) for p in range(4)] for b in range(5)]


def test_a_value_depends_only_on_its_own_counters():
    """Computed alone, in a row, in a grid, or after other draws: the same number."""
    grid = draws.uniform(3, draws.DRAW, torch.arange(4)[:, None, None], torch.arange(1, 7)[None, :, None],
                         torch.arange(16))  # [4, 6, 16]
    assert grid[2, 3, 5] == draws.uniform(3, draws.DRAW, 2, 4, 5)
    assert torch.equal(grid[1, 0], draws.uniform(3, draws.DRAW, 1, 1, torch.arange(16)))
    # the seed, the purpose, and each counter move the value
    base = float(draws.uniform(3, draws.DRAW, 2, 4, 5))
    for other in (draws.uniform(4, draws.DRAW, 2, 4, 5), draws.uniform(3, draws.RENOISE, 2, 4, 5),
                  draws.uniform(3, draws.DRAW, 3, 4, 5), draws.uniform(3, draws.DRAW, 2, 5, 5),
                  draws.uniform(3, draws.DRAW, 2, 4, 6), draws.uniform(3 + 2**32, draws.DRAW, 2, 4, 5)):
        assert float(other) != base


def test_uniforms_are_uniform_and_neighbours_uncorrelated():
    u = draws.uniform(0, draws.DRAW, torch.arange(8)[:, None, None], torch.arange(1, 49)[None, :, None],
                      torch.arange(256))  # [8, 48, 256]: ~98 k values over the counters one run uses
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    flat = u.flatten()
    counts = torch.bincount((flat * 100).long(), minlength=100).double()
    exp = flat.numel() / 100
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    assert chi2 < 99 + 6 * math.sqrt(2 * 99), chi2  # p < 1e-8 beyond this
    n = flat.numel()
    for a, b in ((u[..., :-1], u[..., 1:]), (u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # position, step, block
        r = float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
        assert abs(r) < 5 / math.sqrt(n), r
    # The check has power: a Weyl sequence (uniform, but each value a fixed step from the last) fails it.
    weyl = (torch.arange(n, dtype=torch.float64) * (math.sqrt(5) - 1) / 2) % 1
    assert abs(float(torch.corrcoef(torch.stack([weyl[:-1], weyl[1:]]))[0, 1])) > 5 / math.sqrt(n)


@pytest.mark.parametrize("vocab", [48, 1000, 262_144])
def test_token_ids_cover_the_vocabulary_evenly(vocab):
    ids = draws.token_ids(5, draws.INIT, 0, 0, torch.arange(200_000), vocab)
    assert ids.dtype == torch.long and int(ids.min()) >= 0 and int(ids.max()) < vocab
    if vocab <= 1000:
        counts = torch.bincount(ids, minlength=vocab).double()
        exp = ids.numel() / vocab
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        assert chi2 < vocab - 1 + 6 * math.sqrt(2 * (vocab - 1)), chi2
    else:
        assert ids.unique().numel() > 0.45 * vocab  # 200 k draws over 262 k ids: ~1 - e^-0.76 = 53 % seen
    with pytest.raises(ValueError):
        draws.token_ids(5, draws.INIT, 0, 0, 0, 0)


def test_uniform_folds_the_shared_words_once():
    """`uniform` hashes (seed, purpose, block, step, position) once and folds 0 and 1 into it: the same bits as the
    two six-word hashes it stands for."""
    seed, block, step = torch.tensor([[3], [2**40 + 7]]), torch.tensor([[0], [5]]), torch.tensor([[1], [48]])
    pos = torch.arange(64)
    hi = draws._hash(seed, draws.DRAW, block, step, pos, 0)
    lo = draws._hash(seed, draws.DRAW, block, step, pos, 1)
    assert torch.equal(draws.uniform(seed, draws.DRAW, block, step, pos), ((hi << 21) | (lo >> 11)).double() * 2.0**-53)


def test_the_row_forms_give_the_same_bits():
    """`rows` (the per-row words hashed on the host) + `uniform_at` / `token_ids_at` (the position folded by tensor
    ops, its mix made once) are `uniform` / `token_ids` of the same counters, bit for bit; seeds past 2^32 too."""
    counters = [(0, draws.DRAW, 0, 1), (7, draws.RENOISE, 3, 17), (2**40 + 5, draws.INIT, 1, 0),
                (2**63 - 1, draws.DRAW, 2**20, 255)]
    pos = torch.arange(300)
    states, mixed = draws.rows(counters, "cpu"), draws.mixed_positions(pos)
    assert states.tolist() == [[py_hash(*c)] for c in counters]
    seed, purpose, block, step = (torch.tensor([c[i] for c in counters])[:, None] for i in range(4))
    for k, (_, p, _, _) in enumerate(counters):  # one purpose per call, as the engine draws
        want_u = draws.uniform(seed[k:k + 1], p, block[k:k + 1], step[k:k + 1], pos)
        want_t = draws.token_ids(seed[k:k + 1], p, block[k:k + 1], step[k:k + 1], pos, 262144)
        assert torch.equal(draws.uniform_at(states[k:k + 1], mixed), want_u)
        assert torch.equal(draws.token_ids_at(states[k:k + 1], mixed, 262144), want_t)
    with pytest.raises(ValueError, match="vocab_size"):
        draws.token_ids_at(states, mixed, 0)


def test_row_states_are_memoised_without_changing_them():
    """`rows` folds a step's word onto its row's memoised prefix: any order of calls gives `py_hash`'s states."""
    counters = [(s, p, b, t) for s in (1, 2**40 + 3) for p in (draws.DRAW, draws.RENOISE) for b in (0, 9)
                for t in (1, 2)]
    for order in (counters, counters[::-1], counters[3:] + counters[:3]):
        assert draws.rows(order, "cpu")[:, 0].tolist() == [py_hash(*c) for c in order]
