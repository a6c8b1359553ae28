"""Small C kernels for the CPU, built by the system's C compiler at first use and loaded with ctypes.

Owns: `build` (one C source -> a loaded library: `cc -O3 -march=native [-fopenmp]` into ~/.cache/dgemma or the
temp dir, keyed by the source, the flags, the compiler and the CPU's flags, so a library built for one CPU never
loads on another; OpenMP binds to the libgomp torch already loaded), `enabled` (DGEMMA_NATIVE=0 turns every
native kernel off), `getenv` (the switches, read cheaply at each call) and `vector_tanh` (the 16-lane tanh
functions a kernel may call: torch's Sleef one, glibc's libmvec one). No torch headers, no build step at install:
a machine without a compiler runs the torch ops.
Must not: know what the kernels compute (their modules: kernels/gemm_native.py, ggml_native.py, norm_native.py,
sampler_native.py, vocab_native.py), or be needed: every caller has a torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


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
          libs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source` compiled (`flags`, then linked with libm and `libs`) and loaded, its functions' argtypes set from
    `signatures`; None where anything fails (no compiler, a compile or link error, an unloadable library). Never
    -ffast-math: its startup code would set flush-to-zero for the whole process."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    info = Path("/proc/cpuinfo")  # -march=native: the CPU's flags are part of the key
    cpu = [ln for ln in (info.read_text() if info.is_file() else "").splitlines() if ln.startswith(("flags", "Fea"))][:1]
    key = hashlib.sha256(f"{source}{flags}{libs}{cc}{platform.machine()}{cpu}".encode()).hexdigest()[:16]
    for d in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma",
              Path(tempfile.gettempdir()) / f"dgemma-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        so = d / f"{name}-{key}.so"
        try:
            if cc and not so.exists():
                d.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=d) as tmp:
                    (Path(tmp) / "t.c").write_text(source)
                    for omp in (["-fopenmp"], []):
                        cmd = [cc, "-O3", "-march=native", *flags, *omp, "-shared", "-fPIC", "t.c", "-o", "t.so",
                               "-lm", *libs]
                        if subprocess.run(cmd, cwd=tmp, capture_output=True, timeout=120).returncode == 0:
                            os.replace(Path(tmp) / "t.so", so)  # atomic: processes racing here all get a whole file
                            break
            lib = ctypes.CDLL(str(so))
            for fn, argtypes in signatures.items():
                getattr(lib, fn).argtypes = argtypes
            return lib
        except (OSError, AttributeError, subprocess.SubprocessError):
            continue
    return None
