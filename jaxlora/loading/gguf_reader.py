"""A GGUF file's metadata and tensors, read in one pass over a memory map.

Layout (little-endian, versions 2 and 3): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry is a key (u64 length + UTF-8 bytes), a value type u32 and its value
(an array: element type u32, count u64, elements); then per tensor its name, dims count u32, dims
u64 (innermost first), ggml type u32 and data offset u64, relative to the data section, which starts
at the next multiple of `general.alignment` (32 by default).

The `gguf` package's reader makes two numpy views per string, so the tokenizer's ~100,000 strings
(vocabulary and merges) took most of a second start's model load; here a string array is one loop
of slices. Tensor data stays a view of the map, in the `gguf` reader's layout (numpy order; a
quantized row is its bytes), so `gguf.quants.dequantize` reads it as before.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxlora.errors import ModelLoadError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# Fixed-size value types: struct format (little-endian).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# The same types as numpy dtypes, for numeric arrays read whole.
_DTYPES = {t: np.dtype(f) for t, f in _SCALARS.items()}
_T = gguf.GGMLQuantizationType
# Tensor types whose data is a plain numpy array (the others are bytes per row).
_PLAIN = {
    _T.F32: np.float32,
    _T.F16: np.float16,
    _T.F64: np.float64,
    _T.I8: np.int8,
    _T.I16: np.int16,
    _T.I32: np.int32,
    _T.I64: np.int64,
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `data` is a read-only view of the file, [*reversed(dims)] of its element type, or
    for a quantized type uint8 [*reversed(dims)[:-1], bytes per row]."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """fields: metadata key -> value (int, float, bool, str, or a list of them); tensors in file order."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: Path) -> GGUFFile:
    """Parses `path`. Raises ModelLoadError for a file that is missing, not GGUF, of an unknown
    version or value type, or cut short."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    data = np.memmap(path, mode="r")
    try:
        return _Parser(data).parse()
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


class _Parser:
    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.buf = memoryview(data)
        self.at = 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):  # a slice past the end would be short, not an error
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return str(self.buf[self.at - n : self.at], "utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.take(_SCALARS[kind])

    def array(self) -> list:
        kind, count = self.take("<I"), self.take("<Q")
        if kind in _DTYPES:
            values = np.frombuffer(self.buf, _DTYPES[kind], count, self.at)
            self.at += values.nbytes
            return values.tolist()
        return [self.value(kind) for _ in range(count)]

    def parse(self) -> GGUFFile:
        if bytes(self.buf[:4]) != _MAGIC:
            raise ValueError("no GGUF magic")
        self.at = 4
        version = self.take("<I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian files read as a huge version); read: {_VERSIONS}")
        num_tensors, num_fields = self.take("<Q"), self.take("<Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self.string()
            if key in fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            fields[key] = self.value(self.take("<I"))
        infos = [self.tensor_info() for _ in range(num_tensors)]
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self.at // alignment) * alignment
        return GGUFFile(fields=fields, tensors=[self.tensor(start, *info) for info in infos])

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        dims = tuple(self.take("<Q") for _ in range(self.take("<I")))
        return name, dims, self.take("<I"), self.take("<Q")

    def tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        ttype = _T(kind)
        shape = tuple(reversed(dims))
        block, type_bytes = gguf.GGML_QUANT_SIZES[ttype]
        if ttype in _PLAIN:
            dtype = np.dtype(_PLAIN[ttype])
        elif block == 1:  # BF16: its bytes, as the gguf reader gives it
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] * type_bytes)
        else:
            if shape[-1] % block:
                raise ValueError(f"tensor {name}: row of {shape[-1]} is not whole {ttype.name} blocks of {block}")
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * type_bytes)
        count = int(np.prod(shape))
        begin = start + offset
        if begin + count * dtype.itemsize > self.data.size:
            raise ValueError(f"tensor {name} runs past the end of the file")
        return GGUFTensor(
            name=name,
            tensor_type=ttype,
            data=self.data[begin : begin + count * dtype.itemsize].view(dtype).reshape(shape),
        )
