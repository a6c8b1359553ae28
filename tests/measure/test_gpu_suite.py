"""benchmarks/gpu_suite.py on this CPU-only machine: the plan names every step with CPU sizes, the env step
runs, and the section renders a bench document's rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.py"


def _module(script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_plans_every_step_at_cpu_sizes():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--dry-run"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    steps = [line.split(":")[0] for line in out.splitlines()]
    assert steps == ["env", "tests", "kernels", "sync_check", "engine_passes", "profile", "bench_kernels",
                     "bench_dummy", "bench_bundled"]
    assert "TRITON_INTERPRET=1" in out and "--small" in out and "dummy-medium.json --layers 2" in out
    # pytest as the README runs it: never `python -m pytest`, which puts the checkout (and kernels/) on sys.path
    assert " -m pytest" not in out.replace(" -P -m pytest", "") and "pytest -q" in out
    passes = "benchmarks/engine_passes.py --prefix --arrival --layers 6"
    cuda = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--dry-run"],
                          capture_output=True, text=True, check=True, cwd=ROOT).stdout
    plans = dict(line.split(": ", 1) for line in cuda.splitlines())
    assert "--dummy 26B-A4B" in plans["bench_dummy"] and "--batch-size 1,4,8" in plans["bench_dummy"]
    assert list(plans) == steps[:8] + ["bench_graphs"] + steps[8:]  # CUDA only: the bench with graphs
    assert plans["bench_graphs"].split("  (limit")[0] == plans["bench_dummy"].split("  (limit")[0] + " --cuda-graphs"
    assert "TRITON_INTERPRET" not in cuda and "--step-mode" not in cuda and "--graphs off,on" in plans["profile"]
    assert passes in plans["engine_passes"] and passes in dict(line.split(": ", 1) for line in out.splitlines())[
        "engine_passes"]
    assert plans["sync_check"].split("  (limit")[0].endswith("benchmarks/sync_check.py --graphs")
    # per-kernel rates and the step breakdown: 2 layers of 26B-A4B at batch 1/4/8 on CUDA, one small batch on CPU
    kernels = plans["bench_kernels"].split("  (limit")[0]
    assert kernels.endswith("--device cuda --layers 2 --step 26B-A4B --batch 1,4,8") and "--small" not in kernels
    cpu_kernels = dict(line.split(": ", 1) for line in out.splitlines())["bench_kernels"]
    assert "--small" in cpu_kernels and "dummy-medium.json --batch 1 " in cpu_kernels


def test_the_bench_kernels_section_keeps_its_tables_once():
    mod = _module()
    doc = {"device": "CPU", "peak_flops": 1e11, "peak_bytes_per_s": 2e10, "peak_source": "measured",
           "rows": [{"op": "rms_norm", "impl": "reference", "ms": 1.0, "tflops": 0.001, "gbs": 1.0,
                     "flop_share": 0.01, "bw_share": 0.05, "reference_ms": None}], "step": []}
    out = "device: CPU\n| op | impl |\n| rms_norm | reference | 1.000 |\n" + json.dumps(doc)
    text = mod.section([{"step": "bench_kernels", "command": "x", "exit": 0, "seconds": 1, "stdout": out,
                         "output": out + "\nwarning: slow"}], "cpu")
    assert text.count("| rms_norm | reference | 1.000 |") == 1 and '"peak_flops"' not in text
    assert "Device CPU: peaks 0.1 TFLOP/s bf16, 20 GB/s (measured)." in text and "warning: slow" in text


def test_env_step_runs_and_the_section_shows_bench_rows(tmp_path):
    out = tmp_path / "section.md"
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "env", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("## GPU suite (cpu, ") and '"torch": "2.13.0' in text and "| env | 0 |" in text
    mod = _module()
    doc = {"card": {}, "rows": [{"batch_size": b, "output_throughput": 10.0 * b, "mean_ttft_ms": 5.0,
                                 "mean_step_ms": 2.5, "quality": None} for b in (1, 4)]}
    section = mod.section([{"step": "bench_dummy", "command": "dgemma bench", "exit": 0, "seconds": 1.0,
                            "stdout": json.dumps(doc, indent=2), "output": "card"}], "cpu")
    assert "| 4 | 40 | 5 | 2.5 | n/a |" in section and "graphs" not in section
    assert mod.section([{"step": "bench_kernels", "command": "x", "exit": 1, "seconds": 0.1,
                         "output": "Traceback: boom"}], "cpu").count("boom") == 1


def test_the_section_compares_batch_1_with_the_floor_and_vllm():
    mod = _module()
    doc = json.dumps({"rows": [{"batch_size": 1, "mean_step_ms": 21.0}, {"batch_size": 4, "mean_step_ms": 30.0}]})
    step = {"step": "bench_dummy", "command": "x", "exit": 0, "seconds": 1, "stdout": doc, "output": ""}
    assert "Batch 1: 21 ms/step = 1.50x our bf16 floor estimate (14 ms), 2.33x vLLM" in mod.section([step], "cuda")
    assert "Batch 1:" not in mod.section([step], "cpu")  # CPU sizes: not the 26B-A4B step


def test_sync_check_without_cuda_prints_one_line_and_passes():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: the CUDA path is the suite's own sync_check step")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_check.py")], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == 1 and "no CUDA device" in json.loads(p.stdout)["skipped"]
    gone = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync_check.py"), "--step-mode", "graphs"],
                          capture_output=True, text=True, cwd=ROOT)
    assert gone.returncode == 2 and "--step-mode" in gone.stderr  # no CUDA graphs any more


def test_a_short_lease_budget_caps_and_logs(tmp_path):
    """--budget shares its seconds among the steps (a step with under 10 s left is listed as not run), --log-dir
    keeps each step's output and the section as the steps end; a bad --cap is one line."""
    logs = tmp_path / "logs"  # 11.2 s: env starts (11 s left) and, importing torch, takes over 1.2 s
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "env,kernels", "--budget", "11.2",
                        "--cap", "env=30", "--log-dir", str(logs)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 1, p.stderr  # a step not run is not a pass
    assert sorted(f.name for f in logs.iterdir()) == ["env.log", "section.md"]
    section = (logs / "section.md").read_text()
    assert "| env | 0 |" in section and "| kernels | not run (budget) | 0 |" in p.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "env", "--cap", "env"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "--cap 'env': give STEP=SECONDS" in bad.stderr


@pytest.mark.parametrize("wheels", [[], ["--wheels", ".whl"]])
def test_the_lease_plan_fits_eight_minutes(wheels):
    """--lease: the compiled kernel tests first, then bf16 and FP8 at batch 1 and 8 with prompts of 128 and 1,000
    tokens, eager and graphed, the graphs-vs-eager check and the sync check; its limits within 480 s. With
    --wheels, the wheelhouse's install comes first (it prints the env) and counts in the 480 s."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--lease", "--dry-run", *wheels],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    plans = dict(line.split(": ", 1) for line in out[:-1])
    benches = [f"bench_{w}_p{n}_{g}" for w in ("bf16", "fp8") for n in (128, 1000) for g in ("eager", "graphs")]
    assert list(plans) == ["install" if wheels else "env", "kernels", *benches, "graphs_equal", "sync_check"]
    if wheels:
        assert plans["install"].split("  (limit")[0].endswith("benchmarks/wheelhouse.py --install .whl")
    assert "TRITON_INTERPRET" not in plans["kernels"] and "tests/kernels/test_kernel_fused.py" in plans["kernels"]
    for name in benches:
        cmd = plans[name]
        assert "--dummy 26B-A4B" in cmd and "--batch-size 1,8" in cmd and f"--weights {name.split('_')[1]}" in cmd
        assert f"--random-input-len {name.split('_p')[1].split('_')[0]} " in cmd + " "
        assert ("--cuda-graphs" in cmd) == name.endswith("graphs")
    total = sum(int(cmd.rsplit("(limit ", 1)[1].split(" s)")[0]) for cmd in plans.values())
    assert total <= 480 and out[-1] == f"total {total} s of limits (within the lease's 480 s)"


def test_a_check_that_cannot_run_is_not_run_never_passed(tmp_path):
    """Without CUDA the sync check prints {"skipped": ...} and exits 0, and a graphed bench cannot start: both are
    "not run" in the section, and the suite exits 1."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: these checks run")
    for args, name in ((["--only", "sync_check"], "sync_check"),
                       (["--lease", "--only", "bench_bf16_p128_graphs"], "bench_bf16_p128_graphs")):
        p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True,
                           cwd=ROOT)
        assert p.returncode == 1, p.stderr
        row = next(line for line in p.stdout.splitlines() if line.startswith(f"| {name} |"))
        assert row.endswith("| not run |") and f"not run: 1 ({name})" in p.stdout and "passed: 0" in p.stdout


def test_a_cuda_run_on_a_cpu_only_torch_stops_with_one_line():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build")
    p = subprocess.run([sys.executable, str(SCRIPT), "--lease", "--device", "cuda", "--only", "env"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout[-500:])
    assert p.stderr.startswith(f"gpu_suite: error: torch {torch.__version__} at ") and len(p.stderr.splitlines()) == 1
    assert "CPU-only build" in p.stderr and "--device cpu" in p.stderr


def test_the_wheelhouse_holds_the_runtime_and_lease_test_requirements_but_never_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = _module(SCRIPT.with_name("wheelhouse.py")).requirements()
    assert not any(r.lower().startswith(("torch", "triton")) for r in reqs)
    assert [r for r in project["dependencies"] if not r.startswith(("torch", "triton"))] == reqs[:-2]
    assert reqs[-2:] == [r for r in project["optional-dependencies"]["test"] if r.startswith(("pytest", "hypothesis"))]


def test_a_step_cut_at_its_limit_takes_its_children_along():
    """A step past its limit is killed with what it started (pip, pytest workers): nothing of it keeps the device."""
    child = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
             " print(c.pid, flush=True); time.sleep(60)")
    r = _module().run_step("x", [sys.executable, "-c", child], 3, {})
    assert r["exit"] == "timeout" and r["seconds"] < 30
    pid = int(r["stdout"].split()[0])
    try:
        for _ in range(50):  # reaped by init, or a zombie for a moment
            stat = Path(f"/proc/{pid}/stat")
            if not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the step's child {pid} outlived it")
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, 9)
