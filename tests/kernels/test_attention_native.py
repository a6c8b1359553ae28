"""The C attention (kernels/attention_native.py) against an fp32 softmax(Q K^T) V of the same bf16 inputs within a
bound derived from its roundings, and against torch's SDPA in bf16 within a bf16 step; odd shapes, GQA, strided
views as the attention path passes them; a row's bits independent of the batch, the other rows and the thread
count; no NaN from large finite inputs; the switches that keep SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels import attention_native

pytestmark = pytest.mark.skipif(not attention_native.available(), reason="no C compiler or no AVX512-BF16 here")
bf16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fast_bf16(monkeypatch):
    """The kernel runs only when asked for (DGEMMA_BF16_FAST=1); the last tests check the default declines."""
    monkeypatch.setenv("DGEMMA_BF16_FAST", "1")


def qkv(b, hq, hk, r, s, d, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, r, d, generator=g) * scale / d**0.25).to(bf16)  # scores of a few units, as QK-norm gives
    k = (torch.randn(b, hk, s, d, generator=g) * scale / d**0.25).to(bf16)
    v = torch.randn(b, hk, s, d, generator=g).to(bf16)
    return q, k, v


def run(q, k, v):
    out = torch.empty(q.shape, dtype=bf16)
    assert attention_native.attend(q, k, v, out) is out
    return out


def reference(q, k, v):
    """fp64 softmax(Q K^T) V of the bf16 inputs, GQA by head groups; and the scores' rounding bound in fp32 (a sum
    of d products: <= d 2^-24 sum |q k| each)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2)
    err = q.shape[-1] * 2.0**-24 * (q.double().abs() @ k.abs().transpose(-1, -2))
    return torch.softmax(s, -1) @ v, err.amax(-1, keepdim=True)


def check_bound(out, q, k, v):
    """|out - ref| <= 2^-9 max|V| (P rounded to bf16: each weight within 2^-9 of itself, the sum unrounded)
    + 2^-8 |ref| (the output's rounding, and the reciprocal's) + 2 max Δs max|V| (a score's fp32 error shifts the
    weights by a factor within exp(±2Δs)) + ~20 ulp of exp and the fp32 sums."""
    want, ds = reference(q, k, v)
    vmax = v.double().abs().amax(-2, keepdim=True).repeat_interleave(q.shape[1] // k.shape[1], 1)
    bound = 2.0**-9 * vmax + 2.0**-8 * want.abs() + (2 * ds + 20 * 2.0**-23) * vmax
    assert ((out.double() - want).abs() <= bound).all()


def check_sdpa(out, q, k, v):
    """Within a bf16 step of SDPA: both round P to bf16 (a weight may round the other way, 2^-8 max|V| at
    worst) and the output (one step each)."""
    want = F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=True).double()
    vmax = v.double().abs().amax(-2, keepdim=True).repeat_interleave(q.shape[1] // k.shape[1], 1)
    assert ((out.double() - want).abs() <= 2.0**-8 * vmax + 2.0**-7 * want.abs()).all()


@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("d", [32, 128, 256, 512])
@pytest.mark.parametrize("r, s", [(1, 1), (13, 37), (300, 17), (25, 600)])
def test_equals_the_fp32_softmax_within_its_roundings_and_sdpa_within_a_bf16_step(g, d, r, s):
    q, k, v = qkv(1, 2 * g, 2, r, s, d, seed=r + s + d + g)
    out = run(q, k, v)
    check_bound(out, q, k, v)
    check_sdpa(out, q, k, v)


@pytest.mark.parametrize("r, s", [(256, 288), (7, 511), (12, 16), (11, 32), (24, 33)])
def test_block_and_key_tails(r, s):
    q, k, v = qkv(2, 8, 4, r, s, 128, seed=s)
    out = run(q, k, v)
    check_bound(out, q, k, v)
    check_sdpa(out, q, k, v)


def test_strided_views_as_the_attention_path_passes_them():
    """q and out [1, H, N, d] views of [1, N, H, d] rows; keys as views of a [H, slots, d] pool; a batched
    call's as_strided views of m segments' rows (dgcli/model/attention.py); out written in place only."""
    g = torch.Generator().manual_seed(1)
    m, rows, n, hq, hk, d = 3, 10, 21, 8, 4, 64
    q = torch.randn(1, m * rows, hq, d, generator=g).to(bf16).transpose(1, 2)  # [1, H, N, d], row stride H·d
    pool_k = torch.randn(hk, 100, d, generator=g).to(bf16)
    pool_v = torch.randn(hk, 100, d, generator=g).to(bf16)
    k, v = pool_k[None, :, 7:7 + m * n], pool_v[None, :, 7:7 + m * n]
    big = torch.zeros(1, m * rows + 4, hq, d, dtype=bf16)
    out = big.transpose(1, 2)[:, :, 2:2 + m * rows]
    views = [t.as_strided((m, h, r, d), (r * t.stride(2), *t.stride()[1:]))
             for t, h, r in zip((q, out, k, v), (hq, hq, hk, hk), (rows, rows, n, n))]
    assert attention_native.attend(*views[:1], *views[2:], views[1]) is views[1]
    assert not big[:, :2].any() and not big[:, 2 + m * rows:].any()
    qs, ks, vs = views[0].contiguous(), views[2].contiguous(), views[3].contiguous()
    assert torch.equal(views[1], run(qs, ks, vs))  # strides change nothing
    check_bound(views[1], qs, ks, vs)


@pytest.mark.parametrize("d, s", [(128, 77), (512, 300)])  # 12-row items; 48-row items (K and V past 1/2 MB)
def test_a_row_does_not_depend_on_the_batch_the_other_rows_or_the_threads(d, s):
    q, k, v = qkv(3, 8, 2, 60, s, d, seed=5)
    want = run(q, k, v)
    assert torch.equal(run(q[1:2], k[1:2], v[1:2]), want[1:2])  # alone
    for a, b in ((0, 1), (5, 6), (11, 40), (17, 60)):  # other places in the row blocks
        assert torch.equal(run(q[:, :, a:b], k, v), want[:, :, a:b])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(run(q, k, v), want)
    finally:
        torch.set_num_threads(threads)


def test_large_finite_inputs_give_no_nan():
    """Scores of ~1e5 (one key takes the row), and rows where every score is hugely negative."""
    q, k, v = qkv(1, 4, 2, 20, 50, 128, seed=2, scale=30.0)
    out = run(q, k, v)
    assert out.isfinite().all()
    check_bound(out, q, k, v)
    q2, k2 = q.abs(), -k.abs()  # every score ~ -1e5
    out = run(q2, k2, v)
    assert out.isfinite().all()
    check_bound(out, q2, k2, v)


def test_declines_what_it_does_not_take(monkeypatch):
    q, k, v = qkv(1, 4, 2, 5, 9, 64)
    out = torch.empty_like(q)
    assert attention_native.attend(q.float(), k.float(), v.float(), out.float()) is None  # fp32: SDPA
    assert attention_native.attend(q[..., :48], k[..., :48], v[..., :48], out[..., :48]) is None  # d 48
    assert attention_native.attend(q, k[:, :1].expand(1, 3, 9, 64), v[:, :1].expand(1, 3, 9, 64), out) is None
    assert attention_native.attend(torch.cat((q, q), -1)[..., ::2], k, v, out) is None  # a strided last dim
    assert attention_native.attend(q, k[:, :, :0], v[:, :, :0], out) is None  # no key
    monkeypatch.setattr(attention_native, "PACK_BYTES", 2 * 32 * 64 * 4 - 1)  # K and V packed would take more
    assert attention_native.attend(q, k, v, out) is None
    monkeypatch.setattr(attention_native, "PACK_BYTES", 2 * 32 * 64 * 4)
    assert attention_native.attend(q, k, v, out) is out
    for var, value in (("DGEMMA_NATIVE", "0"), ("DGEMMA_BF16_FAST", "0"), ("DGEMMA_KERNELS", "reference")):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert attention_native.attend(q, k, v, out) is None
    with monkeypatch.context() as m:
        m.delenv("DGEMMA_BF16_FAST")  # the default: SDPA, the reference's bits
        assert attention_native.attend(q, k, v, out) is None


def test_a_bf16_pass_sends_its_canvases_here_within_a_bf16_step_of_sdpa(monkeypatch):
    """A batched bf16 canvas pass (tests/model's gqa4_moe8 config: its full layers' head_dim 32 takes the C kernel,
    the sliding layers' 8 does not): every canvas call of d 32 runs here, as batched views, within a bf16 step of
    SDPA on the same inputs; by default (no DGEMMA_BF16_FAST) none runs here."""
    from hf_oracle import CONFIGS

    from dgcli.checkpoint.random_weights import make_config, random_model

    text = {k: v for k, v in CONFIGS["gqa4_moe8"].items() if k != "canvas"}
    m = random_model(make_config(text, canvas_length=16), seed=0).to(bf16)
    calls, attend = [], attention_native.attend

    def spy(q, k, v, out):
        got = attend(q, k, v, out)
        if got is not None:
            calls.append(tuple(q.shape))
            check_sdpa(out, q, k, v)
        return got

    monkeypatch.setattr(attention_native, "attend", spy)
    g = torch.Generator().manual_seed(0)
    prompt, canvas = torch.randint(0, 128, (2, 21), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    with torch.inference_mode():
        got = m.forward_canvas(prompt, canvas)
        assert calls == [(2, 8, 16, 32)] and got.isfinite().all()
        monkeypatch.delenv("DGEMMA_BF16_FAST")
        m.forward_canvas(prompt, canvas)
    assert len(calls) == 1
