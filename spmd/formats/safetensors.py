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

from spmd.base.schema import NATURAL, STRING, Field, Invalid, check, list_of, loads, mapping_of

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

    def same(self, name: str, other: SafeTensors, other_name: str, chunk: int = 1 << 24) -> bool:
        """Whether tensor `name` and `other`'s `other_name` hold the same dtype, shape and
        bytes (compared a chunk at a time: neither is read whole)."""
        a, b = self.entries[name], other.entries[other_name]
        if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]):
            return False
        start_a, start_b = self.data_start + a["data_offsets"][0], other.data_start + b["data_offsets"][0]
        left = a["data_offsets"][1] - a["data_offsets"][0]
        with open(self.path, "rb") as fa, open(other.path, "rb") as fb:
            fa.seek(start_a)
            fb.seek(start_b)
            while left:
                n = min(chunk, left)
                if fa.read(n) != fb.read(n):
                    return False
                left -= n
        return True

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


# The header's schema: each tensor's entry, and the optional string-to-string metadata.
ENTRY = (Field("dtype", STRING, choices=tuple(DTYPES)),
         Field("shape", list_of(NATURAL, "non-negative integers")),
         Field("data_offsets", list_of(NATURAL, "non-negative integers", length=2)))
METADATA = Field("__metadata__", mapping_of(STRING, "strings"), default=None, nullable=True)


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise Damaged(f"{path} is too short to be a safetensors file ({size} bytes)")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER or 8 + length > size:
            raise Damaged(f"{path} is truncated or not safetensors (a header of {length} bytes in a file of {size})")
        text = f.read(length)
    try:
        header = loads(text)
        if not isinstance(header, dict):
            raise Invalid("", "is not a mapping")
        METADATA.check(header.pop("__metadata__", None))
        for name, entry in header.items():
            check(entry, ENTRY, f"tensor {name} ", others="is not a field of a tensor's entry")
    except Invalid as exc:
        raise Damaged(f"{path}: {exc}" if exc.field else f"{path}: the header {exc}; the file is damaged or not "
                      "safetensors") from None
    _check_offsets(path, header, size - 8 - length)
    return header, 8 + length


def _check_offsets(path: Path, header: dict, data: int) -> None:
    """Each tensor's bytes fit its shape, and the tensors tile the data: in order, neither
    overlapping nor leaving gaps, ending where the file ends (as the reference reader)."""
    end, last = 0, None
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = entry["data_offsets"]
        nbytes = math.prod(entry["shape"]) * np.dtype(DTYPES[entry["dtype"]]).itemsize
        if stop - begin != nbytes:
            raise Damaged(f"{path}: tensor {name} has {stop - begin} bytes (data_offsets {[begin, stop]}) for shape "
                          f"{entry['shape']} of {entry['dtype']} ({nbytes} bytes)")
        if begin != end:
            after = f"tensor {last} ends" if last else "the data begins"
            raise Damaged(f"{path}: tensor {name} begins at byte {begin} of the data, where {after} at {end} "
                          "(tensors must be contiguous, not overlapping)")
        end, last = stop, name
    if end > data:
        raise Damaged(f"{path} is truncated: its tensors need {end} bytes of data, the file has {data}")
    if end < data:
        raise Damaged(f"{path} has {data - end} bytes after its last tensor; the file is damaged or not safetensors")


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
