"""How the suite runs the Triton kernels, decided once in tests/conftest.py: compiled where CUDA exists
(TRITON_INTERPRET not set, whatever the environment held), in the interpreter where it does not; and the
kernels' own reading of that state (`triton_common.interpreting`), and bf16 dots computed in the interpreter as on a
GPU (so the kernels' bf16 tensor-core branches run in CPU tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest  # tests/conftest.py, on sys.path as a plain module (tests/ has no __init__.py)


def test_the_decision_with_cuda_injected():
    assert conftest.triton_interpreter_needed(cuda_available=False) is True
    assert conftest.triton_interpreter_needed(cuda_available=True) is False


@pytest.mark.parametrize("inherited", [None, "1", "0"])
def test_applying_the_decision(inherited):
    env = {} if inherited is None else {"TRITON_INTERPRET": inherited}
    conftest.apply_triton_mode(env, cuda_available=True)
    assert "TRITON_INTERPRET" not in env  # a GPU run never interprets, even with the variable inherited
    env = {} if inherited is None else {"TRITON_INTERPRET": inherited}
    conftest.apply_triton_mode(env, cuda_available=False)
    assert env["TRITON_INTERPRET"] == "1"


def test_this_run_follows_the_decision():
    """The state of this very session: the variable (seen by kernel modules and CLI subprocesses) and the
    device lists the fixtures parametrize over."""
    cuda = torch.cuda.is_available()
    assert os.environ.get("TRITON_INTERPRET") == (None if cuda else "1")
    assert conftest.DEVICES == (("cpu", "cuda") if cuda else ("cpu",))
    assert conftest.TRITON_DEVICES == (("cuda",) if cuda else ("cpu",))


def test_a_subprocess_inherits_the_decision():
    """CLI tests run `dgemma` as a child process: it sees the same mode as this session."""
    code = "import os; print(os.environ.get('TRITON_INTERPRET'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("None" if torch.cuda.is_available() else "1")


def test_kernels_read_the_mode():
    pytest.importorskip("triton")
    from dgcli.kernels import triton_common

    assert triton_common.interpreting() is (not torch.cuda.is_available())


def test_bf16_dots_compute_as_on_a_gpu():
    """The kernels' bf16 tensor-core branches (DOT_BF16) run in the interpreter too: a bf16 x bf16 tl.dot chain with
    fp32 accumulation gives the fp32 product of the bf16 values (Triton's interpreter alone multiplies their bits)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from dgcli.kernels import triton_common  # noqa: F401  (the interpreter's fix, made at import)

    @triton.jit
    def dot_chain(a_ptr, b_ptr, c_ptr, K: tl.constexpr):
        r = tl.arange(0, 16)
        acc = tl.zeros((16, 16), dtype=tl.float32)
        for k0 in range(0, K, 16):
            ks = k0 + tl.arange(0, 16)
            acc = tl.dot(tl.load(a_ptr + r[:, None] * K + ks[None, :]), tl.load(b_ptr + ks[:, None] * 16 + r[None, :]),
                         acc)
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], acc)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*s, generator=g).to(torch.bfloat16).to(dev) for s in ((16, 64), (64, 16)))
    c = torch.empty(16, 16, device=dev)
    dot_chain[(1,)](a, b, c, K=64)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-4)  # exact products, fp32 sums


def test_no_test_module_sets_the_variable_itself():
    """The decision stays in one place: a test file that set TRITON_INTERPRET at import would force the
    interpreter on a GPU too (for the whole session, as test modules share one process)."""
    tests = Path(conftest.__file__).parent
    setters = [p.relative_to(tests) for p in tests.rglob("*.py") if p.name not in ("conftest.py", Path(__file__).name)
               and ('environ.setdefault("TRITON_INTERPRET"' in p.read_text() or
                    'environ["TRITON_INTERPRET"] =' in p.read_text())]
    assert not setters, setters
