"""Start-up imports: help and version load no torch; a plain generate loads no torch._dynamo or Triton.

Every check runs a fresh interpreter (this test process has torch, and maybe dynamo, loaded already).
No timings here: benchmarks/startup.py measures wall time against `import torch`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DGEMMA = str(Path(sys.executable).with_name("dgemma"))  # the console script of this environment

# Runs the real entry point, then prints the heavy modules that got imported and, for torch._dynamo, the
# stack of whoever imported it first (the failure message names the culprit).
PROBE = r"""
import sys, traceback
first = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and name not in first:
            stack = [f for f in traceback.extract_stack()[:-1] if "<frozen" not in f.filename]
            first[name] = "".join(traceback.format_list(stack[-22:]))
        return None
sys.meta_path.insert(0, Watch())
sys.argv = ["dgemma", *sys.argv[1:]]
from dgcli.cli import main
try:
    main()
finally:
    heavy = ("torch", "torch._dynamo", "torch._inductor", "triton", "sympy", "transformers")
    print("LOADED", ",".join(m for m in heavy if m in sys.modules), file=sys.stderr)
    if first:
        print("DYNAMO_IMPORTED_BY\n" + first["torch._dynamo"], file=sys.stderr)
"""


def _env():
    # A stray PYTHONPROFILEIMPORTTIME or DGEMMA_KERNELS from the caller must not change what runs.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPROFILEIMPORTTIME", "DGEMMA_KERNELS")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _imported(cmd: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run cmd with -X importtime's env twin; the set of module names it imported."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**_env(), "PYTHONPROFILEIMPORTTIME": "1"})
    mods = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return r, mods


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["watch", "--help"],
                                  ["sweep", "--help"], ["bench", "--help"], ["info", "--help"]],
                         ids=lambda a: " ".join(a))
def test_help_and_version_import_no_torch(argv):
    r, mods = _imported([DGEMMA, *argv])
    assert r.returncode == 0, r.stderr[-2000:]
    assert mods, "no import-time lines: the console script did not run Python with PYTHONPROFILEIMPORTTIME"
    assert "dgcli.cli" in mods
    torchy = sorted(m for m in mods if m == "torch" or m.startswith("torch."))
    assert not torchy, f"`dgemma {' '.join(argv)}` imported {torchy[:5]}"


def test_python_m_dgcli_cli_is_the_console_script():
    r = subprocess.run([sys.executable, "-m", "dgcli.cli", "--version"], capture_output=True, text=True,
                       timeout=120, env=_env())
    assert r.returncode == 0 and r.stdout.startswith("dgemma "), r.stderr[-2000:]


def test_plain_generate_imports_no_dynamo_triton_or_transformers():
    """Only `--compile` may load the compiler (about 1 s of imports); a CPU run needs no Triton."""
    r = subprocess.run([sys.executable, "-c", PROBE, "generate", "Reverse: c a t"], capture_output=True,
                       text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "generate printed no answer"
    loaded = next(line for line in r.stderr.splitlines() if line.startswith("LOADED")).split()[1:]
    loaded = set(loaded[0].split(",")) if loaded else set()
    assert "torch" in loaded  # the probe saw the run
    bad = loaded & {"torch._dynamo", "torch._inductor", "sympy", "triton", "transformers"}
    assert not bad, f"a plain generate imported {sorted(bad)}\n{r.stderr[r.stderr.find('DYNAMO_IMPORTED_BY'):]}"


KERNELS_PROBE = r"""
import sys, torch
from dgcli.kernels import dispatch, moe_cpu
g = torch.Generator().manual_seed(0)
x, w = torch.randn(8, 16, generator=g), torch.rand(8, 2, generator=g)
idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
gu, dn = torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 8, generator=g)
dispatch.experts(x, w, idx, gu, dn)
moe_cpu.experts_segments(x, w, idx, gu, dn)
dispatch.rms_norm(x, None, 1e-6)
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_cpu_kernels_import_and_run_without_dynamo_or_triton():
    r = subprocess.run([sys.executable, "-c", KERNELS_PROBE], capture_output=True, text=True, timeout=300,
                       env=_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"the CPU kernels loaded {r.stdout.strip()}"


COMPILE_PROBE = r"""
import sys, torch
from dgcli.kernels import fp8  # before dynamo: the lazy path of _outside_compiled_graphs
assert "torch._dynamo" not in sys.modules
from torch._dynamo.utils import counters
g = torch.Generator().manual_seed(0)
x, w = torch.randn(8, 16, generator=g).bfloat16(), torch.rand(8, 2, generator=g)
idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
gu, dn = torch.randn(4, 16, 16, generator=g).to(fp8.FP8), torch.randn(4, 16, 8, generator=g).to(fp8.FP8)
gus, dns = torch.rand(4, 16, 1, generator=g).bfloat16(), torch.rand(4, 16, 1, generator=g).bfloat16()
f = torch.compile(lambda *a: fp8.experts_fp8_segments(*a) + 0.0, backend="eager")
for _ in range(2):
    assert torch.equal(f(x, w, idx, gu, gus, dn, dns), fp8.experts_fp8_segments(x, w, idx, gu, gus, dn, dns))
print(sum(v for k, v in counters["graph_break"].items() if "torch.compiler.disable()" in k))
"""


@pytest.mark.slow  # dynamo in a fresh interpreter (~5 s); the plain-import probes above stay in the fast run
def test_compiled_fp8_experts_stay_outside_the_graph():
    """The lazy disable keeps the host read of the CPU FP8 experts out of compiled graphs, as the eager
    decorator did (backend="eager": dynamo's decision without inductor's compile time)."""
    r = subprocess.run([sys.executable, "-c", COMPILE_PROBE], capture_output=True, text=True, timeout=300,
                       env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.strip().splitlines()[-1]) >= 1  # dynamo skipped the disabled function
