"""The C kernels (kernels/csrc, built by kernels/native.py): every source compiles here with warnings as errors, a
compiler that fails is an error (never a silent torch fallback), the cache is a private folder, and the switch
that turns C off is DGEMMA_KERNELS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgcli.kernels import native

ROOT = Path(__file__).resolve().parents[2]
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def test_c_lives_in_real_files_only():
    sources = sorted(p.name for p in native.CSRC.glob("*.c"))
    assert sources == sorted(f"{name}.c" for name in native.LIBRARIES)
    for py in (ROOT / "kernels").glob("*.py"):
        text = py.read_text()
        assert "#include <" not in text, f"{py.name} holds C source: it belongs in kernels/csrc"


@needs_cc
@pytest.mark.parametrize("isa", [(), ("-mno-avx512vnni",), ("-mno-avx512bf16",), ("-march=x86-64-v3",)],
                         ids=["native", "no-vnni", "vnni-no-bf16", "avx2"])  # a CPU without the kernels'
@pytest.mark.parametrize("name", sorted(native.LIBRARIES))  # instructions builds their stubs, warning-free too
def test_every_source_compiles_with_warnings_as_errors(name, isa, tmp_path):
    cmd = native.compile_command(native.compiler(), name, str(tmp_path / "k.so"), ("-Wall", "-Wextra", "-Werror", *isa))
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@needs_cc
def test_every_library_builds_and_loads_here():
    """Where a compiler exists, no kernel may quietly fall back to torch: each library builds (or says its CPU lacks
    the instructions, which only its own check function may say)."""
    status = native.status()
    assert set(status) == set(native.LIBRARIES)
    assert all(v in ("built", "CPU lacks its instructions") for v in status.values()), status


_BROKEN = r"""
import sys
from pathlib import Path
import dgcli.kernels.native as native
native.CSRC = Path(sys.argv[1])
try:
    native.library("gemm_native", {})
except native.NativeBuildError as e:
    print("ERROR:", e)
    sys.exit(3)
print("no error")
"""


@needs_cc
def test_a_broken_source_is_an_error_with_the_compilers_message(tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for p in native.CSRC.iterdir():
        (csrc / p.name).write_bytes(p.read_bytes())
    with open(csrc / "gemm_native.c", "a") as f:
        f.write("\nint this_is_not_c(void) { return undeclared_name; }\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "DGEMMA_KERNELS": "auto"}
    run = subprocess.run([sys.executable, "-c", _BROKEN, str(csrc)], capture_output=True, text=True, env=env)
    assert run.returncode == 3, (run.stdout, run.stderr)
    assert "gemm_native.c failed" in run.stdout and "undeclared_name" in run.stdout
    assert "DGEMMA_KERNELS=torch" in run.stdout  # the fix, in the same message


def test_the_cache_is_never_a_shared_or_foreign_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = native.cache_dir()
    assert d == tmp_path / "dgemma" / "native" and not str(d).startswith("/tmp/dgemma-")
    native._private_dir(d)
    assert d.stat().st_mode & 0o777 == 0o700
    d.chmod(0o777)  # anyone could plant a library here
    with pytest.raises(native.NativeBuildError, match="not a private folder"):
        native._private_dir(d)


def test_dgemma_kernels_torch_turns_every_c_kernel_off(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    assert all(native.library(name, {}) is None for name in native.LIBRARIES)
    assert all(v == "off (DGEMMA_KERNELS=torch)" for v in native.status().values())


def test_without_a_compiler_the_torch_paths_run(monkeypatch, tmp_path):
    code = ("import dgcli.kernels.native as n, dgcli.kernels.dispatch as d, dgcli.kernels.gemm_native as g; "
            "print(n.status()); print(d.provenance('cpu', 'float32')); assert not g.available()")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PATH": str(tmp_path), "DGEMMA_KERNELS": "auto"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "'no compiler'" in run.stdout and "c-panels" not in run.stdout and "'linear': 'torch.linear'" in run.stdout


def test_a_retired_or_misspelt_switch_is_named_not_ignored():
    dgemma = Path(sys.executable).with_name("dgemma")
    env = {**os.environ, "DGEMMA_NATIVE": "0", "DGEMMA_KERNEL": "torch"}
    run = subprocess.run([str(dgemma), "--version"], capture_output=True, text=True, env=env)
    assert run.returncode == 0
    warned = [ln for ln in run.stderr.splitlines() if ln.startswith("dgemma: warning:")]
    assert len(warned) == 2 and "DGEMMA_KERNEL is not a dgemma setting" in run.stderr
    assert "DGEMMA_NATIVE is not a dgemma setting" in run.stderr and "DGEMMA_KERNELS" in warned[0]


def test_a_bad_switch_value_is_one_line_and_exit_2():
    dgemma = Path(sys.executable).with_name("dgemma")
    run = subprocess.run([str(dgemma), "--version"], capture_output=True, text=True,
                         env={**os.environ, "DGEMMA_KERNELS": "bogus"})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == ["dgemma: error: DGEMMA_KERNELS='bogus': use one of auto, torch, reference"]
