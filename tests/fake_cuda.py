"""Fake CUDA for tests: torch's FakeTensorMode (shapes, dtypes and devices, no data) with the CUDA runtime
calls patched, so the CUDA path (engine passes, the server's worker, bench) runs on a CPU-only machine
(tests/sampling/test_fake_cuda.py says what the runs check and why each piece exists).

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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dgcli.model import fp8
from dgcli.checkpoint.config import parse_config
from dgcli.model.fuse import fuse_projections
from dgcli.model.gemma import DiffusionGemma
from dgcli.checkpoint.meta import meta_model
from dgcli.checkpoint.random_weights import make_config, with_fp8

try:  # torch 2.13 (the pinned CPU build)
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
except ImportError:  # torch 2.11 (the GPU machines' image) has no such class: it raises a plain RuntimeError
    FakeTensorDeviceMismatchError = RuntimeError  # ("Unhandled FakeTensor Device Propagation ...", seen on an H200)

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
    """What the engine uses of torch.cuda's Event, Stream and CUDAGraph (no CUDA runtime to record, wait or
    capture on): each call does nothing. A "captured" step would run eagerly on fake tensors, so a host read
    inside it (which would break a real capture) fails the run as anywhere else."""

    def __init__(self, *a, **kw):
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

    def pool(self):
        return None


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
        for counter in _COUNTING:  # an index_put_ / copy_, or an advanced index: one launch each on a GPU
            if func is torch.Tensor.__setitem__ or any(isinstance(t, (torch.Tensor, list)) for t in parts):
                counter.names.append("aten.index_put_" if func is torch.Tensor.__setitem__ else "aten.index")
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


def fake_model(mode: FakeTensorMode, weights: str, text: dict = TEXT, canvas: int = CANVAS) -> DiffusionGemma:
    """The model with every parameter and buffer a fake bf16 (FP8: e4m3 + bf16 scales) CUDA tensor, built
    as `random_weights.random_model` builds one (on meta, then allocated), values never drawn."""
    cfg_dict = make_config(text, canvas)
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
        fuse_projections(model)  # as a CUDA session does at load
    return model.eval()


def substitute_reads(log: list):
    """Values for the declared host reads: the stop flags say "stop" at every third read (early stops, so
    the engine at lag 1 discards speculative steps), the commits give token 5 everywhere (never a stop id)."""
    def read(t, why):
        log.append((why, tuple(t.shape), t.dtype, t.device))
        if why == "stop":
            return [len(log) % 3 == 0] * t.shape[0]
        if why == "draft":  # a step's ids, accepted mask, entropies and mean entropy, flat (serve/worker.py)
            return [5.0] * t.shape[0]
        return [[5] * t.shape[1] for _ in range(t.shape[0])]
    return read


def check_dtypes(log: OpLog, weights: str) -> None:
    """Every GEMM, attention and kernel op on CUDA, its floats bf16 or fp32 (FP8 weights: e4m3 too), its
    outputs bf16 (the vocabulary pass: its fp32 entropies too; the router: its fp32 weights); every op's outputs in a dtype the CUDA path
    uses (float16: `kernels/fp8.py::fp8_over_256` views e4m3 bits as float16; float64: the draws' uniforms)."""
    allowed = {torch.bfloat16, torch.float32, torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool,
               torch.float64} | ({torch.float16, torch.float8_e4m3fn} if weights == "fp8" else set())
    gemms = [op for op in log.ops if op[0].startswith(GEMMS) and not op[3]]
    attention = ("aten.scaled_dot_product", "dgemma.paged_attention")
    assert any(op[0].startswith(attention) for op in gemms) and len(gemms) > 10, len(gemms)
    for name, ins, outs, _ in gemms:
        vocab = name.startswith("dgemma.vocab_pass")  # fp64 uniforms in, fp32 entropies out
        assert all(d == CUDA for _, d in ins + outs), (name, ins, outs)
        floats = {torch.bfloat16, torch.float32, torch.float8_e4m3fn} | ({torch.float64} if vocab else set())
        assert {dt for dt, _ in ins + outs if dt.is_floating_point} <= floats, (name, ins)
        fp32_out = vocab or name.startswith("dgemma.route.")  # fp32 entropies, fp32 routing weights (as the reference)
        quant = name.startswith("dgemma.fp8_quantize.")  # e4m3 activations and their fp32 scales
        assert {dt for dt, _ in outs} <= {torch.bfloat16, torch.int64} | ({torch.float32} if fp32_out else set()) | (
            {torch.float8_e4m3fn, torch.float32} if quant else set()), (name, outs)
        if name.startswith("dgemma.paged_attention"):  # queries, pools, new keys and the output bf16; metadata int32
            assert {dt for dt, _ in ins} == {torch.bfloat16, torch.int32}, ins
    for name, _, outs, _ in log.ops:
        assert {dt for dt, _ in outs} <= allowed, (name, outs)


def _on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class PageableCopies(TorchFunctionMode):
    """Host-to-device copies that wait: `torch.tensor(host data, device=cuda)` / `torch.as_tensor(...)`, and a
    CPU tensor sent to CUDA by `.to`, `.cuda` or `.copy_` without non_blocking. On a GPU each copies from
    pageable memory and first waits for the stream to drain (a host sync with the pass in flight); the way
    without a wait is `kernels/transfer.py: to_device` (a pinned buffer, non_blocking). `found` lists them (a scalar
    argument to an op is not a copy: torch passes it by value)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def _found(self, what: str) -> None:
        import traceback

        where = next((f"{fr.filename.split('/dgcli/')[-1]}:{fr.lineno}" for fr in reversed(traceback.extract_stack())
                      if "/dgcli/" in fr.filename), "?")
        self.found.append(f"{what} at {where}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in (torch.tensor, torch.as_tensor) and _on_cuda(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if not (isinstance(data, torch.Tensor) and data.device.type == "cuda"):
                self._found(f"torch.{name}(host data, device={kwargs['device']})")
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and args and isinstance(args[0], torch.Tensor):
            src = args[0]
            dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            if func is torch.Tensor.cuda:
                dev = "cuda"
            if src.device.type == "cpu" and _on_cuda(dev) and not kwargs.get("non_blocking", False):
                self._found(f"Tensor.{name}(cuda) of a {tuple(src.shape)} CPU tensor without non_blocking")
        elif func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            if dst.device.type == "cuda" and src.device.type == "cpu" and not (
                    kwargs.get("non_blocking", False) or (len(args) > 2 and args[2])):
                self._found(f"Tensor.copy_ of a {tuple(src.shape)} CPU tensor into CUDA without non_blocking")
        return func(*args, **kwargs)


_FREE = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided", "aten.lift_fresh",
         "aten._local_scalar_dense", "aten._unsafe_view")  # allocation and bookkeeping: no kernel


_COUNTING: list = []  # the active Launches


class Launches(TorchDispatchMode):
    """Counts what a CUDA stream would run: every aten op on a CUDA tensor that is not a view or an allocation
    (one kernel or copy each, as eager CUDA launches them; a composite op counts once, as its CUDA kernel), and
    every Triton launch inside our custom ops, whose real wrappers run (`real_wrappers`) with the launch itself
    stubbed (recorded, nothing computed: the tensors are fake). `names` lists them in order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.on = False

    def __enter__(self):
        self.on = True
        _COUNTING.append(self)  # CudaBindings' indexing counts too
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        _COUNTING.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        cuda = any(t.device.type == "cuda" for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor))
        if cuda and not view and name.startswith(("aten.", "dgemma.")) and not name.startswith(_FREE):
            self.names.append(name)
        return out


def real_wrappers(monkeypatch, counter: Launches) -> None:
    """Our custom ops (`torch.ops.dgemma.*`) run their real Python wrappers instead of their fakes, with every
    Triton launch (plain or autotuned) recorded in `counter` and not run."""
    from triton.runtime import jit

    from dgcli.kernels import ops

    def launcher(self, grid):  # kernel[grid](...) of a jitted, interpreted or autotuned kernel
        fn = getattr(self, "fn", self)
        name = "triton." + getattr(fn, "__name__", str(fn))
        return lambda *args, **kwargs: counter.names.append(name) if counter.on else None

    monkeypatch.setattr(jit.KernelInterface, "__getitem__", launcher)
    for name in ("rms_norm", "experts", "fp8_linear", "fp8_quantize", "vocab_pass", "paged_attention", "qkv_norm_rope",
                 "gelu_mul"):
        op = getattr(ops, "_" + name)
        monkeypatch.setattr(torch.ops.dgemma, name, op._init_fn)
