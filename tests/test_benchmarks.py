"""Every script in benchmarks/ runs: each with `--dry-run` (its whole path on tiny shapes, seconds) in a fresh process,
exit 0, its last line one JSON object (benchmarks/harness.py's `emit`). A new script is picked up by the glob, so
none can rot unseen; a script that cannot run here (no CUDA, no Ray) says so on that line (`{"skipped": why}`).
About two to four minutes on two shared cores (Ray's start and the
transformers imports take most): marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LIBRARY = {"harness.py"}  # imported by the scripts, not one itself
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in LIBRARY)
ARGS = {"gpu_suite.py": ["--device", "cpu"], "bench_kernels.py": ["--device", "cpu"],
        "step_breakdown.py": ["--device", "cpu"]}  # --dry-run prints the suite's plan; the CPU path elsewhere


def test_every_script_is_listed_and_uses_the_harness():
    assert len(SCRIPTS) >= 10
    for name in SCRIPTS:
        text = (BENCH / name).read_text()
        assert "from harness import" in text, f"{name}: time, summarize and report through benchmarks/harness.py"
        assert "--dry-run" in text or "parser(" in text, name


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_dry_run(name):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, str(BENCH / name), "--dry-run", *ARGS.get(name, [])], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=240)
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}"
    if name == "gpu_suite.py":  # the plan, one step a line (tests/measure/test_gpu_suite.py checks it)
        assert p.stdout.splitlines()[0].startswith("env: ")
        return
    last = p.stdout.strip().splitlines()[-1]
    assert isinstance(json.loads(last), dict), f"{name}: the last line is not one JSON object: {last[:200]}"
