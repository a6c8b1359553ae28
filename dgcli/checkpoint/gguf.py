"""The GGUF file format (version 2 and 3, little-endian): read a file's metadata and tensor table and hand out its
tensors memory-mapped (copy-on-write); write a file from metadata and tensors produced one at a time. Not gguf-py's
GGUFReader: it takes ~30x as long over a real model's ~780k vocabulary strings (49 s against 1.6 s measured).

Owns: the byte layout, every error a broken file causes (one line naming the file), and ggml's type table for
every type a file may hold. Must not: know DiffusionGemma (checkpoint/gguf_model.py) or compute with blocks.
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

from dgcli.errors import UserError

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32  # `general.alignment` when a file does not say

# Metadata value types (gguf's GGUFValueType).
U8, I8, U16, I16, U32, I32, F32V, BOOL, STRING, ARRAY, U64, I64, F64V = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32V: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64V: "<d"}
_NUMPY = {U8: "<u1", I8: "<i1", U16: "<u2", I16: "<i2", U32: "<u4", I32: "<i4", F32V: "<f4", BOOL: "<u1",
          U64: "<u8", I64: "<i8", F64V: "<f8"}

# ggml tensor types: id -> (name, elements per block, bytes per block); as ggml.h / gguf-py number them.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36),
}


def type_name(t: int) -> str:
    return GGML_TYPES[t][0] if t in GGML_TYPES else f"ggml type {t}"


def tensor_bytes(t: int, shape: Iterable[int]) -> int:
    """Bytes of a tensor of logical `shape` (the last dimension is the row) in type `t`."""
    shape = list(shape)
    _, elems, nbytes = GGML_TYPES[t]
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
        if vtype == STRING:
            return self._string(f"value of {key}")
        if vtype == ARRAY:
            etype, n = self._unpack("<I", key), self._unpack("<Q", key)
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize
                arr = self._take(n * size, f"array {key}").view(_NUMPY[etype])
                return arr.astype(bool) if etype == BOOL else np.array(arr)
            if etype == STRING:
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
        align = int(self.metadata.get("general.alignment", ALIGNMENT))
        start = -(-self._pos // align) * align
        for name, shape, t, off in infos:
            nbytes = tensor_bytes(t, shape) if t in GGML_TYPES else 0
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
        _, elems, nbytes = GGML_TYPES[info.type]
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
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(U32 if 0 <= value < 2**32 else I64, value)
    if isinstance(value, float):
        return Typed(F32V, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    if isinstance(value, np.ndarray):  # numeric arrays keep their dtype (as this module reads them)
        kinds = {np.dtype(v): k for k, v in _NUMPY.items() if k != BOOL}
        vtype = BOOL if value.dtype == bool else kinds[value.dtype.newbyteorder("<")]
        return Typed(vtype, value.tolist())
    if isinstance(value, (list, tuple)):
        first = _infer(value[0] if len(value) else "")
        return Typed(first.vtype, list(value))
    raise TypeError(f"GGUF metadata value {value!r} has no GGUF type")


def _encode_value(vtype: int, value: Any, array: bool) -> bytes:
    if array:
        items = list(value)
        head = struct.pack("<IQ", vtype, len(items))
        if vtype in _NUMPY:
            return head + np.asarray(items).astype(_NUMPY[vtype]).tobytes()
        return head + b"".join(_encode_value(vtype, v, False) for v in items)
    if vtype == STRING:
        b = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(b)) + b
    return struct.pack(_SCALAR[vtype], value)


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
    """Write a GGUF v3 file (alignment 32) and return its size in bytes; a partial file is removed on error."""
    path = Path(path)
    header = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(metadata))]
    for key, value in metadata.items():
        t = _infer(value)
        is_array = isinstance(t.value, (list, tuple, np.ndarray))
        header += [_encode_value(STRING, key, False), struct.pack("<I", ARRAY if is_array else t.vtype),
                   _encode_value(t.vtype, t.value, is_array)]
    offset = 0
    for t in tensors:
        header += [_encode_value(STRING, t.name, False), struct.pack("<I", len(t.shape)),
                   struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape)), struct.pack("<IQ", t.type, offset)]
        offset += -(-tensor_bytes(t.type, t.shape) // ALIGNMENT) * ALIGNMENT
    head = b"".join(header)
    try:
        with open(path, "wb") as f:
            f.write(head + b"\0" * (-len(head) % ALIGNMENT))
            for i, t in enumerate(tensors):
                raw = t.data()
                if type(raw).__module__.startswith("torch"):  # (not imported at module level: `dgemma info`)
                    import torch

                    raw = raw.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
                buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
                want = tensor_bytes(t.type, t.shape)
                if buf.nbytes != want:
                    raise ValueError(f"tensor {t.name!r}: {buf.nbytes} bytes given, {type_name(t.type)} {list(t.shape)} needs {want}")
                f.write(buf.tobytes())
                f.write(b"\0" * (-want % ALIGNMENT))
                if progress and (i + 1) % 50 == 0:
                    progress(f"wrote {i + 1}/{len(tensors)} tensors")
            size = f.tell()
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return size

