"""Every Triton kernel of kernels/ compiled ahead of time for sm_90 (H100/H200) and sm_80 (A100) without a GPU
(benchmarks/kernel_targets.py): each configuration the CUDA launch wrappers can launch compiles, fits the
block's shared memory, keeps its tensor-core instruction where it means one, and does not spill. Deliberately
bad configurations show the checks catch an overflow and a lost tensor core. All configurations compile once
per module, in one child process without TRITON_INTERPRET (under it the kernel modules hold interpreted
functions, which triton.compile cannot take); Triton's on-disk cache makes later runs take seconds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")  # a dependency on Linux x86-64 only; it ships ptxas and cuobjdump

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_targets.py"
_spec = importlib.util.spec_from_file_location("kernel_targets", SCRIPT)
kt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kt)

CONFIGS = kt.configs()
_spec = importlib.util.spec_from_file_location("kernel_floor", SCRIPT.with_name("kernel_floor.py"))
kf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kf)


def _bad_configs() -> dict[str, dict]:
    """Real kernels launched wrongly: what a careless tile or flag change would do."""
    soft = next(c for c in CONFIGS if c["kernel"] == "vocab_pass._soft_kernel" and c["label"] == "bf16 64x64 w4 s3"
                and c["target"] == "sm_90")
    big = dict(soft["constexprs"], BLOCK_N=256, BLOCK_K=256)  # 3 stages of [64, 256] + [256, 256] bf16 tiles
    fp32_dot = dict(soft["constexprs"], DOT_BF16=False)  # bf16 data, but full-precision fp32 products
    fp8_a100 = next(c for c in CONFIGS if c["kernel"] == "moe._gate_up_kernel" and c["label"] == "bf16 fp8-dyn s=bf16")
    small = dict(soft["constexprs"], BLOCK_M=16)  # below a warp group's 64 rows: Triton falls back to mma.sync
    return {
        "overflow-sm_90": dict(soft, constexprs=big, label="bad: 64x256x256"),
        "overflow-sm_80": dict(soft, constexprs=big, target="sm_80", label="bad: 64x256x256"),
        "no-tensor-core-sm_90": dict(soft, constexprs=fp32_dot, label="bad: fp32 dot"),
        "no-tensor-core-sm_80": dict(soft, constexprs=fp32_dot, target="sm_80", label="bad: fp32 dot"),
        "fp8-on-sm_80": dict(fp8_a100, target="sm_80"),
        "mma-sync-on-sm_90": dict(soft, constexprs=small, label="bad: BLOCK_M 16"),
    }


@pytest.fixture(scope="module")
def compiled():
    bad = _bad_configs()
    done = kt.compile_configs(CONFIGS + list(bad.values()))
    return done[:len(CONFIGS)], dict(zip(bad, done[len(CONFIGS):]))


def _id(c: dict) -> str:
    return f"{c['target']}-{c['kernel'].split('.')[1].strip('_')}-{c['label'].replace(' ', '_')}"


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[_id(c) for c in CONFIGS])
def test_every_launchable_configuration_compiles_fits_and_keeps_its_tensor_cores(compiled, i):
    c = compiled[0][i]
    assert not kt.problems(c), (c["kernel"], c["target"], c["label"], kt.problems(c), c["result"])


def test_the_matrix_covers_every_kernel_on_both_targets():
    kernels = {"fused._rms_norm_kernel", "moe._gate_up_kernel", "moe._down_kernel", "vocab_pass._stats_kernel",
               "vocab_pass._soft_kernel", "vocab_pass._combine_kernel", "vocab_pass._group_logits_kernel",
               "fp8_linear._w8a16_kernel", "fused._qkv_norm_rope_kernel", "fused._gelu_mul_kernel",
               "fused._router_input_kernel", "fused._route_kernel", "moe._combine_kernel", "moe._align_kernel",
                "vocab_pass._probs_kernel", "fp8_linear._quant_kernel", "nvfp4_triton._w4a16_kernel",
               "paged_attention._paged_attention_kernel", "paged_attention._combine_kernel"}
    assert {(c["kernel"], c["target"]) for c in CONFIGS} == {(k, t) for k in kernels for t in kt.TARGETS}
    # The dtypes and paths the wrappers launch: bf16 / fp32 everywhere, FP8 experts (both semantics) on sm_90,
    # weight-only on sm_80 too; the W8A16 linear (e4m3 bytes decoded in the kernel) on both targets.
    moe = {t: {c["label"] for c in CONFIGS if c["kernel"] == "moe._gate_up_kernel" and c["target"] == t}
           for t in kt.TARGETS}
    assert {"bf16", "fp32", "bf16 fp8-w s=bf16", "fp32 fp8-w s=fp32", "bf16 fp8-dyn s=fp32"} <= moe["sm_90"]
    assert {"bf16 fp8-w s=bf16", "bf16 fp8-w s=fp32", "fp32 fp8-w s=fp32"} <= moe["sm_80"]
    assert not any("fp8-dyn" in label for label in moe["sm_80"])
    w8 = {(c["target"], c["label"].split()[0]) for c in CONFIGS if c["kernel"] == "fp8_linear._w8a16_kernel"}
    assert w8 == {(t, dt) for t in kt.TARGETS for dt in ("bf16", "fp32")}
    # CUDA's constexprs, not the interpreter's: bf16 dots on the tensor cores.
    assert all(c["constexprs"]["DOT_BF16"] for c in CONFIGS if c["label"].startswith("bf16") and "DOT_BF16"
               in c["constexprs"])


def test_a_tile_that_overflows_shared_memory_fails(compiled):
    for target in ("sm_90", "sm_80"):
        c = compiled[1][f"overflow-{target}"]
        assert c["result"]["shared"] > kt.TARGETS[target][1]
        assert any("shared memory" in p for p in kt.problems(c)), kt.problems(c)


def test_a_dot_that_loses_its_tensor_cores_fails(compiled):
    for target, mark in (("sm_90", "wgmma"), ("sm_80", "mma.sync")):
        c = compiled[1][f"no-tensor-core-{target}"]
        assert kt.problems(c) == [f"no {mark} in the PTX: the dot misses the tensor cores"], kt.problems(c)


def test_a_dot_below_wgmma_fails_on_sm_90(compiled):
    c = compiled[1]["mma-sync-on-sm_90"]
    assert "mma.sync in the PTX: a dot misses wgmma" in kt.problems(c), (kt.problems(c), c["result"])


def test_fp8_experts_cannot_compile_for_an_a100(compiled):
    """Why kernels/dispatch.py keeps dynamic FP8 experts off Triton below SM 8.9 (and the matrix leaves them out):
    their e4m3 x e4m3 dots (weight-only decodes the bytes with integer ops: built for sm_80 above)."""
    c = compiled[1]["fp8-on-sm_80"]
    assert "fp8e4nv not supported" in c["result"].get("error", ""), c["result"]


@pytest.mark.parametrize("cap", [(7, 5), (8, 0), (8, 9), (9, 0)])
@pytest.mark.parametrize("semantics", ["weight-only", "dynamic"])
def test_fp8_experts_run_triton_only_where_it_compiles(monkeypatch, cap, semantics):
    """Weight-only from SM 8.0 (the A100: its sm_80 builds above), dynamic from SM 8.9; the reference below."""
    triton_runs = cap >= ((8, 9) if semantics == "dynamic" else (8, 0))
    from dgcli.kernels import dispatch, fp8, moe

    calls = []
    monkeypatch.setenv("DGEMMA_FP8", semantics)
    monkeypatch.setattr(dispatch, "implementation", lambda op, dev: "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: cap)
    monkeypatch.setattr(moe, "experts_triton", lambda *a, **k: calls.append(k) or torch.zeros_like(a[0]))
    g = torch.Generator().manual_seed(0)
    e, h, inter, n = 4, 16, 8, 3
    x = torch.randn(n, h, generator=g)
    w = torch.rand(n, 2, generator=g)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    gu_q, dn_q = (torch.randn(*s, generator=g).to(fp8.FP8) for s in ((e, 2 * inter, h), (e, h, inter)))
    gu_s, dn_s = torch.full((e, 2 * inter, 1), 0.5), torch.full((e, h, 1), 0.25)
    out = dispatch.fp8_experts(x, w, idx, gu_q, gu_s, dn_q, dn_s)
    assert bool(calls) == triton_runs
    if not triton_runs:
        ref = fp8.experts_fp8_reference(x, w, idx, gu_q, gu_s, dn_q, dn_s, dynamic=semantics == "dynamic")
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_every_kernel_but_attention_has_a_computed_h100_time_against_its_floor():
    """kernel_floor's table (kernel_targets prints it): each non-attention kernel's time as its wrapper launches it at the released shapes,
    computed (marked so) against its floor on an H100, at batch 1 and 8; never below the floor (a launch's CTAs do
    at least the op's useful work). Dynamic FP8's quantizer and NVFP4 are not modelled."""
    text = kf.computed_table()
    assert text.startswith("Computed, not measured (H100 SXM")
    named = {line.split(" | ")[0].lstrip("| ").split(" ")[0] for line in text.splitlines()[4:]}
    attention = {"paged_attention._paged_attention_kernel", "paged_attention._combine_kernel"}  # a table of its own
    assert named == {c["kernel"] for c in CONFIGS} - {"fp8_linear._quant_kernel", "nvfp4_triton._w4a16_kernel"} - attention
    rows = [line.split(" | ") for line in kf.attention_times().splitlines()[2:]]
    assert {r[0].lstrip("| ") for r in rows} == {"sliding d=256", "full d=512"} and len(rows) == 8
    assert all(float(r[-1].rstrip(" |")) >= 1 for r in rows)  # never below the floor
    for batch in (1, 8):
        for fp8 in (False, True):
            for name, ctas, floor, est in kf.computed(batch, fp8):
                assert ctas >= 1 and 0 < floor <= est, (name, batch, floor, est)
