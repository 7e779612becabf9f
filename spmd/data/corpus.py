"""Training data from local files: text, JSONL, Parquet, or token files (`--data PATH`).

Documents are tokenized and packed into one token stream, each followed by the
tokenizer's end-of-text token. Sample i is the window `stream[i*seq : i*seq + seq + 1]`
(inputs and their next tokens); the last samples are held out for evaluation when
`--eval-every` asks for it. The global order of the training samples is a seeded
permutation, drawn anew each epoch and indexed by (step, row): it does not depend on the
mesh or on the number of processes, and a process reads only the windows of its rows.

Token files (`.npy`, or raw `.bin` with `--token-dtype`) are memory-mapped: nothing but
the rows a process needs is read. Text sources are tokenized once, in memory, by every
process; for corpora of many gigabytes, tokenize once into a `.npy` file
(`python -m spmd.corpus`).

JSONL and Parquet texts must be strings: a record or row whose text is a number, a list
or null is refused, naming the file and the line or row (nothing is converted).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from spmd.base.cli import TOKEN_DTYPES
from spmd.base.console import human_bytes
from spmd.base.errors import UserError, file_kind, first_line, optional_module
from spmd.base.hardware import host_memory_bytes
from spmd.base.paths import read_text
from spmd.base.schema import REGULAR, Invalid, loads, not_a_file
from spmd.data.source import DataSource
from spmd.data.tokenizer import ByteTokenizer, check_memory, check_vocab, text_bytes

TEXT_SUFFIXES = (".txt", ".text", ".md")
# A UTF-8 byte-order mark: Windows editors begin a file with one. A JSONL file's is read
# past, as Python's utf-8-sig, pyarrow and `datasets` read past it.
UTF8_BOM = b"\xef\xbb\xbf"
SUFFIXES = {**dict.fromkeys(TEXT_SUFFIXES, "text"), ".jsonl": "jsonl", ".parquet": "parquet",
            ".npy": "tokens", ".bin": "tokens"}


def data_files(path: str) -> tuple[str, list[Path]]:
    """The kind of data under `path` ('text', 'jsonl', 'parquet' or 'tokens') and its
    files, in a fixed order (sorted paths, hidden files skipped). JSONL and Parquet files
    that hold no record are left out (a folder's empty shard), and refused when all are."""
    root = Path(path)
    kind = file_kind(root)
    if kind == "missing":
        raise UserError(f"--data {path}: no such file or directory")
    if kind not in (REGULAR, "a directory"):  # a device or a FIFO: nothing to read whole; a link into nowhere
        raise UserError(f"--data {path} {not_a_file(kind, 'a file or a folder')}")
    if root.is_file():
        files = [root]
    else:
        found = sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and not any(
            part.startswith(".") for part in p.relative_to(root).parts))
        odd = [p for p in found if not (p.is_file() or p.is_dir())]  # a FIFO would block, a loop never ends
        if odd:
            raise UserError(f"--data {path}: {odd[0]} is {file_kind(odd[0])}, not a data file")
        files = [p for p in found if p.is_file()]
    if not files:
        raise UserError(f"--data {path}: no data files ({', '.join(sorted(SUFFIXES))})")
    kinds = {SUFFIXES.get(p.suffix, "text") for p in files}  # a single file of any name is text
    if len(kinds) > 1:
        raise UserError(f"--data {path} mixes kinds of data ({', '.join(sorted(kinds))}); give one kind")
    kind = kinds.pop()
    if kind in ("jsonl", "parquet"):
        # Left out here, where every reader finds its files: an empty first file would
        # otherwise make records read as text (its first record says which they are).
        held = [(f, _no_records(kind, f)) for f in files]
        if all(why for _, why in held):
            if len(files) == 1:
                raise UserError(f"--data {path} holds no records ({held[0][1]})")
            raise UserError(f"--data {path} holds no records (none of its {len(files)} "
                            f"{'JSONL' if kind == 'jsonl' else 'Parquet'} files holds one)")
        files = [f for f, why in held if not why]
    return kind, files


def _no_records(kind: str, file: Path) -> str:
    """Why a JSONL or Parquet file holds no record ("" when it holds one): it is empty, or
    holds only blank lines, or no rows. A JSONL file is read up to its first record."""
    if kind == "parquet":
        optional_module("pyarrow", "Parquet files")
        # An optional dependency (spmd[data]): imported when a Parquet file is read.
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(file).metadata.num_rows
        except Exception as exc:  # pyarrow's own error types
            raise UserError(f"--data {file}: not a readable Parquet file ({first_line(exc)})") from None
        return "" if rows else "0 rows"
    try:
        with open(file, "rb") as f:
            piece = f.read(1 << 20).removeprefix(UTF8_BOM)
            empty = not piece
            while piece:
                if piece.strip():
                    return ""
                piece = f.read(1 << 20)
    except OSError as exc:
        raise UserError(f"--data {file} cannot be read: {exc.strerror or exc}") from None
    return "the file is empty" if empty else "only blank lines"


def documents(kind: str, files: Sequence[Path], text_field: str) -> Iterator[str]:
    for file in files:
        if kind == "text":
            yield read_text(file)
        elif kind == "jsonl":
            yield from jsonl_texts(file, text_field)
        else:
            yield from _parquet_texts(file, text_field)


_JSON_TYPES = {type(None): "null", str: "a string", bool: "a boolean", int: "a number", float: "a number",
               list: "an array", dict: "an object"}


def jsonl_texts(file: Path, field: str, flag: str = "--data", field_flag: str | None = "--text-field") -> Iterator[str]:
    """The string `field` of each record of a JSONL file; anything else is refused naming
    the line (`flag`: the option that named the file; `field_flag`: the one that names the field)."""
    # Training data may also be fine-tuning records (spmd.data.records), which the first record's fields announce.
    hint = (f" ({field_flag}), nor the fields of a fine-tuning record ('messages', or 'prompt' and 'completion')"
            if field_flag else "")
    try:
        data = file.read_bytes().removeprefix(UTF8_BOM)
    except OSError as exc:
        raise UserError(f"{flag} {file} cannot be read: {exc.strerror or exc}") from None
    # Split as bytes: a line ends at its newline only (str.splitlines also cuts at U+2028,
    # which JSON text may hold as it is), and a byte that is no UTF-8 is named by its line.
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{flag} {file}, line {number}: not UTF-8 text (byte {exc.start} of the line)") from None
        try:  # strictly: a key given twice, NaN or Infinity is no record either
            record = loads(line)
        except Invalid as exc:
            raise UserError(f"{flag} {file}, line {number}: {exc}") from None
        if not isinstance(record, dict):
            raise UserError(f"{flag} {file}, line {number}: {json_kind(record)}, not a JSON object")
        if field not in record:
            raise UserError(f"{flag} {file}, line {number}: no text field {field!r}{hint}")
        yield checked_text(record[field], f"{flag} {file}, line {number}", f"the text field {field!r}")


def json_kind(value) -> str:
    """What a JSON value is, for a message: "null", "a number", "an array", ..."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def checked_text(value, where: str, what: str) -> str:
    """`value` if it is Unicode text; else one line naming `where` (a file and line) and `what` (its field)."""
    if not isinstance(value, str):
        raise UserError(f"{where}: {what} is {json_kind(value)}, not a string")
    try:
        value.encode()
    except UnicodeEncodeError as exc:  # an escape like "\ud800": a lone surrogate is no character
        raise UserError(f"{where}: {what} holds a lone surrogate ({value[exc.start]!r}), "
                        f"which is no Unicode text") from None
    return value


def _parquet_texts(file: Path, field: str) -> Iterator[str]:
    optional_module("pyarrow", "Parquet files")
    # An optional dependency (spmd[data]): imported when a Parquet file is read.
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except Exception as exc:  # pyarrow's own error types
        raise UserError(f"--data {file}: not a readable Parquet file ({exc})") from None
    found = table.column_names.count(field)
    if found != 1:
        raise UserError(f"--data {file}: {'no' if not found else f'{found} columns named'} {field!r} (--text-field); "
                        f"it has {', '.join(table.column_names)}")
    column = table.column(field)
    kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise UserError(f"--data {file}: column {field!r} holds {column.type}, not strings (--text-field)")
    if column.null_count:
        row = pc.index(column.is_null(), True).as_py()
        raise UserError(f"--data {file}: column {field!r} is null in row {row}, not a string")
    yield from column.to_pylist()


def token_stream(path: str, tokenizer=None, text_field: str = "text", token_dtype: str = "uint16",
                 vocab: int | None = None) -> np.ndarray:
    """All of `path`'s tokens as one array: memory-mapped token files, or the documents
    tokenized and each followed by the end-of-text token. Token ids must fit `vocab`."""
    kind, files = data_files(path)
    if kind == "tokens":
        parts = [_token_file(f, token_dtype) for f in files]
        stream = parts[0] if len(parts) == 1 else Concatenated(parts)
        _check_ids(stream, vocab, path)
        return stream
    tokenizer = tokenizer or ByteTokenizer()
    if vocab is not None:
        check_vocab(tokenizer, vocab)
    # Text is tokenized in memory, by every process: more text than the host's memory
    # cannot be, and a host that runs out on the way says so in one line.
    size, memory = sum(f.stat().st_size for f in files), host_memory_bytes()
    advice = "make token files (.npy) of it with python -m spmd.corpus on a larger host, or give less text"
    if size > memory:
        raise UserError(f"--data {path}: {human_bytes(size)} of text, more than this host's memory "
                        f"({human_bytes(memory)}), and text is tokenized in memory; {advice}")
    try:
        return _tokenized(documents(kind, files, text_field), tokenizer, f"--data {path}", advice)
    except MemoryError:
        raise UserError(f"--data {path}: out of memory while tokenizing its {human_bytes(size)} of text; "
                        f"{advice}") from None


_BATCH_BYTES = 1 << 24  # the text tokenized at once: up to 1,024 documents, or one larger


def _tokenized(texts: Iterator[str], tokenizer, where: str, advice: str) -> np.ndarray:
    """The texts' tokens, each document followed by the end-of-text token; each batch of
    them checked against the memory free before it is tokenized (`where`, `advice`: the
    refusal's)."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    pieces: list[np.ndarray] = []
    eos = np.array([tokenizer.eos], dtype)
    batch: list[str] = []
    size = 0

    def tokenize(batch: list[str], size: int) -> None:
        check_memory(tokenizer, size, where, advice)
        pieces.extend(p for ids in tokenizer.encode(batch) for p in (ids.astype(dtype), eos))

    for text in texts:
        if not text:
            continue  # an empty document adds no separator either
        if batch and (len(batch) == 1024 or size + len(text) > _BATCH_BYTES):
            tokenize(batch, size)
            batch, size = [], 0
        batch.append(text)
        size += text_bytes(text)
    tokenize(batch, size)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)


def _token_file(file: Path, token_dtype: str) -> np.ndarray:
    if file.suffix == ".npy":
        try:
            tokens = np.load(file, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise UserError(f"--data {file}: not a NumPy array file ({exc})") from None
        if tokens.dtype.name not in TOKEN_DTYPES or tokens.ndim != 1:
            raise UserError(f"--data {file} holds a {tokens.ndim}-d {tokens.dtype} array; token files hold "
                            f"one 1-d array of {' or '.join(TOKEN_DTYPES)}")
        return tokens
    size = file.stat().st_size
    itemsize = np.dtype(token_dtype).itemsize
    if size % itemsize:
        raise UserError(f"--data {file}: {size} bytes is not a whole number of {token_dtype} tokens (--token-dtype)")
    return np.memmap(file, dtype=token_dtype, mode="r") if size else np.zeros(0, token_dtype)


class Concatenated:
    """Several memory-mapped token files read as one stream, without loading them: a
    slice is cut from the files it spans."""

    def __init__(self, parts: Sequence[np.ndarray]):
        if len({p.dtype for p in parts}) > 1:
            raise UserError(f"the token files mix dtypes ({', '.join(sorted({str(p.dtype) for p in parts}))})")
        self.parts, self.dtype = list(parts), parts[0].dtype
        self.starts = np.cumsum([0] + [p.size for p in parts])
        self.size = int(self.starts[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.size)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        for i in range(max(first, 0), len(self.parts)):
            if self.starts[i] >= stop:
                break
            pieces.append(self.parts[i][max(start - self.starts[i], 0):stop - self.starts[i]])
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)


def _check_ids(stream: np.ndarray, vocab: int | None, path: str) -> None:
    """Every id must be below the model's vocabulary; a uint16 file read as uint32 (or the
    wrong file) shows up here. Read in chunks: the file may not fit in memory."""
    if vocab is None or stream.size == 0:
        return
    chunk = 1 << 24
    top = max(int(stream[i:i + chunk].max()) for i in range(0, stream.size, chunk))
    if top >= vocab:
        raise UserError(f"--data {path}: token id {top:,} is outside the model's vocabulary of {vocab:,} "
                        f"(a file of another dtype than {stream.dtype}? see --token-dtype)")


def held_out_split(count: int, eval_fraction: float, counted: str) -> tuple[int, int]:
    """(training, held out) of `count` samples, the last `eval_fraction` of them held out;
    refused (`counted` says how many there are) when either part would be empty."""
    held_out = int(np.ceil(count * eval_fraction)) if eval_fraction else 0
    if count - held_out < 1 or (eval_fraction and held_out < 1):
        raise UserError(f"{counted}; too few for training{' and evaluation' if eval_fraction else ''}")
    return count - held_out, held_out


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    """Epoch `epoch`'s order of `count` samples: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(count)


def shuffled(index: np.ndarray, count: int, seed: int) -> np.ndarray:
    """The samples at positions `index` of the run's order: epoch after epoch of `count`
    samples, each epoch in its own order."""
    epochs, positions = np.divmod(index, count)
    return np.array([epoch_order(seed, int(e), count)[p] for e, p in zip(epochs, positions)], np.int64)


class TokenSource(DataSource):
    """Rows of packed samples, `length` tokens each, from one token stream.

    Row r of step k's batch is training sample `order[k * batch + r]` of its epoch; eval
    batch j is held-out samples in order, from sample j * batch. `rows_read` counts the
    training rows this process has read. `document_end`: the end-of-text token, when
    documents are not to see each other (--document-mask): rows are then packed rows
    (spmd.parallel.step), a document's segment ending with its end-of-text token."""

    def __init__(self, stream: np.ndarray, length: int, batch: int, seed: int, eval_fraction: float = 0.0,
                 name: str = "data", tokenizer: str = "tokens", document_end: int | None = None):
        self.stream, self.length, self.batch, self.seed = stream, length, batch, seed
        self.document_end, self.packed = document_end, document_end is not None
        self.name, self.tokenizer = name, tokenizer
        samples = (stream.size - 1) // (length - 1) if stream.size else 0
        self.train_samples, self.eval_samples = held_out_split(
            samples, eval_fraction, f"--data {name}: {stream.size:,} tokens make {samples} sample(s) of {length - 1} "
                                    f"tokens")
        self.rows_read, self.held_out_rows = 0, self.eval_samples

    def describe(self, seq: int) -> str:
        held_out = f", {self.eval_samples:,} held out" if self.eval_samples else ""
        return (f"{self.name}: {self.stream.size:,} tokens ({self.tokenizer}), {self.train_samples:,} samples of "
                f"{seq}{held_out}; an epoch is {self.train_samples / self.batch:,.1f} steps")

    def samples(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """The sample indices of rows [start, stop) of batch `step`."""
        index = step * self.batch + np.arange(start, stop)
        if split == "eval":
            return self.train_samples + index % self.eval_samples
        return shuffled(index, self.train_samples, self.seed)

    def rows(self, step: int, start: int, stop: int, length: int, split: str = "train") -> np.ndarray | dict:
        if length != self.length:
            raise ValueError(f"this source cuts samples of {self.length} tokens, not {length}")
        stride = self.length - 1
        rows = np.stack([self.stream[s * stride: s * stride + self.length] for s in self.samples(step, start, stop, split)])
        self.rows_read += stop - start if split == "train" else 0
        rows = rows.astype(np.int32)
        if self.document_end is None:
            return rows
        # A document's tokens, its end-of-text token included, share a segment; the next starts after it.
        ends_before = np.cumsum(rows == self.document_end, axis=1) - (rows == self.document_end)
        return {"tokens": rows, "segments": (1 + ends_before).astype(np.int32), "loss_mask": np.ones(rows.shape, bool)}


def write_npy(f, tokens: np.ndarray) -> None:
    """`tokens` as a .npy file. np.save's own write (ndarray.tofile) loses the reason of a
    failure (a full disk reads "N requested and M written"): the bytes go through the
    file, in 16 MiB pieces."""
    fmt = np.lib.format
    fmt.write_array_header_1_0(f, fmt.header_data_from_array_1_0(tokens))
    data = memoryview(np.ascontiguousarray(tokens).reshape(-1).view(np.uint8))
    for start in range(0, len(data), 1 << 24):
        f.write(data[start:start + (1 << 24)])
