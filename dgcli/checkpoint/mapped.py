"""Weights used in place from mapped files, and the low-memory mode that streams them layer by layer.

The forms the CPU kernels need built from a GGUF file (torch's int4 layout of Q4_K / Q4_0, a quantized embedding
dequantized) are written once to a cache file beside it (or under $XDG_CACHE_HOME/dgemma/gguf) and mapped, like the
blocks used as stored (Q5_0, Q8_0, Q6_K): no weight lives in anonymous memory, so under a memory cap the kernel
may drop pages and read them again instead of killing the process. Owns: the cache file (key, layout, atomic build)
and `stream_layers` (madvise / posix_fadvise per layer). Must not: know tensor names or GGUF types
(checkpoint/gguf_model.py decides) or compute.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

MAGIC, VERSION = b"DGMAPPED", 2
PAGE = mmap.PAGESIZE


def cache_path(gguf: Path, tag: str) -> Path:
    """Where the compute forms of `gguf` for `tag` (the run dtype) live: beside it, else the user's cache folder."""
    name = f"{gguf.name}.dgemma-{tag}.cache"
    if os.access(gguf.parent, os.W_OK):
        return gguf.parent / name
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma" / "gguf"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    return base / name


def _key(gguf: Path, tag: str) -> dict:
    st = gguf.stat()  # a rewritten file (another size or time) is another key: its cache is rebuilt; so is another
    # torch (the int4 layout is its private `_convert_weight_to_int4pack_for_cpu`'s, free to change between releases)
    return {"version": VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "tag": tag, "torch": torch.__version__}


def open_cache(gguf: Path, tag: str) -> dict[str, torch.Tensor] | None:
    """The cached tensors (name -> tensor over the cache file's map), or None where there is no valid cache."""
    path = cache_path(gguf, tag)
    try:
        with open(path, "rb") as f:
            f.seek(-16, os.SEEK_END)
            at, magic = struct.unpack("<Q8s", f.read(16))
            f.seek(at)
            index = json.loads(f.read(os.fstat(f.fileno()).st_size - 16 - at))
    except (OSError, ValueError, struct.error):
        return None
    if magic != MAGIC or index.get("key") != _key(gguf, tag):
        return None
    m = np.memmap(path, dtype=np.uint8, mode="c")  # private and clean: file-backed pages, never anonymous
    out = {}
    for name, (off, dtype, shape) in index["tensors"].items():
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        out[name] = torch.from_numpy(m[off:off + n]).view(dt).reshape(shape)
    return out


def build_cache(gguf: Path, tag: str, items: Iterable[tuple[str, Callable[[], Iterable[torch.Tensor]], torch.dtype,
                                                            tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Write the cache from items (name, parts, dtype, shape), parts() yielding the tensor's bytes in order, one
    matrix in memory at a time; page-aligned, an index and trailer last, renamed into place when complete (a cut
    build leaves no cache that looks valid). Returns `open_cache`'s."""
    path = cache_path(gguf, tag)
    for part in path.parent.glob(path.name + ".*.part"):  # a build that was killed (the OOM killer, Ctrl-C twice)
        if not Path(f"/proc/{part.name[len(path.name) + 1:-5]}").exists():
            part.unlink(missing_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.part")
    index: dict[str, list] = {}
    try:
        with open(tmp, "wb") as f:
            for name, parts, dtype, shape in items:
                f.write(b"\0" * (-f.tell() % PAGE))
                index[name] = [f.tell(), str(dtype).removeprefix("torch."), list(shape)]
                for t in parts():
                    f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
                f.flush()  # written back and out of the page cache: a build under a memory cap holds one tensor
                os.fdatasync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            at = f.tell()
            f.write(json.dumps({"key": _key(gguf, tag), "tensors": index}).encode())
            f.write(struct.pack("<Q8s", at, MAGIC))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    out = open_cache(gguf, tag)
    assert out is not None, path
    return out


def read_rate(path: Path, most: int = 256 << 20) -> float | None:
    """The disk's read rate (bytes/s) for `path`: its last `most` bytes (tensor data) read in 8 MiB chunks after
    writing back any dirty pages (a file just written is still in the cache, dirty pages cannot be dropped) and
    asking the kernel to drop them from the page cache (pages another process maps stay: the rate is then the
    cache's, an overestimate); None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - most)
        os.fdatasync(fd)
        os.posix_fadvise(fd, start, size - start, os.POSIX_FADV_DONTNEED)
        t0, n = time.perf_counter(), 0
        while chunk := os.pread(fd, 8 << 20, start + n):
            n += len(chunk)
        dt = time.perf_counter() - t0
        return n / dt if n and dt > 0 else None
    finally:
        os.close(fd)


# ---- the low-memory mode ----------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _file_maps() -> list[tuple[int, int, int, str]]:
    """This process's file-backed mappings: (start, end, file offset, path), sorted."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16), parts[5].rstrip("\n")))
    return sorted(out)


def mapped_spans(modules: list[torch.nn.Module]) -> list[list[tuple[int, int, str, int]]]:
    """Per module, its tensors that lie in a file's map: (address, bytes, path, file offset)."""
    maps = _file_maps()
    starts = [m[0] for m in maps]
    out = []
    for mod in modules:
        spans = []
        for t in list(mod.parameters()) + list(mod.buffers()):
            a, n = t.data_ptr(), t.nbytes
            i = bisect.bisect_right(starts, a) - 1
            if n and i >= 0 and a + n <= maps[i][1]:
                spans.append((a, n, maps[i][3], maps[i][2] + a - maps[i][0]))
        out.append(spans)
    return out


def _advise(spans: list[tuple[int, int, str, int]], drop: bool) -> None:
    for a, n, path, off in spans:
        # dropping: whole pages inside the tensor only (a neighbour's page may be anonymous); reading: all it touches
        inner = (-(-a // PAGE) * PAGE, (a + n) // PAGE * PAGE)
        lo, hi = inner if drop else (a // PAGE * PAGE, -(-(a + n) // PAGE) * PAGE)
        if hi > lo:
            advice = mmap.MADV_DONTNEED if drop else mmap.MADV_WILLNEED
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice)
        if drop:  # and out of the page cache: the layer read longest ago is the one needed last
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def stream_layers(layers: list[torch.nn.Module], entry: Callable[[torch.nn.Module], torch.nn.Module],
                  resident_bytes: int) -> int:
    """The low-memory mode: the first layers whose mapped bytes fit `resident_bytes` stay; as layer i starts (a
    pre-hook on `entry(layer)`), layer i + 1's bytes are asked for ahead (MADV_WILLNEED) and the streamed layer
    before i is given back (MADV_DONTNEED, POSIX_FADV_DONTNEED: read again next step). Returns how many stay."""
    spans = mapped_spans(layers)
    keep, total = 0, 0
    for s in spans:
        total += sum(n for _, n, _, _ in s)
        if total > resident_bytes:
            break
        keep += 1
    n = len(layers)

    def hook(i: int):
        def pre(_mod, _args):
            _advise(spans[(i + 1) % n], drop=False)
            if (i - 1) % n >= keep:
                _advise(spans[(i - 1) % n], drop=True)
        return pre

    for i, layer in enumerate(layers):
        entry(layer).register_forward_pre_hook(hook(i))
    return keep
