"""Safetensors files memory-mapped: each tensor as a read-only numpy view of the file, no copy.

The `safetensors` package reads a tensor into a new array (`get_tensor`); a loader that then
transposes, stacks and fuses copies every weight three more times. A view of the mapped file lets
the loader copy each weight once, straight into its final buffer (`jaxlora.loading.hf_placement`).
The header is the format's documented one: an 8-byte little-endian length, then a JSON object
mapping each name to its dtype, shape and [begin, end) byte offsets in the data that follows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxlora.errors import ModelLoadError

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}  # dtype -> its header code
# A header longer than this is not a weight file's (real ones are a few hundred KB).
MAX_HEADER_BYTES = 100 << 20


@dataclasses.dataclass(frozen=True)
class MappedTensor:
    """One tensor of a mapped file: `array()` is a read-only view (no bytes read until touched)."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    buffer: mmap.mmap = dataclasses.field(repr=False, compare=False)
    offset: int  # absolute byte offset in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        return np.frombuffer(self.buffer, self.dtype, math.prod(self.shape), self.offset).reshape(self.shape)

    def will_need(self) -> None:
        """Asks the kernel to read the tensor's pages ahead (a no-op where madvise is missing)."""
        if not hasattr(mmap, "MADV_WILLNEED") or not self.nbytes:
            return
        start = self.offset - self.offset % mmap.PAGESIZE
        self.buffer.madvise(mmap.MADV_WILLNEED, start, self.offset + self.nbytes - start)


class UnsupportedDtypeError(ModelLoadError):
    """A tensor's dtype code is none of `DTYPES` (the file itself may be sound)."""

    def __init__(self, path: Path, name: str, code: str) -> None:
        known = ", ".join(DTYPES)
        super().__init__(
            f"{path}: cannot read safetensors file (tensor {name}: dtype {code} is not supported: {known})"
        )
        self.name, self.code = name, code


def _bad(path: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: cannot read safetensors file ({why})")


def _header(path: Path, buffer: mmap.mmap) -> tuple[dict, int]:
    """The parsed header and where the data starts."""
    size = len(buffer)
    if size < 8:
        raise _bad(path, "shorter than its header length")
    (n,) = struct.unpack("<Q", buffer[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise _bad(path, f"header length {n} does not fit a file of {size} bytes")
    try:
        header = json.loads(bytes(buffer[8 : 8 + n]))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _bad(path, f"invalid header: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    return header, 8 + n


def _entry(path: Path, name: str, info: object, data_start: int, size: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, absolute offset) of one header entry, checked against the file's size."""
    try:
        code = info["dtype"]  # type: ignore[index]
        shape, offsets = info["shape"], info["data_offsets"]  # type: ignore[index]
    except (KeyError, TypeError) as e:
        raise _bad(path, f"tensor {name}: not an entry with dtype, shape and data_offsets ({e})") from None
    if not isinstance(code, str):
        raise _bad(path, f"tensor {name}: malformed dtype {str(code)[:40]}")
    if code not in DTYPES:
        raise UnsupportedDtypeError(path, name, code[:40])
    dtype = DTYPES[code]
    # Exact Python ints only: a float, a bool or a huge number is a damaged header, not a size.
    ints = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
    if not ints or not all(type(x) is int and 0 <= x < 2**62 for x in (*shape, *offsets)):
        raise _bad(path, f"tensor {name}: malformed shape {str(shape)[:80]} or offsets {str(offsets)[:80]}")
    shape = tuple(shape)
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes or data_start + end > size:
        raise _bad(path, f"tensor {name}: bytes [{begin}, {end}) do not hold {shape} {dtype} in a file of {size} bytes")
    return dtype, shape, data_start + begin


def map_file(path: Path) -> dict[str, MappedTensor]:
    """name -> MappedTensor of every tensor in `path` (the mapping stays open while a view lives).
    Raises ModelLoadError for a truncated or malformed file."""
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise _bad(path, str(e)) from None
    header, data_start = _header(path, buffer)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offset = _entry(path, name, info, data_start, len(buffer))
        out[name] = MappedTensor(path, dtype, shape, buffer, offset)
    return out


def map_files(files: list[Path]) -> dict[str, MappedTensor]:
    """Every tensor of `files`; a name in two files is a ModelLoadError."""
    out: dict[str, MappedTensor] = {}
    for path in files:
        for name, tensor in map_file(path).items():
            if name in out:
                raise ModelLoadError(f"{path}: tensor {name} is also in {out[name].file}")
            out[name] = tensor
    return out
