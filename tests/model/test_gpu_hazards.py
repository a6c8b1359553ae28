"""GPU bugs a CPU can see: a graphs engine (lag 1, CUDA graphs on) runs several requests on fake CUDA
(tests/fake_cuda.py) with the custom ops' real wrappers (kernels/moe.py, vocab_pass.py, fp8_linear.py: their
Triton launches stubbed and counted), in bf16 and both FP8 semantics. Inside the engine's passes: no host read
(`.item()`, `.tolist()`, a copy to the CPU that waits) besides the declared ones, no wait for the device or a
stream (only a settled pass's event is waited on), and no weight copied into another dtype (e.g. a per-call `.float()` of the expert
weights: on a GPU a full read and write of every expert each pass). Each CUDA graph is captured only after the
same pass ran eagerly on its static inputs (a capture first compiles and autotunes the Triton kernels, which a
capture cannot hold), and later passes of its bucket replay it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dgcli.engine import LLMEngine, Request
from dgcli.sampling import host_reads
from dgcli.sampling.params import DiffusionEbParams
from fake_cuda import (CUDA, PROMPT_LENS, TEXT, CudaBindings, FakeCuda, Launches, PageableCopies, fake_cuda,  # noqa: F401
                       fake_model, real_wrappers, substitute_reads)

pytest.importorskip("triton")


class Hazards(TorchDispatchMode):
    """Device-to-host reads and weight copies into another dtype, as `found` lines."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights, self.found = weights, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        kwargs = kwargs or {}
        cuda = any(t.device.type == "cuda" for t in leaves)
        if func is torch.ops.aten._local_scalar_dense.default and cuda:
            self.found.append(f"a host read of a {tuple(leaves[0].shape)} device value (.item / .tolist)")
        out = func(*args, **kwargs)
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        waits = not (kwargs.get("non_blocking") or func is torch.ops.aten.copy_.default and args[2:3] == (True,))
        if cuda and waits and any(t.device.type == "cpu" for t in outs):  # (an async copy into pinned memory waits not)
            self.found.append(f"{func}: a copy to the host that waits for the device")
        convert = len(leaves) == 1 or func is torch.ops.aten.copy_.default  # .to / .float / a copy into a buffer
        for w in (t for t in leaves if convert and t.untyped_storage()._cdata in self.weights and min(t.shape) > 1):
            for t in outs:
                if t.dtype != w.dtype and t.shape == w.shape and t.untyped_storage()._cdata not in self.weights:
                    self.found.append(f"{func}: a {tuple(w.shape)} {w.dtype} weight copied to {t.dtype}")
        return out


def run_graphs_engine(mode, monkeypatch, weights: str = "bf16") -> dict:
    """Every request of PROMPT_LENS through a graphs engine on fake CUDA; what it did, by kind."""
    model = fake_model(mode, weights)
    stored = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers()) if t.dim() >= 2}
    hazards, counter, syncs, order, reads = Hazards(stored), Launches(), [], [], []
    capturing = []

    @contextlib.contextmanager
    def graph(g, pool=None, **kw):  # torch.cuda.graph: what ran inside a capture
        order.append(("capture", g))
        capturing.append(g)
        try:
            yield
        finally:
            capturing.pop()

    forward = model.forward_layout

    def forward_layout(ids, layout, soft, *a):
        order.append(("captured" if capturing else "eager", ids))
        return forward(ids, layout, soft, *a)

    monkeypatch.setattr(model, "forward_layout", forward_layout)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append("torch.cuda.synchronize"))

    class Stream(FakeCuda):  # (an Event's synchronize is how a settled pass is waited for: allowed)
        def synchronize(self):
            syncs.append("a stream synchronize")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(FakeCuda, "replay", lambda self: order.append(("replay", self)))
    real_wrappers(monkeypatch, counter)
    params = DiffusionEbParams(max_denoising_steps=4, confidence_threshold=0.5)
    with mode, CudaBindings(), PageableCopies() as copies:
        engine = LLMEngine(model, slots=2, max_len=64, pad_id=0, lag=1, graphs=True)
        for rid, n in enumerate(PROMPT_LENS):
            prompt = torch.randint(3, TEXT["vocab_size"], (n,), device=CUDA)
            engine.submit(Request(id=rid, prompt=prompt, params=params, num_blocks=2, seed=rid))
        with host_reads.substituted(substitute_reads(reads)), hazards, counter:
            events = list(engine.events())
    return dict(events=events, hazards=hazards.found + copies.found, syncs=syncs, order=order, launches=counter.names,
                graph_passes=engine.stats["graph_passes"])


@pytest.mark.parametrize("weights,fp8_mode", [("bf16", None), pytest.param("fp8", "weight-only", marks=pytest.mark.slow),
                                              pytest.param("fp8", "dynamic", marks=pytest.mark.slow)])
def test_passes_read_nothing_back_wait_for_nothing_and_copy_no_weight(fake_cuda, monkeypatch, weights, fp8_mode):
    if fp8_mode:
        monkeypatch.setenv("DGEMMA_FP8", fp8_mode)
    got = run_graphs_engine(fake_cuda, monkeypatch, weights)
    kernels = {"triton._gate_up_kernel", "triton._align_kernel", "triton._stats_kernel"} | (
        {"triton._w8a16_kernel"} if fp8_mode == "weight-only" else set())
    assert kernels <= set(got["launches"]), sorted(set(got["launches"]))  # the real wrappers ran
    assert got["hazards"] == [], "\n".join(got["hazards"])
    assert got["syncs"] == []


def test_each_graph_is_captured_after_an_eager_run_of_the_same_pass(fake_cuda, monkeypatch):
    got = run_graphs_engine(fake_cuda, monkeypatch)
    order = got["order"]
    captures = [i for i, (kind, _) in enumerate(order) if kind == "capture"]
    assert captures and got["graph_passes"] > len(captures)  # some passes replay a graph captured before
    for i in captures:
        ids = order[i + 1][1]
        assert order[i + 1][0] == "captured"
        assert any(kind == "eager" and seen is ids for kind, seen in order[:i]), "captured with no warm-up run"
    graphs = [g for kind, g in order if kind == "capture"]
    assert sum(kind == "replay" for kind, _ in order) == got["graph_passes"]
    assert all(any(kind == "replay" and g is seen for kind, seen in order) for g in graphs)
