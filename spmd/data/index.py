"""Where each fine-tuning record is, found once at start-up without parsing any: the byte
offsets of a JSONL file's lines (one pass over its bytes, about a second a gigabyte), a
Parquet file's rows, a `datasets` folder's rows (memory-mapped Arrow). Records are then
read by number, as training reaches them (spmd.data.stream).

A Parquet file is read whole into memory as Arrow on first use (its text, not tokens):
its row groups are compressed as a whole, so reading records in a shuffled order one
row group at a time would decompress a group for every record.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spmd.base.cli import MAX_RECORD_BYTES
from spmd.base.errors import UserError, first_line, optional_module
from spmd.data.corpus import UTF8_BOM
from spmd.data.records import Example, check_record_size, examples_of, file_records, record_files, record_format

CHUNK = 1 << 24  # bytes read at a time while looking for line ends
_BLANK_START = np.frombuffer(b" \t\r", np.uint8)  # a line starting so may hold nothing but blanks


class RecordIndex:
    """The records under `path`, numbered from 0 across its files in order; `formats[f]`
    is file f's format and where its first record is (one file holds one format). A JSONL
    line longer than `max_record_bytes` is refused before it is read."""

    def __init__(self, path: str, max_record_bytes: int = MAX_RECORD_BYTES):
        self.path, self.max_record_bytes = path, max_record_bytes
        self.kind, self.files = record_files(path)
        if self.kind == "text":
            raise UserError(f"--data {path}: text files are documents, not fine-tuning records")
        self._parts = [self._index(file) for file in self.files]
        self.starts = np.cumsum([0] + [_count(p) for p in self._parts]).astype(np.int64)
        self.formats = [_first_format(self.kind, file, max_record_bytes) for file in self.files]
        self._tables: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _index(self, file: Path):
        if self.kind == "jsonl":
            return line_spans(file)
        if self.kind == "parquet":
            optional_module("pyarrow", "Parquet files")
            # An optional dependency (spmd[data]): imported when a Parquet file is read.
            import pyarrow.parquet as pq

            try:
                return pq.ParquetFile(file).metadata.num_rows
            except Exception as exc:  # pyarrow's own error types
                raise UserError(f"--data {file}: not a readable Parquet file ({first_line(exc)})") from None
        return _datasets_folder(file)

    def read(self, numbers: Sequence[int]) -> list[tuple[str, object, str]]:
        """(where, record, its file's format) of each record (spmd.data.records.examples_of):
        a JSONL record is its line's bytes, parsed by whoever tokenizes it."""
        numbers = np.asarray(numbers, np.int64)
        files = np.searchsorted(self.starts, numbers, side="right") - 1
        out = []
        with contextlib.ExitStack() as stack:
            handles: dict[int, int] = {}  # file number -> its descriptor, opened once for these reads
            for number, f in zip(numbers.tolist(), files.tolist()):
                local, file = number - int(self.starts[f]), self.files[f]
                if self.kind != "jsonl":
                    out.append((f"--data {file}, row {local}", self._row(f, local), self.formats[f]))
                    continue
                starts, ends, lines = self._parts[f]
                where = f"--data {file}, line {int(lines[local])}"
                check_record_size(int(ends[local] - starts[local]), self.max_record_bytes, where)
                try:
                    if f not in handles:
                        handles[f] = stack.enter_context(open(file, "rb")).fileno()
                    raw = os.pread(handles[f], int(ends[local] - starts[local]), int(starts[local]))
                except OSError as exc:
                    raise UserError(f"--data {file} cannot be read: {exc.strerror or exc}") from None
                out.append((where, raw, self.formats[f]))
        return out

    def _row(self, f: int, row: int) -> dict:
        if f not in self._tables:
            if self.kind == "parquet":
                import pyarrow.parquet as pq  # an optional dependency, checked by _index

                self._tables[f] = pq.read_table(self.files[f])
            else:
                self._tables[f] = self._parts[f]
        table = self._tables[f]
        if self.kind == "parquet":
            return table.slice(row, 1).to_pylist()[0]
        return table[row]


def read_examples(path: str, tokenizer, loss_on: str = "completion",
                  max_record_bytes: int = MAX_RECORD_BYTES) -> list[Example]:
    """Every record under `path` as an example, in order, in this process."""
    index = RecordIndex(path, max_record_bytes)
    return examples_of(index.read(range(len(index))), tokenizer, loss_on, max_record_bytes)


def _count(part) -> int:
    return part[0].size if isinstance(part, tuple) else part if isinstance(part, int) else len(part)


def line_spans(file: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, line numbers) of the lines of `file` that hold something but blanks."""
    ends, size, bom = [], 0, False
    try:
        with open(file, "rb") as f:
            while chunk := f.read(CHUNK):
                bom = bom or size == 0 and chunk.startswith(UTF8_BOM)
                ends.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + size)
                size += len(chunk)
    except OSError as exc:
        raise UserError(f"--data {file} cannot be read: {exc.strerror or exc}") from None
    ends = np.concatenate(ends + [np.array([size], np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    if bom:  # the first line starts after it (read past, as spmd.data.corpus.UTF8_BOM says)
        starts[0] = len(UTF8_BOM)
    numbers = np.arange(1, starts.size + 1, dtype=np.int64)
    keep = ends > starts
    maybe_blank = np.flatnonzero(keep & np.isin(_first_bytes(file, starts, ends, size), _BLANK_START))
    if maybe_blank.size:  # rare: read each such line to see
        with open(file, "rb") as f:
            for i in maybe_blank:
                keep[i] = bool(os.pread(f.fileno(), int(ends[i] - starts[i]), int(starts[i])).strip())
    return starts[keep], ends[keep], numbers[keep]


def _first_bytes(file: Path, starts: np.ndarray, ends: np.ndarray, size: int) -> np.ndarray:
    """Each line's first byte (a newline for an empty line), from the file mapped in memory."""
    if not size:
        return np.zeros(starts.size, np.uint8)
    mapped = np.memmap(file, np.uint8, mode="r")
    return np.where(ends > starts, mapped[np.minimum(starts, size - 1)], 10)


def _first_format(kind: str, file: Path, max_record_bytes: int) -> tuple[str, str] | None:
    for where, record in file_records(kind, file, max_record_bytes):
        return record_format(record, where), where
    return None  # no records: none is read


def _datasets_folder(folder: Path):
    datasets = optional_module("datasets", "a datasets folder")
    try:
        return datasets.load_from_disk(str(folder)).with_format(None)
    except Exception as exc:  # datasets' and pyarrow's own error types
        raise UserError(f"--data {folder}: not a readable datasets folder ({first_line(exc)})") from None
