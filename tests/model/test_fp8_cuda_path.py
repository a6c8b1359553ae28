"""FP8 weights on the CUDA path, one engine pass on fake CUDA (tests/fake_cuda.py) at the released config's shapes
(a sliding and a full layer, batch 1, a 256-token canvas over a 128-token prefix), the custom ops' real wrappers run
with their Triton launches stubbed: what a pass creates, tensor by tensor. Weight-only and dynamic alike, no tensor
in fp32 or fp16 as large as an FP8 weight exists (no weight is dequantized outside the kernels: they decode e4m3
tiles in registers); dynamic FP8 quantizes each FP8 matmul's activations in one launch (kernels/fp8_linear.py's
quantizer), the dense layers on torch._scaled_mm.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dgcli.model.fp8 import FP8Experts, FP8Linear
from fake_cuda import CudaBindings, Launches, fake_cuda, fake_model, real_wrappers  # noqa: F401
from test_launches import CANVAS, PREFIX, RELEASED, S, F

from dgcli.model.attention import PassLayout, Segment

pytest.importorskip("triton")


class Created(TorchDispatchMode):
    """(op, dtype, numel) of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.dtype, t.numel()))
        return out


def fp8_pass(mode, monkeypatch, semantics: str):
    """(the smallest FP8 weight's numel, the tensors created, the launches) of one FP8 pass."""
    monkeypatch.setenv("DGEMMA_FP8", semantics)
    text = {**RELEASED, "num_hidden_layers": 2, "layer_types": [S, F]}
    model = fake_model(mode, "fp8", text, CANVAS)
    smallest = min(b.numel() for m in model.modules() if isinstance(m, (FP8Linear, FP8Experts))
                   for b in m.buffers() if b.dtype == torch.float8_e4m3fn)
    created, counter = Created(), Launches()
    with mode, CudaBindings(), torch.inference_mode():
        cache = model.new_cache(1, PREFIX + CANVAS)
        cache.reserve(0, PREFIX + CANVAS)
        layout = PassLayout([Segment(0, PREFIX, CANVAS, True)], cache, torch.device("cuda", 0))
        ids = torch.zeros(CANVAS, dtype=torch.long, device="cuda")
        soft = torch.empty(1, CANVAS, RELEASED["hidden_size"], dtype=torch.bfloat16, device="cuda")
        real_wrappers(monkeypatch, counter)
        with counter, created:
            model.forward_layout(ids, layout, soft)
    return smallest, created.seen, counter.names


@pytest.mark.parametrize("semantics", ["weight-only", "dynamic"])
def test_an_fp8_pass_dequantizes_no_weight_and_quantizes_activations_in_one_launch(fake_cuda, monkeypatch,
                                                                                  semantics):
    smallest, seen, names = fp8_pass(fake_cuda, monkeypatch, semantics)
    wide = [(op, dt, n) for op, dt, n in seen if dt in (torch.float32, torch.float16) and n >= smallest]
    assert not wide, wide[:5]
    quant, scaled = names.count("triton._quant_kernel"), names.count("aten._scaled_mm.default")
    if semantics == "weight-only":
        assert quant == scaled == 0 and "triton._w8a16_kernel" in names
    else:  # every dense FP8 linear: one quantizer launch and torch._scaled_mm; each experts layer: two launches
        assert scaled >= 2 * 6 and quant == scaled + 2 * 2, (quant, scaled)
        assert not any(n.startswith(("aten.amax", "aten.abs")) for n in names)  # no torch quantizer ops


def test_an_a100_runs_weight_only_fp8_experts_on_triton(fake_cuda, monkeypatch):
    """SM 8.0 (fake CUDA reporting an A100's capability): weight-only FP8 experts launch the Triton expert kernels
    (they decode e4m3 bytes with integer ops; their sm_80 builds: tests/kernels/test_kernel_targets.py), not the
    reference, and still dequantize no weight."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    smallest, seen, names = fp8_pass(fake_cuda, monkeypatch, "weight-only")
    assert {"triton._gate_up_kernel", "triton._down_kernel"} <= set(names), names
    assert not [(op, dt, n) for op, dt, n in seen if dt in (torch.float32, torch.float16) and n >= smallest]
