"""The CUDA path of the engine, run without a GPU on fake CUDA tensors (torch's FakeTensorMode: shapes,
dtypes and devices, no data): a small model whose weights are fake `cuda:0` tensors (bf16, and FP8),
several requests of different prompt lengths through `engine.new_engine` (on CUDA: lag 1, a pass's flags
read a pass late) and with lag 0, with the Triton kernels chosen (their custom ops' fakes run). It fails on:
a host read of a device value inside a pass other than the declared ones (`dgcli/sampling/host_reads.py`;
FakeTensorMode raises DataDependentOutputException where a GPU would sync), a device mix (CPU and CUDA
tensors in one op: FakeTensorDeviceMismatchError), and a GEMM, attention or kernel in a dtype the CUDA
path must not use. Shown to catch a planted `.item()` inside a pass and a planted CPU tensor in attention.
The scaffolding (the fake CUDA runtime, the op log, the fake model) is tests/fake_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from dgcli.kernels import dispatch
from dgcli.model import attention
from dgcli.model.gemma import DiffusionGemma
from dgcli.sampling import host_reads
from dgcli.engine import LLMEngine as Engine, Request, new_engine
from dgcli.sampling.events import Commit, Done, Step
from dgcli.sampling.params import DiffusionEbParams
from fake_cuda import (CUDA, PROMPT_LENS, TEXT, AttentionLog, CudaBindings, FakeCudaMode, FakeTensorDeviceMismatchError,  # noqa: F401
                       OpLog,
                       PageableCopies, check_dtypes, fake_cuda, fake_model, substitute_reads)


def run(mode: FakeCudaMode, lag, model, slots=2):
    """Several requests through the engine on fake CUDA; (events, the host reads made, the op log)."""
    params = DiffusionEbParams(max_denoising_steps=4, confidence_threshold=0.5)
    reads, log = [], OpLog()
    mode.syncs.clear()
    with mode, CudaBindings(), PageableCopies() as copies:
        engine = Engine(model, slots=slots, max_len=64, pad_id=0, lag=lag)
        for rid, n in enumerate(PROMPT_LENS):
            prompt = torch.randint(3, TEXT["vocab_size"], (n,), device=CUDA)
            engine.submit(Request(id=rid, prompt=prompt, params=params, num_blocks=2, seed=rid))
        with host_reads.substituted(substitute_reads(reads)), log, AttentionLog(log):
            events = list(engine.events())
    assert not copies.found, "\n".join(copies.found)  # no host-to-device copy that waits for the device
    # one stop read per pass (every request here can stop early), none other than the declared ones
    assert sum(why == "stop" for why, *_ in reads) == engine.stats["decoder_passes"] > len(PROMPT_LENS)
    # no device-wide wait at all (a pass's timing waits on its own end event, when it is settled)
    assert mode.syncs == []
    return events, reads, log


def check_run(events, reads, n_requests=len(PROMPT_LENS)):
    done = [e for e in events if isinstance(e, Done)]
    assert sorted(e.row for e in done) == list(range(n_requests))
    assert any(isinstance(e, Commit) for e in events) and any(isinstance(e, Step) for e in events)
    assert {why for why, *_ in reads} == {"stop", "commit"}
    for why, shape, dtype, dev in reads:
        assert dtype == (torch.bool if why == "stop" else torch.int64), (why, dtype)
        assert len(shape) == (1 if why == "stop" else 2)


@pytest.mark.parametrize("weights,fp8_mode", [("bf16", None), ("fp8", "weight-only"), ("fp8", "dynamic")])
def test_cuda_engine_runs_on_fake_cuda(fake_cuda, monkeypatch, weights, fp8_mode):
    if fp8_mode:
        monkeypatch.setenv("DGEMMA_FP8", fp8_mode)
    model = fake_model(fake_cuda, weights)
    assert model.embed_weight.device == CUDA
    with fake_cuda:
        assert new_engine(model, slots=2, max_len=64).lag == 1  # what a CUDA model gets
    events, reads, log = run(fake_cuda, 1, model)
    check_run(events, reads)
    # with lag 1 the engine reads its flags from the pinned host copy (made with non_blocking), never the device
    assert all(dev.type == "cpu" for why, _, _, dev in reads if why == "stop")
    if dispatch._triton_ok():  # the Triton kernels' ops ran (Triton ships with torch on Linux x86-64)
        assert {op[0].split(".")[1] for op in log.ops if op[0].startswith("dgemma.")} == {
            "vocab_pass", "experts", "rms_norm", "paged_attention", "router_input", "route", "gelu_mul"} | (
            {"fp8_linear"} if fp8_mode == "weight-only" else {"fp8_quantize"} if fp8_mode else set()) | (
            {"qkv_norm_rope"} if not fp8_mode else set())
    assert any(op[0].startswith("aten._scaled_mm") for op in log.ops) == (fp8_mode == "dynamic")
    check_dtypes(log, weights)


def test_sync_engine_runs_on_fake_cuda(fake_cuda):
    events, reads, log = run(fake_cuda, 0, fake_model(fake_cuda, "bf16"), slots=3)
    check_run(events, reads)
    check_dtypes(log, "bf16")


def test_an_undeclared_host_read_in_a_pass_is_caught(fake_cuda, monkeypatch):
    """A planted `.item()` inside the pass (a host sync on a GPU) fails the run."""
    forward_pass = DiffusionGemma.forward_pass

    def pass_and_read(self, *a, **kw):
        hidden = forward_pass(self, *a, **kw)
        if hidden is not None:
            hidden.float().mean().item()  # e.g. a debugging print of a statistic
        return hidden

    monkeypatch.setattr(DiffusionGemma, "forward_pass", pass_and_read)
    with pytest.raises(DataDependentOutputException):
        run(fake_cuda, 1, fake_model(fake_cuda, "bf16"))


def test_a_cpu_tensor_in_attention_is_caught(fake_cuda, monkeypatch):
    """A planted CPU tensor in the attention call (a mask built on the host) fails the run."""
    reads = attention.PassLayout.reads

    def reads_with_host_mask(self, *a):
        runs, mask = reads(self, *a)
        s = self.segments[a[0]]
        keys = sum(b - a for a, b in runs) + (s.length if a[1] != "full" else 0)  # a ring: its own keys too
        return runs, torch.ones(s.length, keys, dtype=torch.bool)  # on the CPU

    monkeypatch.setattr(attention.PassLayout, "reads", reads_with_host_mask)
    monkeypatch.setattr(attention, "backend", lambda device: "torch-sdpa")
    with pytest.raises(FakeTensorDeviceMismatchError):
        run(fake_cuda, 1, fake_model(fake_cuda, "bf16"))


def test_host_reads_are_declared():
    """A read must name a declared reason; outside a substitution it is the tensor's values."""
    assert host_reads.read(torch.tensor([True, False]), "stop") == [True, False]
    with pytest.raises(ValueError, match="undeclared host read"):
        host_reads.read(torch.zeros(1), "debug")
