"""Reading and writing the safetensors format, one tensor at a time, with no torch.

A file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
[begin, end) byte offsets from the end of the header), then the tensors' bytes. Reading
checks the header against the file's size first, so a truncated or damaged file is
refused before anything is read, and then reads only the bytes of the tensor asked for.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(t): name for name, t in DTYPES.items()}
MAX_HEADER = 100 << 20  # as the reference implementation: a larger header is damage, not a model


class Damaged(ValueError):
    """A file that is not whole safetensors."""


class SafeTensors:
    """The tensors of one file: `shape(name)`, `read(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries, self.data_start = _read_header(self.path)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's dtype as the file names it (F32, BF16, ...)."""
        return self.entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        """The tensor's bytes, read from the file into a new array (nothing stays mapped)."""
        entry = self.entries[name]
        out = np.empty(entry["shape"], DTYPES[entry["dtype"]])
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry["data_offsets"][0])
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise Damaged(f"{self.path} ends inside tensor {name}")
                done += got
        return out


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise Damaged(f"{path} is too short to be a safetensors file ({size} bytes)")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER or 8 + length > size:
            raise Damaged(f"{path} is truncated or not safetensors (a header of {length} bytes in a file of {size})")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise Damaged(f"{path}: the header is not JSON; the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise Damaged(f"{path}: the header is not a mapping")
    header.pop("__metadata__", None)
    data = size - 8 - length
    ends = 0
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            shape, dtype = [int(n) for n in entry["shape"]], entry["dtype"]
            nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        except (KeyError, TypeError, ValueError):
            raise Damaged(f"{path}: tensor {name}'s entry is malformed ({entry!r})") from None
        if not 0 <= begin <= end or end - begin != nbytes or min(shape, default=0) < 0:
            raise Damaged(f"{path}: tensor {name} has {end - begin} bytes for shape {shape} of {dtype}")
        ends = max(ends, end)
        entry["shape"] = shape
    if ends > data:
        raise Damaged(f"{path} is truncated: its tensors need {ends} bytes of data, the file has {data}")
    return header, 8 + length


class Writer:
    """Writes one file whose tensors are all declared up front (`names`, `shapes`, `dtype`),
    then given in that order with `write`; the header is complete before any data."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in entries:
            nbytes = math.prod(shape) * self.dtype.itemsize
            header[name] = {"dtype": NAMES[self.dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.expected = [(name, tuple(shape)) for name, shape in entries]
        self.file = open(path, "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, array: np.ndarray) -> None:
        want_name, want_shape = self.expected.pop(0)
        if (name, tuple(array.shape)) != (want_name, want_shape):
            raise ValueError(f"expected {want_name} {want_shape}, got {name} {array.shape}")
        self.file.write(np.ascontiguousarray(array, self.dtype).view(np.uint8).reshape(-1).data)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.expected:
            raise ValueError(f"{self.path}: {len(self.expected)} tensors were never written")
