"""A GGUF file read in one pass: its metadata, its tensor index, its tensors' bytes mapped.

Why not `gguf.GGUFReader`: it builds NumPy views for every part of every metadata value,
about 5 s per open for SmolLM2-135M's 49k-token vocabulary and 49k merges, and the
loader needs the file for the config, the weights and the tokenizer. This reader decodes
the metadata with `struct` straight from a memory map (a fraction of a second) and keeps
the tensor data mapped, not read; dequantisation stays the `gguf` package's.

Layout (GGUF v2 and v3, little-endian): "GGUF", version u32, tensor count u64, metadata
count u64; metadata entries (key string, value type u32, value); tensor infos (name,
n_dims u32, dims u64 innermost first, type u32, offset u64); the data section at the
next multiple of `general.alignment` (default 32), each tensor at its offset there.
Strings are a u64 length and UTF-8 bytes; arrays an item type u32, a u64 count, items.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (innermost dimension first), `tensor_type` a
    ggml type number, `data` its bytes as uint8 [*outer dims, bytes per row] (the form
    `gguf.quants.dequantize` takes), mapped from the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """The metadata (key -> value: numbers, strings, lists) and the tensors by name."""

    path: Path
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Reads values from a buffer at a moving offset."""

    def __init__(self, buf: Any):
        self.buf, self.off = buf, 0

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar(10)
        if self.off + n > len(self.buf):
            raise EOFError("a string runs past the end of the file")
        text = self.buf[self.off : self.off + n].decode("utf-8")
        self.off += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar(4), self.scalar(10)
            if item in _NUMPY:  # (numbers in one read)
                arr = np.frombuffer(self.buf, _NUMPY[item], count, self.off)
                self.off += arr.nbytes
                return arr.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(kind)


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensors (ValueError naming the file when it is not a GGUF
    v2/v3 file, is truncated or corrupt, or names a tensor type `gguf` does not know)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        return _parse(path, buf, size)
    except (struct.error, EOFError, UnicodeDecodeError, ValueError, KeyError) as e:
        if isinstance(e, ValueError) and str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({e})") from e


def _parse(path: Path, buf: Any, size: int) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    cur.off = 4
    version = cur.scalar(4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cur.scalar(10), cur.scalar(10)
    fields = {}
    for _ in range(num_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar(4))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.scalar(10) for _ in range(cur.scalar(4)))
        infos.append((name, dims, cur.scalar(4), cur.scalar(10)))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.off // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        rows = dims[::-1]  # (outermost first)
        row_bytes = rows[-1] // block * type_bytes
        count = int(np.prod(rows[:-1], dtype=np.int64)) * row_bytes
        if start + offset + count > size:
            raise ValueError(f"{path}: truncated GGUF file: tensor {name} ends past the end "
                             f"of the file ({size} bytes)")
        data = np.frombuffer(buf, np.uint8, count, start + offset)
        tensors[name] = GGUFTensor(name, dims, kind, data.reshape(*rows[:-1], row_bytes))
    return GGUFFile(path, fields, tensors)
