"""kernels/fused.py (Triton: compiled on a GPU, interpreted on CPU without one) against its references in
kernels/reference_ops.py, and the references against the model's own modules (the spec)."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
import torch.nn.functional as F

from dgcli.kernels.reference_ops import gelu_mul, qkv_norm_rope_reference
from dgcli.model.gemma import rope_tables

pytestmark = pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed (Linux x86-64 only)")

# (dtype, atol, rtol): fp32 differs only by rsqrt vs pow(-0.5) and the reduction order (a few ulps); bf16 mirrors
# every rounding, so a one-ulp difference of the norm can move a rotated value by about one bf16 ulp of its size.
TOLS = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2**-7)]


def _qkv(b, t, heads, kv, has_v, d, dtype, device, per_token):
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(b, t, (heads + kv * (1 + has_v)) * d, generator=g) * 3).to(dtype)
    wq, wk = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    pos = torch.arange(b * t).view(b, t) + 5 if per_token else torch.arange(t) + 5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    inv[d // 4:] = 0  # proportional RoPE: pairs that do not rotate
    cos, sin = rope_tables(pos, inv, dtype)
    return [x.to(device) for x in (qkv, wq, wk, cos, sin)]


def test_reference_equals_the_model_projection():
    from dgcli.checkpoint.config import parse_config
    from dgcli.checkpoint.meta import meta_model
    from dgcli.checkpoint.random_weights import make_config, randomize_
    from fake_cuda import TEXT

    model = randomize_(meta_model(parse_config(make_config(TEXT, 16))).to_empty(device="cpu")).to(torch.bfloat16)
    for layer in model.layers:
        a = layer.self_attn
        x = torch.randn(2, 5, TEXT["hidden_size"]).to(torch.bfloat16)
        d = a.g.head_dim
        cos, sin = rope_tables(torch.arange(5) + 3, torch.rand(d // 2), torch.bfloat16)
        lins = [lin for lin in (a.q_proj, a.k_proj, a.v_proj) if lin is not None]
        qkv = torch.cat([lin(x) for lin in lins], -1)
        got = qkv_norm_rope_reference(qkv, a.q_norm.weight, a.k_norm.weight, cos, sin, a.q_proj.out_features // d,
                                      a.k_proj.out_features // d, a.v_proj is not None, a.q_norm.eps)
        for want, y in zip(a.project(x, cos, sin), got):
            assert torch.equal(want, y.transpose(1, 2))


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("b,t,heads,kv,has_v,d,per_token", [
    (1, 5, 4, 2, True, 16, False), (2, 3, 4, 1, False, 32, True), (1, 3, 16, 8, True, 256, False),
    (2, 2, 16, 2, False, 512, False)])  # the released sliding and full layers' heads
def test_qkv_norm_rope_matches_reference(dtype, atol, rtol, b, t, heads, kv, has_v, d, per_token, triton_device):
    from dgcli.kernels.fused import qkv_norm_rope

    args = _qkv(b, t, heads, kv, has_v, d, dtype, triton_device, per_token)
    got = qkv_norm_rope(*args, heads, kv, has_v, 1e-6)
    for y, want in zip(got, qkv_norm_rope_reference(*args, heads, kv, has_v, 1e-6)):
        assert y.shape == want.shape and y.dtype == dtype and y.is_contiguous()
        torch.testing.assert_close(y, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("shape,inner", [((3, 2 * 48), 48), ((2, 3, 2 * 1100), 1100)])
def test_gelu_mul_fused_matches_reference(dtype, atol, rtol, shape, inner, triton_device):
    from dgcli.kernels.fused import gelu_mul_fused

    gu = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2).to(dtype).to(triton_device)
    want = gelu_mul(gu[..., :inner].clone(), gu[..., inner:])
    torch.testing.assert_close(gelu_mul_fused(gu, inner), want, atol=atol, rtol=rtol)


def test_router_references_equal_the_model_router():
    from dgcli.checkpoint.config import parse_config
    from dgcli.checkpoint.meta import meta_model
    from dgcli.checkpoint.random_weights import make_config, randomize_
    from dgcli.kernels.reference_ops import route_reference, router_input_reference
    from fake_cuda import TEXT

    router = randomize_(meta_model(parse_config(make_config(TEXT, 16))).to_empty(device="cpu")).to(
        torch.bfloat16).layers[0].router
    r = torch.randn(7, TEXT["hidden_size"]).to(torch.bfloat16)
    w, idx = router(r)
    z = router_input_reference(r, router.scale, router.root, router.norm.eps)
    want_w, want_idx = route_reference(router.proj(z), router.per_expert_scale, router.top_k)
    assert torch.equal(w, want_w) and torch.equal(idx, want_idx)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("n,h", [(5, 37), (3, 2816)])
def test_router_input_matches_reference(dtype, atol, rtol, n, h, triton_device):
    from dgcli.kernels.fused import router_input
    from dgcli.kernels.reference_ops import router_input_reference

    g = torch.Generator().manual_seed(2)
    r = (torch.randn(n, h, generator=g) * 3).to(dtype).to(triton_device)
    scale = (torch.rand(h, generator=g) + 0.5).to(dtype).to(triton_device)
    torch.testing.assert_close(router_input(r, scale, h ** -0.5, 1e-6),
                               router_input_reference(r, scale, h ** -0.5, 1e-6), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,e,k", [(6, 4, 2), (9, 128, 8), (3, 6, 3)])
def test_route_matches_reference(dtype, n, e, k, triton_device):
    """The same probabilities chosen, in the same order (bf16 logits tie often: among equals the kernel takes
    the lowest id, torch.topk an unspecified one), each weight renormalised and scaled by its own expert's
    scale within fp32 rounding (sums in another order)."""
    from dgcli.kernels.fused import route
    from dgcli.kernels.reference_ops import route_reference

    g = torch.Generator().manual_seed(n * e)
    logits = (torch.randn(n, e, generator=g) * 2).to(dtype).to(triton_device)
    scale = (torch.rand(e, generator=g) + 0.5).to(dtype).to(triton_device)
    (w, idx), (_, want_idx) = route(logits, scale, k), route_reference(logits, scale, k)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert idx.dtype == torch.int64 and torch.equal(probs.gather(1, idx), probs.gather(1, want_idx))
    top = probs.gather(1, idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True) * scale[idx], atol=1e-6, rtol=1e-5)
