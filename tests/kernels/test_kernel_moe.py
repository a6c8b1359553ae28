"""Routed experts: kernels/reference_ops.py::experts_reference equals the model's Experts.forward; the CPU
segments path (torch's grouped GEMM, kernels/moe_cpu.py) and the Triton kernels (kernels/moe.py: compiled on a GPU, interpreted on
CPU without one, as tests/conftest.py decides) equal the reference."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from dgcli.kernels.moe_cpu import experts_segments
from dgcli.kernels.reference_ops import experts_reference

needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed (Linux x86-64 only)")

# (dtype, atol, rtol): fp32 — only the GEMM's accumulation order differs (batched vs per-expert GEMM,
# or tl.dot): a few fp32 ulps of O(1) values. bf16 — the same, after which the GEMM output is rounded to
# bf16, so an element may land one bf16 ulp away (2^-8 relative) and carry that through the sum.
TOLS = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2**-7)]


def make(n, h, inter, e, k, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    logits = torch.randn(n, e, generator=g)
    if skew:  # most tokens pick the same experts: very uneven groups, some experts never picked
        logits[:, :k] += 10
    w, idx = torch.softmax(logits, -1).topk(k, -1)
    w = w * (torch.rand(e, generator=g) + 0.5)[idx]  # like per_expert_scale: weights no longer sum to 1
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    down = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    return x, w, idx, gate_up, down


def test_reference_equals_the_model_experts():
    from dgcli.model.gemma import Experts

    x, w, idx, gate_up, down = make(9, 16, 8, 5, 2, torch.bfloat16)
    mod = Experts.__new__(Experts)
    torch.nn.Module.__init__(mod)
    mod.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(down, requires_grad=False)
    assert torch.equal(experts_reference(x, w, idx, gate_up, down), mod(x, w, idx))


# (N, H, I, E, k): a single token, experts with zero tokens (E > N·k), N not a multiple of any block,
# odd widths, k = 1.
SHAPES = [(1, 16, 8, 4, 2), (5, 24, 20, 12, 2), (33, 32, 16, 8, 3), (17, 20, 12, 6, 1)]


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("n,h,inter,e,k", SHAPES)
@pytest.mark.parametrize("skew", [False, True])
def test_segments_cpu_matches_reference(dtype, atol, rtol, n, h, inter, e, k, skew):
    x, w, idx, gate_up, down = make(n, h, inter, e, k, dtype, skew=skew)
    got = experts_segments(x, w, idx, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, experts_reference(x, w, idx, gate_up, down), atol=atol, rtol=rtol)


def test_segments_cpu_order_and_empty_input():
    x, w, idx, gate_up, down = make(64, 16, 8, 6, 4, torch.bfloat16, seed=2)
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(0))
    want = experts_reference(x, w, idx, gate_up, down)
    assert torch.equal(experts_segments(x, w[:, perm], idx[:, perm], gate_up, down), want)
    assert experts_segments(x[:0], w[:0], idx[:0], gate_up, down).shape == (0, 16)


@pytest.mark.slow
def test_segments_cpu_compiles_without_a_graph_break():
    """`--compile` on a bf16 model: the segments path inside a full graph equals the reference."""
    x, w, idx, gate_up, down = make(64, 32, 16, 8, 2, torch.bfloat16)
    got = torch.compile(experts_segments, fullgraph=True, dynamic=False)(x, w, idx, gate_up, down)
    torch.testing.assert_close(got, experts_reference(x, w, idx, gate_up, down), atol=2e-2, rtol=2**-7)


@needs_triton
@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("n,h,inter,e,k", SHAPES)
def test_triton_matches_reference(dtype, atol, rtol, n, h, inter, e, k, triton_device):
    from dgcli.kernels.moe import experts_triton

    x, w, idx, gate_up, down = make(n, h, inter, e, k, dtype)
    got = experts_triton(*(t.to(triton_device) for t in (x, w, idx, gate_up, down)), block_m=16, block_n=16, block_k=16)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.cpu(), experts_reference(x, w, idx, gate_up, down), atol=atol, rtol=rtol)


@needs_triton
def test_triton_uneven_groups(triton_device):
    from dgcli.kernels.moe import experts_triton

    x, w, idx, gate_up, down = make(40, 16, 8, 10, 2, torch.bfloat16, skew=True)
    got = experts_triton(*(t.to(triton_device) for t in (x, w, idx, gate_up, down)), block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got.cpu(), experts_reference(x, w, idx, gate_up, down), atol=2e-2, rtol=2**-7)


@needs_triton
def test_tuned_tiles_change_no_bits(triton_device):
    """Every autotuned configuration (kernels/moe.py::TUNE: BLOCK_M 64 and 128, each BLOCK_N, warps, stages) gives
    the fixed tile's bits, since BLOCK_K, which cuts each output's k chain, is the same in all: the autotuner's
    pick, and the batch (BLOCK_M follows it), cannot change a token's output. On CUDA this checks the claim the
    tuned path rests on; the interpreter ignores warps and stages and checks the row and column tiling."""
    from dgcli.kernels.moe import BLOCK, TUNE, experts_triton

    x, w, idx, gate_up, down = make(70, 96, 80, 6, 2, torch.bfloat16, seed=4)  # H, I not multiples of a tile
    args = [t.to(triton_device) for t in (x, w, idx, gate_up, down)]
    want = experts_triton(*args, block_m=BLOCK)
    torch.testing.assert_close(want.cpu(), experts_reference(x, w, idx, gate_up, down), atol=2e-2, rtol=2**-7)
    for bm, tiles in TUNE.items():
        for bn, warps, stages in tiles:
            got = experts_triton(*args, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            assert torch.equal(got, want), (bm, bn, warps, stages)


@needs_triton
@pytest.mark.parametrize("n,h,inter,e,k", [(40, 32, 16, 128, 8), (3, 2816, 704, 2, 2)], ids=["experts", "widths"])
def test_triton_at_the_released_shapes(n, h, inter, e, k, triton_device):
    """The released config's routing (128 experts, top-8; ~2.5 pairs an expert here, most experts empty) and its
    widths (H 2816, I 704: 44 and 11 k blocks; 2 experts, as each costs the interpreter ~4 s here and all 128
    would hold 1.5 GB), bf16, default tiles (the tuned path on CUDA), against the reference."""
    from dgcli.kernels.moe import experts_triton

    x, w, idx, gate_up, down = make(n, h, inter, e, k, torch.bfloat16, seed=5)
    got = experts_triton(*(t.to(triton_device) for t in (x, w, idx, gate_up, down)))
    torch.testing.assert_close(got.cpu(), experts_reference(x, w, idx, gate_up, down), atol=2e-2, rtol=2**-7)


@needs_triton
def test_the_tuned_path_runs_its_autotuner(monkeypatch, triton_device):
    """The autotuned launch (kernels/moe.py::_tuned: grid by the chosen BLOCK_N, the key, each configuration timed),
    made to run where the tests do: in the interpreter with a host timer standing in for CUDA events. Its output
    is the fixed tile's, bit for bit, at both BLOCK_Ms."""
    import time

    from dgcli.kernels import moe

    timed = []  # (H, I, BLOCK_M) of each timing run: the autotuner ran for every key

    def host_bench(call, quantiles):
        t0 = time.perf_counter()
        call()
        timed.append(t0)
        return [time.perf_counter() - t0] * len(quantiles)

    monkeypatch.setattr(moe, "_tuning", lambda x, dynamic, explicit: not explicit)
    monkeypatch.setattr(moe, "_BENCH", host_bench)
    monkeypatch.setattr(moe, "_TUNED", {})
    x, w, idx, gate_up, down = make(40, 48, 40, 4, 2, torch.bfloat16, seed=6)  # 80 pairs: 20 an expert
    args = [t.to(triton_device) for t in (x, w, idx, gate_up, down)]
    want = moe.experts_triton(*args, block_m=moe.BLOCK, block_n=moe.BLOCK)  # explicit: the fixed tile
    for bm in moe.TUNE:
        assert torch.equal(moe.experts_triton(*args, block_m=bm), want)
    assert torch.equal(moe.experts_triton(*args), want)  # block_rows' choice: 64 rows
    # two kernels at two BLOCK_Ms, each timed over all its configurations once (then cached)
    assert len(timed) == 2 * sum(len(tiles) for tiles in moe.TUNE.values()), len(timed)


def test_block_rows():
    pytest.importorskip("triton")
    from dgcli.kernels.moe import block_rows

    assert [block_rows(p, 128) for p in (8, 2048, 8192, 8193, 16384)] == [64, 64, 64, 128, 128]


@pytest.mark.parametrize("fn", ["group_by_expert", "group_by_expert_reference"])
def test_group_by_expert_layout(fn, triton_device):
    pytest.importorskip("triton")
    from dgcli.kernels import moe, reference_ops

    flat = torch.tensor([2, 0, 2, 2, 0, 3], device=triton_device)  # expert 1 has no pairs
    pair_of_slot, block_expert = getattr(moe if fn == "group_by_expert" else reference_ops, fn)(flat, 4, 2)
    # expert 0: pairs 1, 4 | expert 2: pairs 0, 2, 3 (+1 pad) | expert 3: pair 5 (+1 pad) | unused tail
    assert pair_of_slot[:8].tolist() == [1, 4, 0, 2, 3, -1, 5, -1]
    assert block_expert.tolist()[:4] == [0, 2, 2, 3] and all(b == -1 for b in block_expert.tolist()[4:])
    assert (pair_of_slot[8:] == -1).all()


@pytest.mark.parametrize("nk,e,bm", [(16 * 8, 128, 64), (300 * 8, 128, 64), (1000 * 8, 128, 128), (77, 6, 16)])
def test_group_by_expert_kernel_equals_reference(nk, e, bm, triton_device):
    """The one-launch align kernel lays the pairs out exactly as the torch ops (a stable sort by expert)."""
    pytest.importorskip("triton")
    from dgcli.kernels.moe import group_by_expert
    from dgcli.kernels.reference_ops import group_by_expert_reference

    flat = torch.randint(0, e, (nk,), generator=torch.Generator().manual_seed(nk)).to(triton_device)
    for got, want in zip(group_by_expert(flat, e, bm), group_by_expert_reference(flat, e, bm)):
        assert torch.equal(got, want)
