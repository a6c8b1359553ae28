"""The CUDA path of the engine, run without a GPU on fake CUDA tensors (torch's FakeTensorMode: shapes,
dtypes and devices, no data): a small model whose weights are fake `cuda:0` tensors (bf16, and FP8),
several requests of different prompt lengths through `async_stop.new_engine` (the CUDA engine, async stop)
and the synchronous `Engine`, with the Triton kernels chosen (their custom ops' fakes run). It fails on:
a host read of a device value inside a pass other than the declared ones (`dgcli/sampling/host_reads.py`;
FakeTensorMode raises DataDependentOutputException where a GPU would sync), a device mix (CPU and CUDA
tensors in one op: FakeTensorDeviceMismatchError), and a GEMM, attention or kernel in a dtype the CUDA
path must not use. Shown to catch a planted `.item()` inside a pass and a planted CPU tensor in attention.

Test scaffolding, not dgemma logic: torch.cuda's synchronize, Event, streams, CUDA graphs and
get_device_capability are patched (a CPU-only torch has no CUDA runtime; an H100's capability is
reported), and `CudaBindings` does Tensor.__getitem__ / __setitem__'s shape work on meta twins (and sends
Tensor.copy_ to its aten op): a CPU-only torch has no CUDA device guard, which those C++ bindings take
before any op runs, so indexing or copying into a fake CUDA tensor fails there (on a GPU they run ops the
fake mode checks like any other).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, FakeTensorDeviceMismatchError,
                                           FakeTensorMode)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dgcli.kernels import dispatch
from dgcli.model import fp8
from dgcli.model.config import parse_config
from dgcli.model.gemma import Attention, DiffusionGemma
from dgcli.model.loader import meta_model
from dgcli.model.random_weights import make_config, with_fp8
from dgcli.sampling import host_reads
from dgcli.sampling.async_stop import AsyncStopEngine, new_engine
from dgcli.sampling.engine import Engine, Request
from dgcli.sampling.events import Commit, Done, Step
from dgcli.sampling.params import DiffusionEbParams

CUDA = torch.device("cuda", 0)
S, F = "sliding_attention", "full_attention"
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=8,
            global_head_dim=16, num_experts=4, top_k_experts=2, sliding_window=6, layer_types=[S, F],
            max_position_embeddings=4096)
CANVAS = 16
PROMPT_LENS = (3, 9, 14, 5)  # more requests than slots: some join while others run
GEMMS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._scaled_mm", "aten.scaled_dot_product",
         "dgemma.")  # matmuls, attention, and the Triton kernels' ops


class FakeCuda:
    """What the engine and the static step use of torch.cuda's Event, Stream and CUDAGraph (no CUDA runtime
    to record, wait or capture on): each call does nothing. A "captured" step runs eagerly on fake tensors,
    so a host read inside it (which would break a real capture) fails the run as anywhere else."""

    def __init__(self, **kw):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0

    def wait_stream(self, other):
        pass

    def replay(self):
        pass


def _meta_twin(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, list) and all(isinstance(y, int) for y in x):  # an index list: torch makes it a tensor
        return _meta_twin(torch.tensor(x))
    if isinstance(x, tuple):
        return tuple(_meta_twin(y) for y in x)
    return x


class CudaBindings(TorchFunctionMode):
    """Indexing of fake CUDA tensors, as shapes: the index (or the assignment) runs on meta twins and a
    getitem returns a fresh fake CUDA tensor of the result's shape and strides (no data exists to alias);
    Tensor.copy_ into one goes straight to its aten op. Refused as device mixes, though torch would copy
    them over silently (each a hidden host-to-device copy): a CPU index tensor, a CPU value of more than
    one element. Index lists (host data by nature) pass."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and args[0].device.type == "cuda":  # the binding takes the guard too
            return torch.ops.aten.copy_.default(*args, **kwargs)
        if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) or args[0].device.type != "cuda":
            return func(*args, **kwargs)
        self_, idx, value = args[0], args[1], args[2] if len(args) > 2 else None
        parts = idx if isinstance(idx, tuple) else (idx,)
        host = [t for t in parts if isinstance(t, torch.Tensor) and t.device != self_.device]
        if isinstance(value, torch.Tensor) and value.device != self_.device and value.numel() > 1:
            host.append(value)
        if host:
            raise FakeTensorDeviceMismatchError(f"indexing a {self_.device} tensor with {host[0].device} tensors")
        twin = _meta_twin(self_)
        if func is torch.Tensor.__setitem__:
            twin[_meta_twin(idx)] = _meta_twin(value)
            return None
        out = twin[_meta_twin(idx)]
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=self_.device)


def _tensors(x) -> list:
    return [(t.dtype, t.device) for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class OpLog(TorchDispatchMode):
    """Every aten op (composite ones too, after their parts) and custom op with its tensor inputs' and
    outputs' dtypes and devices, and whether it ran inside scaled_dot_product_attention (`AttentionLog`)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list, list, bool]] = []
        self.sdpa = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = NotImplemented
        if func.namespace == "aten":
            with self:  # a composite op's parts, as the fake mode sees them without this mode
                out = func.decompose(*args, **kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        self.ops.append((str(func), _tensors((args, kwargs)), _tensors(out), self.sdpa > 0))
        return out


class AttentionLog(TorchFunctionMode):
    """F.scaled_dot_product_attention's own inputs and outputs into an OpLog. Without a GPU no fused kernel
    can be chosen, so SDPA runs as its math decomposition (in fp32): the ops inside are marked, and SDPA's
    own dtypes are what the CUDA path is checked on."""

    def __init__(self, log: OpLog):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.log.sdpa += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.log.sdpa -= 1
        self.log.ops.append(("aten.scaled_dot_product_attention", _tensors((args, kwargs)), _tensors(out), False))
        return out


class FakeCudaMode(FakeTensorMode):
    """A FakeTensorMode that also keeps the devices torch.cuda.synchronize was called with (a host wait)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=False)
        self.syncs: list = []


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeCudaMode (entered by `run`), the CUDA runtime calls patched, DGEMMA_KERNELS=auto."""
    mode = FakeCudaMode()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: mode.syncs.append(device))
    for name in ("Event", "Stream", "CUDAGraph"):
        monkeypatch.setattr(torch.cuda, name, FakeCuda)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeCuda())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, **kw: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("DGEMMA_KERNELS", raising=False)
    return mode


def fake_model(mode: FakeTensorMode, weights: str) -> DiffusionGemma:
    """The model with every parameter and buffer a fake bf16 (FP8: e4m3 + bf16 scales) CUDA tensor, built
    as `random_weights.random_model` builds one (on meta, then allocated), values never drawn."""
    cfg_dict = make_config(TEXT, CANVAS)
    cfg = parse_config(with_fp8(cfg_dict) if weights == "fp8" else cfg_dict)
    model = meta_model(cfg)
    model.to(torch.bfloat16)
    if cfg.quantization is not None:
        fp8.convert_(model, *fp8.targets(model), torch.bfloat16)
    with mode:  # module.to_empty swaps tensors, which fake tensors refuse: each one replaced instead
        for m in model.modules():
            for reg in (m._parameters, m._buffers):
                for k, v in reg.items():
                    if v is not None:
                        t = torch.empty(v.shape, dtype=v.dtype, device=CUDA)
                        reg[k] = torch.nn.Parameter(t, requires_grad=False) if isinstance(v, torch.nn.Parameter) else t
    return model.eval()


def substitute_reads(log: list):
    """Values for the declared host reads: the stop flags say "stop" at every third read (early stops, so
    the async engine discards speculative steps), the commits give token 5 everywhere (never a stop id)."""
    def read(t, why):
        log.append((why, tuple(t.shape), t.dtype, t.device))
        if why == "stop":
            return [len(log) % 3 == 0] * t.shape[0]
        return [[5] * t.shape[1] for _ in range(t.shape[0])]
    return read


def run(mode: FakeCudaMode, engine_cls, model, slots=2, step_mode="dynamic"):
    """Several requests through the engine on fake CUDA; (events, the host reads made, the op log)."""
    params = DiffusionEbParams(max_denoising_steps=4, confidence_threshold=0.5)
    reads, log = [], OpLog()
    mode.syncs.clear()
    with mode, CudaBindings():
        engine = engine_cls(model, slots=slots, max_len=64, pad_id=0, step_mode=step_mode)
        for rid, n in enumerate(PROMPT_LENS):
            prompt = torch.randint(3, TEXT["vocab_size"], (n,), device=CUDA)
            engine.submit(Request(id=rid, prompt=prompt, params=params, num_blocks=2, seed=rid))
        with host_reads.substituted(substitute_reads(reads)), log, AttentionLog(log):
            events = list(engine.events())
    # one stop read per pass (every request here can stop early), none other than the declared ones
    assert sum(why == "stop" for why, *_ in reads) == engine.stats["decoder_passes"] > len(PROMPT_LENS)
    # a device wait after each prefill and commit only (their timings), never inside a decoder pass
    assert mode.syncs == [CUDA] * engine.stats["encoder_passes"]
    return events, reads, log


def check_dtypes(log: OpLog, weights: str) -> None:
    """Every GEMM, attention and kernel op on CUDA, its floats bf16 or fp32 (FP8 weights: e4m3 too), its
    outputs bf16 (the vocabulary pass: its fp32 entropies too); every op's outputs in a dtype the CUDA path
    uses (float16: `kernels/fp8.py::fp8_over_256` views e4m3 bits as float16; float64: the draws' uniforms)."""
    allowed = {torch.bfloat16, torch.float32, torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool,
               torch.float64} | ({torch.float16, torch.float8_e4m3fn} if weights == "fp8" else set())
    gemms = [op for op in log.ops if op[0].startswith(GEMMS) and not op[3]]
    assert any(op[0].startswith("aten.scaled_dot_product") for op in gemms) and len(gemms) > 10, gemms
    for name, ins, outs, _ in gemms:
        vocab = name.startswith("dgemma.vocab_pass")  # fp64 uniforms in, fp32 entropies out
        assert all(d == CUDA for _, d in ins + outs), (name, ins, outs)
        floats = {torch.bfloat16, torch.float32, torch.float8_e4m3fn} | ({torch.float64} if vocab else set())
        assert {dt for dt, _ in ins + outs if dt.is_floating_point} <= floats, (name, ins)
        assert {dt for dt, _ in outs} <= {torch.bfloat16, torch.int64} | ({torch.float32} if vocab else set()), \
            (name, outs)
    for name, _, outs, _ in log.ops:
        assert {dt for dt, _ in outs} <= allowed, (name, outs)


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
        assert type(new_engine(model, slots=2, max_len=64)) is AsyncStopEngine  # what a CUDA model gets
    events, reads, log = run(fake_cuda, AsyncStopEngine, model)
    check_run(events, reads)
    # the async engine reads its flags from the pinned host copy (made with non_blocking), never the device
    assert all(dev.type == "cpu" for why, _, _, dev in reads if why == "stop")
    if dispatch._triton_ok():  # the Triton kernels' ops ran (Triton ships with torch on Linux x86-64)
        assert {op[0].split(".")[1] for op in log.ops if op[0].startswith("dgemma.")} == {
            "vocab_pass", "experts", "rms_norm"}
    assert any(op[0].startswith("aten._scaled_mm") for op in log.ops) == (fp8_mode == "dynamic")
    check_dtypes(log, weights)


def test_sync_engine_runs_on_fake_cuda(fake_cuda):
    events, reads, log = run(fake_cuda, Engine, fake_model(fake_cuda, "bf16"), slots=3)
    check_run(events, reads)
    check_dtypes(log, "bf16")


@pytest.mark.parametrize("step_mode", ["static", "graphs"])
def test_static_step_runs_on_fake_cuda(fake_cuda, step_mode):
    """The static-shape step, eager and as CUDA graphs (captured and replayed as fakes: the capture itself
    cannot be faked, what runs inside it is)."""
    events, reads, log = run(fake_cuda, AsyncStopEngine, fake_model(fake_cuda, "bf16"), step_mode=step_mode)
    check_run(events, reads)
    check_dtypes(log, "bf16")


def test_an_undeclared_host_read_in_a_pass_is_caught(fake_cuda, monkeypatch):
    """A planted `.item()` inside the decoder pass (a host sync on a GPU) fails the run."""
    decode = DiffusionGemma.decode

    def decode_and_read(self, *a, **kw):
        hidden = decode(self, *a, **kw)
        hidden.float().mean().item()  # e.g. a debugging print of a statistic
        return hidden

    monkeypatch.setattr(DiffusionGemma, "decode", decode_and_read)
    with pytest.raises(DataDependentOutputException):
        run(fake_cuda, AsyncStopEngine, fake_model(fake_cuda, "bf16"))


def test_a_cpu_tensor_in_attention_is_caught(fake_cuda, monkeypatch):
    """A planted CPU tensor in the attention call (a mask built on the host) fails the run."""
    sdpa = Attention.sdpa

    def sdpa_with_host_mask(q, k, v, mask):
        host = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)  # on the CPU
        return sdpa(q, k, v, host if mask is None else mask.cpu())

    monkeypatch.setattr(Attention, "sdpa", staticmethod(sdpa_with_host_mask))
    with pytest.raises(FakeTensorDeviceMismatchError):
        run(fake_cuda, AsyncStopEngine, fake_model(fake_cuda, "bf16"))


def test_host_reads_are_declared():
    """A read must name a declared reason; outside a substitution it is the tensor's values."""
    assert host_reads.read(torch.tensor([True, False]), "stop") == [True, False]
    with pytest.raises(ValueError, match="undeclared host read"):
        host_reads.read(torch.zeros(1), "debug")
