"""The C kernels for the CPU: real source files in kernels/csrc/, built once per machine by the system's C compiler
and loaded with ctypes.

Owns: `library(name, signatures)` (None only where this install runs without C: no compiler, DGEMMA_KERNELS is not
'auto', or the CPU lacks the kernel's instructions, which its own `*_ok()` reports), `LIBRARIES`, `NativeBuildError`
(a compiler that is here but fails: raised with its message, never a silent fallback), `compile_command` (the
tests compile every source with -Werror through it), `cache_dir` and `status`.
Must not: know what the kernels compute, load a library from a folder another user can write (the cache is
$XDG_CACHE_HOME or ~/.cache /dgemma/native, 0700 and checked to be ours), or be needed (every caller has a torch path).

Build: `cc -O3 -march=native -fPIC -shared -fopenmp NAME.c -lm` into NAME-KEY.so, KEY a hash of the sources, flags,
compiler and CPU flags; one process builds under a lock file while the others wait; written to a temporary name and
renamed. Never -ffast-math: its startup code would set flush-to-zero for the whole process.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from .switches import mode

CSRC = Path(__file__).with_name("csrc")
# Each library's check function (none of arguments, 0 where the CPU lacks the kernel's instructions), or None
LIBRARIES = {"gemm_native": "gemm_ok", "ggml_q8": "q8_ok", "nvfp4": "nvfp4_ok"}


class NativeBuildError(RuntimeError):
    """A C kernel that a compiler here failed to build or load (the message carries the compiler's output)."""


def compiler() -> str | None:
    """The C compiler: $CC, else cc, else gcc; None where there is none."""
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """Where built libraries live: $XDG_CACHE_HOME/dgemma/native or ~/.cache/dgemma/native."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dgemma" / "native"


def compile_command(cc: str, name: str, out: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The compiler's argument list for kernels/csrc/NAME.c -> out (`extra`: more flags, e.g. -Werror)."""
    return [cc, "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", *extra, "-I", str(CSRC),
            str(CSRC / f"{name}.c"), "-o", out, "-lm"]


def _key(cc: str, name: str) -> str:
    text = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.h"))) + (CSRC / f"{name}.c").read_bytes()
    info = Path("/proc/cpuinfo")  # -march=native: the CPU's flags are part of the key
    cpu = [ln for ln in (info.read_text() if info.is_file() else "").splitlines() if ln.startswith(("flags", "Fea"))][:1]
    meta = f"{compile_command(cc, name, '')}{os.path.realpath(cc)}{platform.machine()}{cpu}".encode()
    return hashlib.sha256(text + meta).hexdigest()[:16]


def _private_dir(d: Path) -> Path:
    """d created 0700 if missing, and refused unless this user owns it and no one else may write to it."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise NativeBuildError(f"{d} is not a private folder of this user (owner uid {st.st_uid}, mode "
                               f"{stat.filemode(st.st_mode)}): remove it, or set XDG_CACHE_HOME to a folder of yours")
    return d


def _build(cc: str, name: str, so: Path) -> None:
    """Compile NAME.c into `so`, under a lock beside it; raise NativeBuildError with the compiler's output."""
    with open(so.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.exists():  # another process built it while this one waited
            return
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            cmd = compile_command(cc, name, str(Path(tmp) / "k.so"))
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise NativeBuildError(f"building kernels/csrc/{name}.c: {e}") from e
            if run.returncode != 0:
                tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-20:])
                raise NativeBuildError(
                    f"building kernels/csrc/{name}.c failed ({' '.join(cmd)}):\n{tail}\n"
                    "Fix: set CC to a working C compiler, or run with DGEMMA_KERNELS=torch (torch's kernels only)")
            os.replace(Path(tmp) / "k.so", so)  # atomic: a process never loads half a file


_LOADED: dict[str, ctypes.CDLL | None] = {}


def _load(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        return None
    so = _private_dir(cache_dir()) / f"{name}-{_key(cc, name)}.so"
    if not so.exists():
        _build(cc, name, so)
    if hasattr(os, "getuid") and so.stat().st_uid != os.getuid():
        raise NativeBuildError(f"{so} belongs to another user: remove it")
    try:
        lib = ctypes.CDLL(str(so))
        for fn, argtypes in signatures.items():
            getattr(lib, fn).argtypes = argtypes
    except (OSError, AttributeError) as e:
        raise NativeBuildError(f"loading {so}: {e}. Fix: remove it (it is rebuilt at the next use)") from e
    ok = LIBRARIES[name]
    return lib if ok is None or getattr(lib, ok)() else None


def library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """kernels/csrc/NAME.c built (once per machine) and loaded; None where this install runs without it (no C
    compiler, DGEMMA_KERNELS=torch or reference, a CPU without the kernel's instructions)."""
    if mode() != "auto":
        return None
    try:
        return _LOADED[name]
    except KeyError:
        lib = _LOADED[name] = _load(name, signatures)
        return lib


def status() -> dict[str, str]:
    """Each library: 'built', 'no compiler', 'off (DGEMMA_KERNELS=...)' or 'CPU lacks its instructions'; raises
    NativeBuildError where a compiler here fails."""
    out = {}
    for name in LIBRARIES:
        if mode() != "auto":
            out[name] = f"off (DGEMMA_KERNELS={mode()})"
        elif compiler() is None:
            out[name] = "no compiler"
        else:
            out[name] = "built" if _load(name, {}) is not None else "CPU lacks its instructions"  # own CDLL object
    return out
