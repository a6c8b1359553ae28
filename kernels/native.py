"""Small C kernels for the CPU, built by the system's C compiler at first use and loaded with ctypes, or as a
CPython extension module where Python's headers are here (`direct`: the same functions, ~1.4 µs a call cheaper).

Owns: `build` (one C source -> a loaded library: `cc -O3 -march=native [-fopenmp]` into ~/.cache/dgemma or the
temp dir, keyed by the source, the flags, the compiler and the CPU's flags, so a library built for one CPU never
loads on another; OpenMP binds to the libgomp torch already loaded), `enabled` (DGEMMA_NATIVE=0 turns every
native kernel off) and `switch` (the same as a function of nothing, cheaper), `getenv` (the switches, read cheaply
at each call) and `vector_tanh` (the 16-lane tanh functions a kernel may call: torch's Sleef one, glibc's libmvec
one). No torch headers, no build step at install: a machine without a compiler runs the torch ops.
Also `fast_bf16` (DGEMMA_BF16_FAST=1: the opt-in for the bf16 kernels whose bits are not the reference's).
Must not: know what the kernels compute (their modules: kernels/attention_native.py, gemm_bf16.py, gemm_native.py,
ggml_native.py, ggml_q8.py, norm_native.py, sampler_native.py, vocab_native.py), or be needed: every caller has a
torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from importlib.machinery import ExtensionFileLoader
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from types import ModuleType


_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None  # CPython: bytes name -> bytes value
_NAMES: dict[str, bytes] = {}


def getenv(name: str) -> str | None:
    """os.environ.get(name), read as it is now, without os.environ's per-call encoding (~1 µs; the kernels'
    switches are read a few hundred times a denoising step): CPython keeps POSIX's environment in `_data`."""
    if _DATA is None:
        return os.environ.get(name)
    key = _NAMES.get(name)
    if key is None:
        key = _NAMES[name] = os.fsencode(name)
    v = _DATA.get(key)
    return None if v is None else os.fsdecode(v)


def enabled(switch: str | None = None) -> bool:
    """False under DGEMMA_NATIVE=0, or under the kernel's own `switch` variable set to 0."""
    return getenv("DGEMMA_NATIVE") != "0" and (switch is None or getenv(switch) != "0")


def switch(name: str) -> Callable[[], bool]:
    """`enabled(name)` as a function of no arguments, read at each call as cheaply as a dict lookup (~0.1 against
    0.25 µs: it is asked before each of a step's ~100 C calls)."""
    if _DATA is None:
        return functools.partial(enabled, name)
    get, key = _DATA.get, os.fsencode(name)
    return lambda: get(b"DGEMMA_NATIVE") != b"0" and get(key) != b"0"


def fast_bf16() -> bool:
    """DGEMMA_BF16_FAST=1 (and native kernels not off): bf16 sessions may run the C kernels that sum in their own
    order (kernels/attention_native.py; kernels/gemm_bf16.py's experts where it does not sum as oneDNN does): faster,
    about a bf16 rounding apart per op, so not transformers' bits; by default a bf16 CPU session keeps the
    reference's bits."""
    return (getenv("DGEMMA_BF16_FAST") or "").lower() in ("1", "true", "yes", "on") and getenv("DGEMMA_NATIVE") != "0"


@functools.cache
def vector_tanh(which: str) -> int | None:
    """The address of a 16-lane fp32 tanh (AVX-512) in this process, or None: "sleef", torch's own
    Sleef_tanhf16_u10 (0.5 ulp; where torch runs its AVX512 kernels), or "libmvec", glibc's _ZGVeN16v_tanhf
    (<= 1.3 ulp; ~3.5x faster on a 2-core EPYC: 0.47 against 1.65 ns an element)."""
    import torch

    try:
        if which == "sleef":
            if torch.backends.cpu.get_cpu_capability() != "AVX512":
                return None
            fn = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).Sleef_tanhf16_u10
        else:
            fn = ctypes.CDLL("libmvec.so.1")._ZGVeN16v_tanhf
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


def build(name: str, source: str, signatures: dict[str, list], flags: tuple[str, ...] = (),
          libs: tuple[str, ...] = (), direct: bool = False) -> ctypes.CDLL | ModuleType | None:
    """`source` compiled (`flags`, then linked with libm and `libs`) and loaded, its functions' argtypes set from
    `signatures`; None where anything fails (no compiler, a compile or link error, an unloadable library). Never
    -ffast-math: its startup code would set flush-to-zero for the whole process.
    `direct`: first as a CPython extension module (where Python's headers are here) whose functions of the same
    names take the same arguments (an int or None for a pointer) and give the C int back, without the GIL, as the
    ctypes ones do, minus ctypes' conversion objects: ~0.2 against ~1.6 µs a call of 15 arguments (a step of the
    bundled model makes ~100 C calls). Else, or where it does not build, the ctypes library."""
    include = sysconfig.get_paths()["include"] if direct else None
    if include and Path(include, "Python.h").is_file():
        module = f"dgemma_{name}"
        mod = _built(f"{name}-{sys.implementation.cache_tag}", (source, _wrappers(module, signatures)), flags, libs,
                     include, lambda so: _extension(module, so))
        if mod is not None:
            return mod
    return _built(name, (source,), flags, libs, None, lambda so: _ctypes(so, signatures))


def load_once(cell: list, name: str, source: str, signatures: dict[str, list], ok: str | None = None,
              **kw) -> ctypes.CDLL | ModuleType | None:
    """`build(name, source, signatures, **kw)` at the first call, kept in `cell` (the kernel module's one-item list,
    which tests may swap) for every later one; None where it failed or its `ok` function says 0 (a library built
    for a CPU without the kernel's instructions: kept, so no process retries the compiler)."""
    if not cell:
        lib = build(name, source, signatures, **kw)
        cell.append(lib if lib is not None and (ok is None or getattr(lib, ok)()) else None)
    return cell[0]


def _ctypes(so: Path, signatures: dict[str, list]) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(so))
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = argtypes
    return lib


def _extension(module: str, so: Path) -> ModuleType:
    loader = ExtensionFileLoader(module, str(so))
    mod = module_from_spec(spec_from_file_location(module, so, loader=loader))
    loader.exec_module(mod)
    return mod


# ctypes' argument types -> the C type and its conversion from the Python object, as ctypes converts it
_DIRECT = {ctypes.c_void_p: ("void *", "arg_ptr"), ctypes.c_long: ("long", "PyLong_AsLong"),
           ctypes.c_int: ("int", "(int)PyLong_AsLong"), ctypes.c_float: ("float", "(float)PyFloat_AsDouble")}


def _wrappers(module: str, signatures: dict[str, list]) -> str:
    """The C source of extension `module`: one METH_FASTCALL function per C function of `signatures` (declared here
    as returning int, ctypes' default restype; a separate file, so the kernel's own prototypes do not clash)."""
    out = ["#include <Python.h>",
           "static void *arg_ptr(PyObject *o) { return o == Py_None ? NULL : PyLong_AsVoidPtr(o); }"]
    for fn, argtypes in signatures.items():
        types = [_DIRECT[t] for t in argtypes]
        n = len(types)
        out += [f"int {fn}({', '.join(c for c, _ in types) or 'void'});",
                f"static PyObject *py_{fn}(PyObject *self, PyObject *const *a, Py_ssize_t n) {{",
                f'    if (n != {n}) return PyErr_Format(PyExc_TypeError, "{fn}: {n} arguments, not %zd", n);',
                *(f"    {c} v{i} = {conv}(a[{i}]);" for i, (c, conv) in enumerate(types)),
                "    if (PyErr_Occurred()) return NULL;",
                "    int r;",
                f"    Py_BEGIN_ALLOW_THREADS r = {fn}({', '.join(f'v{i}' for i in range(n))}); Py_END_ALLOW_THREADS",
                "    return PyLong_FromLong(r);", "}"]
    out += ["static PyMethodDef methods[] = {",
            *(f'    {{"{fn}", (PyCFunction)(void (*)(void))py_{fn}, METH_FASTCALL, NULL}},' for fn in signatures),
            "    {NULL, NULL, 0, NULL}};",
            f'static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, "{module}", NULL, -1, methods}};',
            f"PyMODINIT_FUNC PyInit_{module}(void) {{ return PyModule_Create(&def); }}"]
    return "\n".join(out) + "\n"


def _built(name: str, sources: tuple[str, ...], flags: tuple[str, ...], libs: tuple[str, ...], include: str | None,
           load: Callable[[Path], object]):
    """load(path) of the shared library built from `sources` (compiled together; `include`: Python's headers),
    cached under a key of everything that goes into it; None where anything fails."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    info = Path("/proc/cpuinfo")  # -march=native: the CPU's flags are part of the key
    cpu = [ln for ln in (info.read_text() if info.is_file() else "").splitlines() if ln.startswith(("flags", "Fea"))][:1]
    text = "".join(sources) + (f"{include}{sys.version}" if include else "")
    key = hashlib.sha256(f"{text}{flags}{libs}{cc}{platform.machine()}{cpu}".encode()).hexdigest()[:16]
    files = [f"t{i or ''}.c" for i in range(len(sources))]  # t.c (the kernels), t1.c (the wrappers)
    inc = ["-idirafter", include] if include else []  # after the system's: no header of Python's shadows theirs
    for d in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma",
              Path(tempfile.gettempdir()) / f"dgemma-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        so = d / f"{name}-{key}.so"
        try:
            if cc and not so.exists():
                d.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=d) as tmp:
                    for f, src in zip(files, sources):
                        (Path(tmp) / f).write_text(src)
                    for omp in (["-fopenmp"], []):
                        cmd = [cc, "-O3", "-march=native", *flags, *omp, *inc, "-shared", "-fPIC", *files, "-o",
                               "t.so", "-lm", *libs]
                        if subprocess.run(cmd, cwd=tmp, capture_output=True, timeout=120).returncode == 0:
                            os.replace(Path(tmp) / "t.so", so)  # atomic: processes racing here all get a whole file
                            break
            return load(so)
        except (OSError, AttributeError, ImportError, subprocess.SubprocessError):
            continue
    return None
