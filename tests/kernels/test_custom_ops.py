"""The Triton kernels as torch custom ops (kernels/ops.py): through the op, each kernel gives bit for bit
what the direct call gives (compiled on a GPU, else interpreted on CPU: tests/conftest.py decides), and each
op's fake implementation (what FakeTensorMode, torch.compile and CUDA-graph checks run) gives the real
outputs' exact shapes, dtypes and devices; the dispatcher reaches the kernels through the ops."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dgcli.kernels import dispatch, ops
from dgcli.kernels.fp8 import FP8, FP8_MAX

pytestmark = pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed (Linux x86-64 only)")


def on(device, args, kw=None):
    """args (a list) and kw (a dict) with every tensor moved to `device`."""
    move = (lambda a: a.to(device) if isinstance(a, torch.Tensor) else a)
    return [move(a) for a in args], {k: move(v) for k, v in (kw or {}).items()}


def flat(out) -> list[torch.Tensor]:
    """An op's outputs as a list: a tensor, a tuple, or a VocabPassOut's fields (None ones left out)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple):
        return list(out)
    return [t for t in vars(out).values() if t is not None]


def same_through_op_and_fake(via_op, direct, *args, **kw):
    """via_op(*args) equals direct(*args) bit for bit, and via_op on fake copies of args gives outputs of
    the same shapes, dtypes and devices (and the same None fields)."""
    got, want = via_op(*args, **kw), direct(*args, **kw)
    real, ref = flat(got), flat(want)
    assert len(real) == len(ref)
    for a, b in zip(real, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake_kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        fake = flat(via_op(*fake_args, **fake_kw))
    assert [(t.shape, t.dtype, t.device) for t in fake] == [(t.shape, t.dtype, t.device) for t in real]
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_op(dtype, with_weight, triton_device):
    from dgcli.kernels.fused import rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=g).to(dtype)
    w = (torch.rand(40, generator=g) + 0.5).to(dtype) if with_weight else None
    args, _ = on(triton_device, [x, w, 1e-6])
    same_through_op_and_fake(torch.ops.dgemma.rms_norm, rms_norm, *args)


def expert_inputs(dtype, fp8: bool, n=9, h=40, inter=24, e=4, k=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=g).to(dtype)
    w, idx = torch.softmax(torch.randn(n, e, generator=g), -1).topk(k, -1)
    gate_up = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    down = torch.randn(e, h, inter, generator=g) / inter**0.5
    if not fp8:
        return (x, w, idx, gate_up.to(dtype), down.to(dtype)), {}
    scales = [m.abs().amax(-1, keepdim=True) / FP8_MAX for m in (gate_up, down)]
    gq, dq = ((m / s).to(FP8) for m, s in zip((gate_up, down), scales))
    return (x, w, idx, gq, dq), dict(gate_up_scale=scales[0].to(dtype), down_scale=scales[1].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", ["none", "weight-only", "dynamic"])
def test_experts_op(dtype, fp8, triton_device):
    from dgcli.kernels.moe import experts_triton

    args, kw = expert_inputs(dtype, fp8 != "none")
    if fp8 == "dynamic":
        kw["dynamic"] = True
    args, kw = on(triton_device, args, kw)
    out = same_through_op_and_fake(torch.ops.dgemma.experts, experts_triton, *args, **kw)
    assert out.shape == args[0].shape and out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_op(dtype, triton_device):
    from dgcli.kernels.fp8_linear import linear_w8a16

    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=g)
    s = (w.abs().amax(-1, keepdim=True) / FP8_MAX).to(dtype)
    args, _ = on(triton_device, [torch.randn(2, 3, 40, generator=g).to(dtype), (w / s.float()).to(FP8), s])
    out = same_through_op_and_fake(torch.ops.dgemma.fp8_linear, linear_w8a16, *args)
    assert out.shape == (2, 3, 24) and out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_quantize_op(dtype, triton_device):
    from dgcli.kernels.fp8_linear import quantize_rows

    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(6)).to(dtype)
    q, s = same_through_op_and_fake(torch.ops.dgemma.fp8_quantize, quantize_rows, x.to(triton_device))
    assert q.dtype == FP8 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (2, 3, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("want_soft", [True, False])
def test_vocab_pass_op(dtype, want_soft, triton_device):
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    g = torch.Generator().manual_seed(2)
    b, c, h, v = 2, 5, 24, 70
    hidden = torch.randn(b, c, h, generator=g).to(dtype)
    embed = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    kw = dict(softcap=30.0, temperature=torch.tensor([0.7, 0.9]), embed_scale=torch.tensor(h**0.5).to(dtype),
              uniform=torch.rand(b, c, generator=g, dtype=torch.float64), want_soft=want_soft, splits=2,
              block_m=16, block_n=16, block_k=16, row_chunk=3)
    (hidden, embed), kw = on(triton_device, [hidden, embed], kw)
    out = same_through_op_and_fake(ops.vocab_pass, vocab_pass_triton, hidden, embed, **kw)
    assert (out.soft is None) == (not want_soft)
    assert out.sample.dtype == out.argmax.dtype == torch.int64 and out.entropy.dtype == torch.float32


def test_vocab_pass_op_takes_python_scalars_as_the_kernel_does(triton_device):
    """A float temperature and embedding scale (what the sampler passes when one temperature serves the batch)."""
    from dgcli.kernels.vocab_pass import vocab_pass_triton

    g = torch.Generator().manual_seed(3)
    hidden, embed = torch.randn(1, 4, 16, generator=g), torch.randn(50, 16, generator=g)
    kw = dict(softcap=None, temperature=0.8, embed_scale=4.0, uniform=torch.rand(1, 4, generator=g),
              block_m=16, block_n=16, block_k=16)
    (hidden, embed), kw = on(triton_device, [hidden, embed], kw)
    same_through_op_and_fake(ops.vocab_pass, vocab_pass_triton, hidden, embed, **kw)


def test_dispatch_reaches_the_kernels_through_the_ops(monkeypatch):
    """With Triton chosen, the dispatcher calls torch.ops.dgemma.* (seen here through the ops' fakes, which a
    direct kernel call would never run)."""
    seen = []
    for name in ("rms_norm", "experts", "vocab_pass", "fp8_linear"):
        monkeypatch.setitem(dispatch._CHOSEN, (name, torch.device("cpu"), os.environ.get("DGEMMA_KERNELS")),
                            "triton")
    args, _ = expert_inputs(torch.float32, False)
    with FakeTensorMode() as mode:
        fx = [mode.from_tensor(a) for a in args]
        seen.append(dispatch.rms_norm(fx[0], None, 1e-6))
        seen.append(dispatch.experts(*fx))
        h, e = torch.empty(1, 3, 8), torch.empty(20, 8)
        seen += flat(dispatch.vocab_pass(h, e, softcap=None, temperature=1.0, embed_scale=1.0,
                                         uniform=torch.empty(1, 3)))
        seen.append(dispatch.fp8_linear(fx[0], torch.empty(6, fx[0].shape[1], dtype=FP8), torch.ones(6, 1)))
    assert all(isinstance(t, torch._subclasses.fake_tensor.FakeTensor) for t in seen)
    assert [t.dtype for t in seen[2:6]] == [torch.int64, torch.int64, torch.float32, torch.float32]
    assert seen[6].shape == (fx[0].shape[0], 6)


def test_ops_pass_torch_opcheck(triton_device):
    """torch.library.opcheck: the schema (mutates_args: none of the kernels writes its inputs; no output
    aliases an input) and the fake against the real kernel, on one small case of each op."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 24, generator=g)
    cases = [(torch.ops.dgemma.rms_norm.default, (x, torch.rand(24, generator=g) + 0.5, 1e-6))]
    args, _ = expert_inputs(torch.bfloat16, False)  # (FP8 inputs: opcheck's own mutation check cannot compare e4m3)
    cases.append((torch.ops.dgemma.experts.default, (*args, None, None, False)))
    hidden, embed = torch.randn(1, 4, 16, generator=g), torch.randn(50, 16, generator=g)
    cases.append((torch.ops.dgemma.vocab_pass.default,
                  (hidden, embed, 30.0, torch.tensor(0.8), torch.tensor(4.0), torch.rand(1, 4, generator=g), True,
                   None, 16, 16, 16, None)))
    for op, args in cases:
        args, _ = on(triton_device, list(args))
        torch.library.opcheck(op, tuple(args), test_utils=("test_schema", "test_faketensor"))
