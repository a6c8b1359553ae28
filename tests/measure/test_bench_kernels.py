"""benchmarks/bench_kernels.py: its FLOP/byte formulas against hand counts on tiny shapes, the report's
formatting (and gpu_suite's section built from it), the harness's span timer's nesting rule, and the CPU path of
the script (kernels at small shapes, the step breakdown of a tiny config) end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_kernels.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(ROOT / "benchmarks"))  # the scripts import benchmarks/harness.py
bk = _load("bench_kernels")
sb = _load("step_breakdown")
harness = _load("harness")


def test_work_formulas_match_hand_counts():
    # vocab: 2 GEMMs of 2x3x4 (2 FLOPs per MAC) = 96; embed 3x4 bf16 = 24 B, hidden in + soft out 2x(2x4x2) = 32,
    # 20 B per row of sample/argmax/entropy/uniform = 40
    assert bk.vocab_work(2, 3, 4) == (96, 96)
    # experts: 2 tokens x top-2 x (gate, up, down: 3 x 4 x 3 MACs) x 2 = 288; 5 experts x 36 weights x 2 B = 360,
    # x in and out 2 x (2x4x2) = 32, weights + ids 2 x 2 x 12 = 48
    assert bk.experts_work(2, 4, 3, 5, 2) == (288, 440)
    assert bk.rms_norm_work(3, 4) == (48, 3 * 4 * 2 * 2 + 4 * 2)
    # fp8: [2, 4] x [3, 4]^T: 24 MACs = 48 FLOPs; 12 weight bytes + 3 bf16 scales + (8 in + 6 out) x 2 B
    assert bk.fp8_linear_work(2, 4, 3) == (48, 12 + 6 + 28)
    # attention: 2 rows x 4 heads x 5 keys x d 3, QK and PV: 4 x 120 = 480; K and V of 2 kv heads: 2 x 2 x 5 x 3
    # x 2 B = 120; q and out 2 x (2 x 4 x 3 x 2 B) = 96
    assert bk.paged_attention_work(2, 4, 5, 3, 2, 1) == (480, 216)


def test_paged_attention_bytes_are_its_tensors_bytes():
    s = bk.shapes_for(small=True)
    case = next(c for c in bk.cases(torch.device("cpu"), s) if c[0] == "paged_attention")
    _, ref = case[2]()
    out = ref()
    flops, nbytes = case[3]
    q_bytes = s["n"] * s["heads"] * s["d"] * 2
    kv_bytes = 2 * s["kv"] * s["context"] * s["d"] * 2  # the pools hold exactly the context (whole blocks)
    assert out.shape == (s["n"], s["heads"], s["d"]) and nbytes == kv_bytes + q_bytes + out.numel() * 2
    assert flops == 4 * s["n"] * s["context"] * s["d"] * s["heads"]


def test_rates_and_tables_format():
    r = bk.rates(2e12, 1e9, 0.5, 8e12, 4e9)
    assert r == dict(ms=500.0, tflops=4.0, gbs=2.0, flop_share=0.5, bw_share=0.5)
    row = dict(op="experts", impl="triton", reference_ms=1.5, **bk.rates(2e12, 1e9, 0.5, None, None))
    table = bk.kernel_table([row])
    assert table[2] == "| experts | triton | 500.000 | 4 | n/a | 2 | n/a | 1.500 |"
    failed = bk.kernel_table([dict(op="vocab_pass", impl="triton", error="CompilationError: out of resources")])
    assert failed[2] == "| vocab_pass | triton | failed: CompilationError: out of resources | | | | | |"
    comps = {k: dict(ms=1.0, share=0.125, gflop=0.0, tflops=None, flop_share=None) for k in sb.COMPONENTS}
    comps["experts"] = dict(ms=2.0, share=0.25, gflop=1.0, tflops=0.5, flop_share=0.25)
    step = dict(model="m", batch=4, prompt_len=8, step_ms=8.0, instrumented_ms=8.0, step_tflops=0.3,
                step_flop_share=0.1, components=comps)
    text = "\n".join(sb.step_table([step]))
    assert "eager (graphs on and off: step_breakdown.py --profile)" in text and "| 4 | 8.00 | 8.00 | 0.3 (10.0 %) | 1.00 ms · 12 % |" in text
    assert "2.00 ms · 25 % · 0.5 TF/s (25.0 %)" in text


def test_gpu_suite_section_shows_the_kernel_and_step_tables():
    suite = _load("gpu_suite")
    comps = {k: dict(ms=1.0, share=1 / 7, gflop=0.0, tflops=None, flop_share=None) for k in sb.COMPONENTS}
    doc = {"device": "NVIDIA H100 80GB HBM3", "peak_flops": 989e12, "peak_bytes_per_s": 3.35e12,
           "peak_source": "datasheet", "rows": [dict(op="rms_norm", impl="triton", reference_ms=None,
                                                      **bk.rates(4e9, 2e9, 1e-3, 989e12, 3.35e12))],
           "step": [dict(model="dummy 26B-A4B (first 2 layers)", batch=1, prompt_len=128, step_ms=7.0,
                         instrumented_ms=7.0, step_tflops=1.0, step_flop_share=0.001, components=comps)]}
    stdout = "device: ...\n" + json.dumps(doc)
    text = suite.section([{"step": "bench_kernels", "command": "x", "exit": 0, "seconds": 1.0, "stdout": stdout,
                           "output": stdout}], "cuda")
    assert "peaks 989 TFLOP/s bf16, 3350 GB/s (datasheet)" in text
    assert "| rms_norm | triton | 1.000 | 4 | 0.4 | 2000 | 59.7 | - |" in text
    assert "| 1 | 7.00 | 7.00 | 1 (0.1 %) |" in text and "eager (graphs on and off: step_breakdown.py --profile)" in text
    assert suite._kernel_report("Traceback: boom") == []


def test_spans_count_the_outermost_call_only():
    spans = harness.Spans(torch.device("cpu"))
    spans.enter("experts")
    spans.enter("norms")  # the router's own norm: the router's time
    spans.exit()
    spans.exit()
    spans.enter("norms")
    spans.exit()
    got = spans.totals()
    assert set(got) == {"experts", "norms"} and spans.totals() == {}


def test_cpu_run_reports_kernels_and_the_step_breakdown():
    cfg = ROOT / "benchmarks" / "tiny.json"  # dummy-medium at H 128, V 2048, 2 layers
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--reps", "1", "--step", str(cfg),
                        "--layers", "2", "--batch", "1,2", "--prompt", "16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert [r["op"] for r in doc["rows"]] == ["vocab_pass", "experts", "experts x8 rows", "rms_norm", "fp8_linear",
                                                "paged_attention"]
    assert doc["peak_flops"] > 0 and all(r["tflops"] > 0 and r["flop_share"] > 0 for r in doc["rows"])
    assert [s["batch"] for s in doc["step"]] == [1, 2]
    for s in doc["step"]:
        comps = s["components"]
        assert set(comps) == set(sb.COMPONENTS)
        # every component timed (a renamed module would silently fall to "rest"), shares of one step
        assert all(comps[k]["ms"] > 0 for k in sb.COMPONENTS if k != "rest")
        assert sum(c["share"] for c in comps.values()) == pytest.approx(1.0, abs=0.02)
        canvas = json.loads(cfg.read_text())["canvas_length"]
        assert comps["vocab_pass"]["gflop"] == pytest.approx(s["batch"] * 4 * canvas * 2048 * 128 / 1e9)
    assert "| op | impl | ms | TFLOP/s |" in p.stdout and "eager (graphs on and off: step_breakdown.py --profile)" in p.stdout


def test_cuda_without_a_gpu_is_one_clear_line():
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: the suite's bench_kernels step runs the CUDA path")
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["bench_kernels: no CUDA device here; run with --device cpu (small "
                                             "shapes, CPU figures)"]


def test_a_failing_kernel_is_reported_in_its_row_and_the_rest_run(monkeypatch):
    def boom():
        raise RuntimeError("triton.CompilationError: out of shared memory\nmore lines")

    ok = (lambda: None, lambda: None)
    monkeypatch.setattr(bk, "cases", lambda dev, s: [("vocab_pass", "triton", boom, (10, 10)),
                                                     ("rms_norm", "reference", lambda: ok, (10, 10))])
    rows = bk.bench_kernel_rows(torch.device("cpu"), {}, 1, True, None, None)
    assert rows[0]["error"] == "RuntimeError: triton.CompilationError: out of shared memory" and "ms" not in rows[0]
    assert rows[1]["ms"] > 0 and "error" not in rows[1]


def test_a_bad_step_config_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--no-kernels", "--step",
                        str(tmp_path / "missing.json")], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "no such config.json" in p.stderr
