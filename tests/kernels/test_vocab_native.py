"""The vocabulary tile's C statistics (kernels/vocab_native.py) against the torch tile (kernels/vocab_pass_cpu.py):
the same outputs within fp32 rounding (libmvec's tanh and exp, other summation orders), the same argmax, round(L)
in bf16 at most one bf16 step off where a tanh ulp crosses a rounding boundary; the whole vocabulary pass with it
against the pass without; and the switches that keep the torch tile."""

from __future__ import annotations

import pytest
import torch

from dgcli.kernels import vocab_native
from dgcli.kernels.vocab_pass_cpu import native_or_torch_tile_stats, tile_stats, vocab_pass_tiled

pytestmark = pytest.mark.skipif(vocab_native._native() is None, reason="no C compiler here")


@pytest.mark.parametrize("raw_dtype, soft", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.bfloat16, None), (torch.float32, None)])
@pytest.mark.parametrize("softcap, per_row, t, width", [(30.0, True, 640, 64), (None, False, 200, 64),
                                                         (30.0, False, 96, 96)])
def test_tile_stats_equal_the_torch_tile_within_fp32_rounding(raw_dtype, soft, softcap, per_row, t, width):
    g = torch.Generator().manual_seed(t)
    n = 12
    raw = (torch.randn(n, t, generator=g) * 25).to(raw_dtype)
    temp = torch.rand(n, 1, generator=g) + 0.5 if per_row else torch.tensor(0.7)
    want = tile_stats(raw.clone(), softcap, temp, soft, width)
    got = vocab_native.tile_stats(raw.clone(), softcap, temp, soft, width)
    assert got is not None
    for name, a, b in zip(("tmax", "targ", "zt", "st", "gz"), want, got):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got[1], want[1])  # the first index of the max
    if soft is None:
        assert got[5] is None and want[5] is None
    elif soft == torch.float32:  # exp(L - max), the fp32 soft embedding's weights
        torch.testing.assert_close(got[5], want[5], rtol=1e-5, atol=1e-6)
    else:  # round(L) in bf16: equal, or one bf16 step off where L sat at a rounding boundary
        off = got[5] != want[5]
        assert off.float().mean() < 0.01
        step = want[5].float().abs() * 2**-7
        assert ((got[5].float() - want[5].float()).abs()[off] <= step[off] * 1.01).all()


def test_the_store_is_written_in_place_and_a_strided_tile_declines():
    raw = torch.randn(8, 128).bfloat16()
    store = torch.zeros(8, 256, dtype=torch.bfloat16)
    out = vocab_native.tile_stats(raw, 30.0, torch.tensor(1.0), torch.bfloat16, 64, store[:, 128:])
    assert out[5].data_ptr() == store[:, 128:].data_ptr() and store[:, 128:].abs().sum() > 0
    assert not store[:, :128].any()  # (its row stride is 256: the other half untouched)
    assert vocab_native.tile_stats(raw.t().contiguous().t(), 30.0, torch.tensor(1.0), None, 64) is None
    assert vocab_native.tile_stats(raw.half(), 30.0, torch.tensor(1.0), None, 64) is None  # fp16: torch's


def test_the_switch_keeps_the_torch_tile(monkeypatch):
    raw = torch.randn(4, 64)
    for mode in ("torch", "reference"):
        with monkeypatch.context() as m:
            m.setenv("DGEMMA_KERNELS", mode)
            assert vocab_native.tile_stats(raw.clone(), 30.0, torch.tensor(1.0), None, 64) is None
            a = native_or_torch_tile_stats(raw.clone(), 30.0, torch.tensor(1.0), None, 64)
            b = tile_stats(raw.clone(), 30.0, torch.tensor(1.0), None, 64)
            assert all(torch.equal(x, y) for x, y in zip(a[:5], b[:5]))  # the torch tile's bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vocabulary_pass_with_and_without_the_c_tile(dtype, monkeypatch):
    """Two canvases, V = 1,000 in tiles of 256 (a partial last tile): argmax equal, entropy within 1e-5 (fp32) /
    1e-4 (bf16), the soft embedding within 1e-5 / one bf16 step, the draws equal but for near-ties."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, 48, generator=g).to(dtype)
    embed = torch.randn(1000, 48, generator=g).to(dtype)
    u = torch.rand(2, 16, generator=g, dtype=torch.float64)
    kw = dict(softcap=30.0, temperature=torch.tensor([0.8, 1.3]), embed_scale=48**0.5, uniform=u, tile=256)
    fast = vocab_pass_tiled(hidden, embed, **kw)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    slow = vocab_pass_tiled(hidden, embed, **kw)
    assert torch.equal(fast.argmax, slow.argmax)
    torch.testing.assert_close(fast.entropy, slow.entropy, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-4)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(fast.soft.float(), slow.soft.float(), rtol=tol, atol=tol)
    assert (fast.sample == slow.sample).float().mean() >= 0.9


def test_loading_the_native_kernels_leaves_denormals_alone():
    """No native library may change the process's floating-point environment (-ffast-math's startup code sets
    flush-to-zero for the whole process: hypothesis and every torch op would see it)."""
    import subprocess
    import sys

    code = ("import torch; from dgcli.kernels import native; "
            "assert all(v in ('built', 'CPU lacks its instructions') for v in native.status().values()); "
            "assert 5e-324 * 1.0 > 0 and (torch.tensor([1e-40]) * 1.0).item() > 0, 'denormals flushed'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
