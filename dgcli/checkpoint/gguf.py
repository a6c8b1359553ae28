"""The GGUF file format (version 2 and 3, little-endian) on the `gguf` package (llama.cpp's gguf-py): ggml's type
table from it, and files written by its `GGUFWriter` from metadata and tensors produced one at a time. Reading stays
ours, a memory-mapped (copy-on-write) parse that hands out tensors in place: `GGUFReader` makes a numpy view per
metadata array item, ~50x as long over a real model's vocabulary (262,144 tokens, 514,906 merges: 30 s against 0.5 s).

Owns: the byte layout, every error a broken file causes (one line naming the file). Must not: know DiffusionGemma
(checkpoint/gguf_model.py) or compute with blocks.
`TensorInfo.shape` is the logical shape, ggml's dimensions reversed ([rows, K] for a matrix).
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType as V, GGUFWriter

from dgcli.errors import UserError

MAGIC = b"GGUF"
_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_NUMPY = {t: np.dtype(f) for t, f in _SCALAR.items() if t != V.BOOL} | {V.BOOL: np.dtype("<u1")}


def type_name(t: int) -> str:
    return GGMLQuantizationType(t).name if t in GGML_QUANT_SIZES else f"ggml type {t}"


def tensor_bytes(t: int, shape: Iterable[int]) -> int:
    """Bytes of a tensor of logical `shape` (the last dimension is the row) in type `t`."""
    shape = list(shape)
    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    n = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n * (shape[-1] // elems) * nbytes


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # logical (ggml's dims reversed): [rows, K] for a matrix, [E, rows, K] for experts
    type: int
    offset: int  # from the file's start
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type)


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> value; numeric arrays as numpy arrays, string arrays as lists),
    `tensors` (name -> TensorInfo, in file order), and `data(name)`: the tensor's bytes as a read-only
    memory-mapped uint8 array (nothing is read until used)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            # Copy-on-write: torch takes writable arrays without a warning; nothing is copied unless written.
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as e:
            raise UserError(f"{self.path}: cannot be read as a GGUF file ({e})") from None
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # ---- reading primitives -----------------------------------------------------------------
    def _cut(self, what: str) -> UserError:
        return UserError(f"{self.path}: GGUF file is cut short ({what} past its {len(self._map)} bytes); "
                         "the download or copy is incomplete: fetch the file again")

    def _take(self, n: int, what: str) -> np.ndarray:
        end = self._pos + n
        if end > len(self._map):
            raise self._cut(what)
        out = self._map[self._pos:end]
        self._pos = end
        return out

    def _unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what).tobytes())[0]

    def _string(self, what: str) -> str:
        n = self._unpack("<Q", what)
        return self._take(n, what).tobytes().decode("utf-8", errors="replace")

    def _strings(self, n: int, key: str) -> list[str]:
        # A tight loop over the mapping's buffer: a real model's ~780k token and merge strings in about a second.
        mv, pos, end = memoryview(self._map), self._pos, len(self._map)
        unpack, out = struct.Struct("<Q").unpack_from, []
        for _ in range(n):
            if pos + 8 > end:
                raise self._cut(f"array {key}")
            (k,) = unpack(mv, pos)
            if pos + 8 + k > end:
                raise self._cut(f"array {key}")
            out.append(str(mv[pos + 8:pos + 8 + k], "utf-8", "replace"))
            pos += 8 + k
        self._pos = pos
        return out

    def _value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype], f"value of {key}")
        if vtype == V.STRING:
            return self._string(f"value of {key}")
        if vtype == V.ARRAY:
            etype, n = self._unpack("<I", key), self._unpack("<Q", key)
            if etype in _NUMPY:
                arr = self._take(n * _NUMPY[etype].itemsize, f"array {key}").view(_NUMPY[etype])
                return arr.astype(bool) if etype == V.BOOL else np.array(arr)
            if etype == V.STRING:
                return self._strings(n, key)
            return [self._value(etype, key) for _ in range(n)]
        raise UserError(f"{self.path}: metadata {key!r} has unknown value type {vtype}; the file is corrupt "
                        "or from a newer GGUF version")

    def _parse(self) -> None:
        if len(self._map) < 4 or self._map[:4].tobytes() != MAGIC:
            raise UserError(f"{self.path}: not a GGUF file (it does not start with 'GGUF'); pass a .gguf model "
                            "or a checkpoint directory")
        self._pos = 4
        version = self._unpack("<I", "version")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise UserError(f"{self.path}: GGUF version {version}{hint} is not supported (2 or 3, little-endian)")
        n_tensors, n_kv = self._unpack("<Q", "tensor count"), self._unpack("<Q", "metadata count")
        for _ in range(n_kv):
            key = self._string("metadata key")
            self.metadata[key] = self._value(self._unpack("<I", key), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string("tensor name")
            ndim = self._unpack("<I", name)
            dims = [self._unpack("<Q", name) for _ in range(ndim)]
            infos.append((name, tuple(reversed(dims)), self._unpack("<I", name), self._unpack("<Q", name)))
        align = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise UserError(f"{self.path}: general.alignment {align!r} is not a power of two: the file is damaged; "
                            "write it again")
        start = -(-self._pos // align) * align
        for name, shape, t, off in infos:
            nbytes = tensor_bytes(t, shape) if t in GGML_QUANT_SIZES else 0
            info = TensorInfo(name, shape, t, start + off, nbytes)
            if info.offset + nbytes > len(self._map):
                raise self._cut(f"tensor {name!r}")
            self.tensors[name] = info

    # ---- tensors ------------------------------------------------------------------------------
    def data(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` (uint8, memory-mapped, read-only)."""
        info = self.tensors[name]
        return self._map[info.offset:info.offset + info.nbytes]

    def drop_pages(self, name: str) -> None:
        """Give back the resident pages of tensor `name`, read once into another form (prepared for a kernel, cast):
        else every byte a load read stays resident while the map lives. A later read faults them in again."""
        import mmap

        m = getattr(self._map, "_mmap", None)
        if m is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info, page = self.tensors[name], mmap.PAGESIZE
        lo, hi = -(-info.offset // page) * page, (info.offset + info.nbytes) // page * page  # whole pages inside
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` as numpy in its logical shape: F32/F16/F64/I* as such, BF16 as uint16 (torch views it
        as bfloat16), block formats as uint8 [..., rows, bytes per row]."""
        info = self.tensors[name]
        raw = self.data(name)
        dt = {0: "<f4", 1: "<f2", 30: "<u2", 24: "<i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}.get(info.type)
        if dt is not None:
            return raw.view(dt).reshape(info.shape)
        elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.type)]
        return raw.reshape(*info.shape[:-1], info.shape[-1] // elems * nbytes)


@functools.lru_cache(maxsize=4)
def _cached(path: str, mtime: float, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """A parsed file, shared by config, tokenizer and weights loading (the header of a real model's file
    holds ~780k strings: parse it once per run)."""
    p = Path(path).resolve()
    try:
        st = os.stat(p)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None
    return _cached(str(p), st.st_mtime, st.st_size)


# ---- writing ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Typed:
    """A metadata value with its GGUF type given (`vtype`; arrays: the element type): what llama.cpp's
    readers expect where the Python type is ambiguous (u32 counts, i32 per-layer arrays, f32 floats)."""

    vtype: int
    value: Any


def _infer(value: Any) -> Typed:
    """A plain value's GGUF type: bool, u32 (i64 past it), f32, string; a numpy array its dtype's (as this module
    reads them), a list its first item's."""
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(V.BOOL, value)
    if isinstance(value, int):
        return Typed(V.UINT32 if 0 <= value < 2**32 else V.INT64, value)
    if isinstance(value, float):
        return Typed(V.FLOAT32, value)
    if isinstance(value, str):
        return Typed(V.STRING, value)
    if isinstance(value, np.ndarray):
        kinds = {d: k for k, d in _NUMPY.items() if k != V.BOOL}
        return Typed(V.BOOL if value.dtype == bool else kinds[value.dtype.newbyteorder("<")], value.tolist())
    if isinstance(value, (list, tuple)):
        return Typed(_infer(value[0] if len(value) else "").vtype, list(value))
    raise TypeError(f"GGUF metadata value {value!r} has no GGUF type")


@dataclass
class TensorOut:
    """A tensor to write: logical `shape`, ggml `type`, and `data()` giving its bytes (any array whose raw
    bytes are the tensor's, in order); called once, when its turn comes (so a file can be written from a
    checkpoint one tensor in memory at a time)."""

    name: str
    shape: tuple[int, ...]
    type: int
    data: Callable[[], Any]


def write_gguf(path: str | Path, metadata: dict[str, Any], tensors: list[TensorOut], *,
               progress: Callable[[str], None] | None = None) -> int:
    """Write a GGUF v3 file with gguf-py's `GGUFWriter` and return its size in bytes; a partial file is removed on
    error. An empty metadata array is left out (the writer refuses one; llama.cpp's converter leaves them out)."""
    path = Path(path)
    w = GGUFWriter(path, metadata.get("general.architecture", ""))  # the writer puts it first
    for key, value in metadata.items():
        t = _infer(value)
        if key == "general.alignment":  # the data's alignment too, not only the key
            w.add_custom_alignment(int(t.value))
        elif isinstance(t.value, list) and t.value:
            w.add_key_value(key, t.value, V.ARRAY, sub_type=t.vtype)
        elif not isinstance(t.value, list) and key != "general.architecture":
            w.add_key_value(key, t.value, t.vtype)
    for t in tensors:  # the logical shape, ggml's order reversed by the writer (None: not a uint8 byte shape)
        w.add_tensor_info(t.name, t.shape, None, tensor_bytes(t.type, t.shape), raw_dtype=GGMLQuantizationType(t.type))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            raw = t.data()
            if type(raw).__module__.startswith("torch"):  # (not imported at module level: `dgemma info`)
                import torch

                raw = raw.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
            buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
            want = tensor_bytes(t.type, t.shape)
            if buf.nbytes != want:
                raise ValueError(f"tensor {t.name!r}: {buf.nbytes} bytes given, {type_name(t.type)} {list(t.shape)} "
                                 f"needs {want}")
            w.write_tensor_data(buf)
            if progress and (i + 1) % 50 == 0:
                progress(f"wrote {i + 1}/{len(tensors)} tensors")
        w.close()
    except BaseException:
        w.close()
        path.unlink(missing_ok=True)
        raise
    return path.stat().st_size
