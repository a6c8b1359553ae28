"""kernels/native.py: a library built `direct` (a CPython extension) takes the same arguments and gives the same
results as its ctypes build (pointers as ints or None, longs, ints and bools, floats rounded to C float, the C int
back), and refuses a wrong argument count or type instead of reading garbage; `switch` reads the environment at
each call."""

from __future__ import annotations

import ctypes
import sysconfig
from pathlib import Path

import pytest
import torch

from dgcli.kernels import gemm_native, native, norm_native, sampler_native, vocab_native

_SOURCE = r"""
#include <stdint.h>
/* y[i] = a * x[i] + b (x NULL: y[i] = b), then the float s added to y[0]; returns how many were written, or -1 */
int axpb(const int64_t *x, int64_t *y, long n, int a, long b, float s, int flag) {
    if (!y)
        return -1;
    for (long i = 0; i < n; i++)
        y[i] = (x ? a * x[i] : 0) + b;
    if (n)
        y[0] += (int64_t)(s * 4.0f);
    return flag ? (int)n : 0;
}
void nothing(void) {}
"""
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURE = {"axpb": [_P, _P, _L, _I, _L, _F, _I], "nothing": []}
_HEADERS = Path(sysconfig.get_paths()["include"], "Python.h").is_file()


def _libs():
    direct = native.build("native_test", _SOURCE, _SIGNATURE, direct=True)
    plain = native.build("native_test", _SOURCE, _SIGNATURE)
    if direct is None or plain is None:
        pytest.skip("no C compiler here")
    return direct, plain


def test_direct_and_ctypes_calls_agree():
    direct, plain = _libs()
    assert isinstance(plain, ctypes.CDLL) and (not _HEADERS or not isinstance(direct, ctypes.CDLL))
    x = torch.arange(5, dtype=torch.long) - 2
    for lib in (direct, plain):
        y = torch.zeros(5, dtype=torch.long)
        # a float rounded to C float (0.75 - 2^-40 -> 0.75: 3 added, not 2), a bool as an int, a long above 2^32
        assert lib.axpb(x.data_ptr(), y.data_ptr(), 5, -3, 1 << 40, 0.75 - 2**-40, True) == 5
        assert y.tolist() == [6 + (1 << 40) + 3, 3 + (1 << 40), (1 << 40), -3 + (1 << 40), -6 + (1 << 40)]
        assert lib.axpb(None, y.data_ptr(), 2, 7, 9, 0.0, False) == 0 and y[:2].tolist() == [9, 9]
        assert lib.axpb(x.data_ptr(), None, 5, 1, 0, 0.0, 1) == -1  # None is NULL
        assert lib.axpb(x.data_ptr(), 0, 5, 1, 0, 0.0, 1) == -1  # so is 0
        lib.nothing()


def test_direct_calls_refuse_what_ctypes_refuses():
    direct, plain = _libs()
    y = torch.zeros(2, dtype=torch.long)
    for lib in (direct, plain):
        with pytest.raises(TypeError):
            lib.axpb(None, y.data_ptr(), 2, 1, 0, 0.0)  # one argument short
        with pytest.raises((TypeError, ctypes.ArgumentError)):
            lib.axpb(None, y.data_ptr(), 2.5, 1, 0, 0.0, 1)  # a float for a long
    assert y.tolist() == [0, 0]


@pytest.mark.skipif(not _HEADERS, reason="no Python headers here: the kernels load with ctypes")
def test_the_step_kernels_load_direct():
    for mod in (gemm_native, norm_native, sampler_native, vocab_native):
        lib = mod._native()
        if lib is not None:
            assert not isinstance(lib, ctypes.CDLL), mod.__name__


def test_switch_reads_the_environment_at_each_call(monkeypatch):
    on = native.switch("DGEMMA_TEST_NATIVE")
    for env, want in (({}, True), ({"DGEMMA_NATIVE": "0"}, False), ({"DGEMMA_TEST_NATIVE": "0"}, False),
                      ({"DGEMMA_NATIVE": "1", "DGEMMA_TEST_NATIVE": "00"}, True)):
        for k in ("DGEMMA_NATIVE", "DGEMMA_TEST_NATIVE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert on() is want and native.enabled("DGEMMA_TEST_NATIVE") is want, env


def test_without_python_headers_direct_is_the_ctypes_library(monkeypatch, tmp_path):
    monkeypatch.setattr(native.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})  # no Python.h there
    lib = native.build("native_test", _SOURCE, _SIGNATURE, direct=True)
    if lib is None:
        pytest.skip("no C compiler here")
    assert isinstance(lib, ctypes.CDLL) and lib.axpb(None, None, 0, 0, 0, 0.0, 0) == -1
