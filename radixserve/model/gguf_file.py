"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

`gguf.GGUFReader` builds a numpy view for every part of every field; for a tokenizer's
49,152 tokens and 48,900 merges that is about 2 s per process, paid by every worker at
every start and restart. `GGUFFile` reads the same header with `struct` (about 0.1 s):
``fields`` holds each metadata value as a plain Python value (what
`gguf.ReaderField.contents()` returns), ``tensors`` each tensor's name, type, GGUF-order
shape and its data as a read-only numpy view of the map, shaped as `gguf.GGUFReader`
shapes it (float types as elements, quantized types as bytes per row), so
`gguf.quants.dequantize` takes it as it is.

Layout (GGUF v2 and v3): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata
count; each metadata entry a string key, a u32 value type and the value (an array is a
u32 element type, a u64 length and the elements); each tensor a string name, u32 number
of dimensions, u64 per dimension, u32 type, u64 offset; the data from the next multiple
of ``general.alignment`` (default 32). A string is a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types: struct format of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_ELEMENT_DTYPES = {  # tensor types stored as elements, not blocks
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view of the memory map


class GGUFFile:
    """The metadata and tensors of the GGUF file at ``path`` (ValueError if it is not one,
    or truncated)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, mode="r")
        try:
            self._parse(self._map.data)
        except struct.error as exc:  # a read past the end of the file
            raise ValueError(f"the GGUF header ends early: {exc}") from exc

    def _parse(self, buf: memoryview) -> None:
        if bytes(buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        self._order: Literal["<", ">"] = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS})")
        self.version = version
        self._buf = buf
        tensor_count, kv_count = struct.unpack_from(self._order + "QQ", buf, 8)
        offset = 24
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            (kind,), offset = self._unpack("I", offset)
            self.fields[key], offset = self._value(kind, offset)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (n_dims,), offset = self._unpack("I", offset)
            dims, offset = self._unpack("Q" * n_dims, offset)
            (kind, data_offset), offset = self._unpack("IQ", offset)
            infos.append((name, dims, kind, data_offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    # -- parsing ----------------------------------------------------------------------

    def _unpack(self, fmt: str, offset: int) -> tuple[tuple[Any, ...], int]:
        values = struct.unpack_from(self._order + fmt, self._buf, offset)
        return values, offset + struct.calcsize("<" + fmt)

    def _string(self, offset: int) -> tuple[str, int]:
        strings, offset = self._strings(1, offset)
        return strings[0], offset

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(offset)
        if (fmt := _SCALARS.get(kind)) is not None:
            (value,), offset = self._unpack(fmt, offset)
            return value, offset
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} at byte {offset}")
        (item, length), offset = self._unpack("IQ", offset)
        if item == _STRING:
            return self._strings(length, offset)
        if (fmt := _SCALARS.get(item)) is not None:
            size = struct.calcsize("<" + fmt)
            end = offset + size * length
            if end > len(self._buf):
                raise ValueError(f"an array at byte {offset} runs past the end of the file")
            dtype = np.dtype(fmt).newbyteorder(self._order)
            return np.frombuffer(self._buf[offset:end], dtype=dtype).tolist(), end
        values = []  # arrays of arrays: rare, element by element
        for _ in range(length):
            value, offset = self._value(item, offset)
            values.append(value)
        return values, offset

    def _strings(self, count: int, offset: int) -> tuple[list[str], int]:
        buf, size, unpack = self._buf, len(self._buf), struct.Struct(self._order + "Q").unpack_from
        out = []
        for _ in range(count):
            (length,) = unpack(buf, offset)
            start = offset + 8
            offset = start + length
            if offset > size:
                raise ValueError(f"a string at byte {start - 8} runs past the end of the file")
            out.append(str(buf[start:offset], "utf-8"))
        return out, offset

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        tensor_type = GGMLQuantizationType(kind)
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * block_bytes // block
        start = self.data_offset + offset
        if start + n_bytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        np_shape = tuple(reversed(dims))
        raw = self._map[start : start + n_bytes]
        if (dtype := _ELEMENT_DTYPES.get(tensor_type)) is not None:
            data = raw.view(np.dtype(dtype).newbyteorder(self._order)).reshape(np_shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(np_shape, tensor_type))
        return GGUFTensor(name, tensor_type, tuple(dims), n_elements, n_bytes, start, data)
