"""Pre-packed rows: fine-tuning records tokenized and packed once (`python -m spmd.corpus
--seq N`) into one .npy file, memory-mapped by training as token files are.

The file holds one array of shape (rows, seq + 1) whose fields are a row's `tokens`,
`segments` and `loss_mask` (PACKED), the rows of spmd.data.packing in the records' order.
Training reads it as spmd.data.corpus.TokenSource reads a token file: row r of step k's
batch is training row `order[k * batch + r]` of its epoch (a seeded permutation per epoch),
the held-out rows are the last ones, and an evaluation visits each row once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spmd.base.errors import UserError
from spmd.data.corpus import held_out_split, shuffled
from spmd.data.packing import Packing
from spmd.data.source import DataSource

PACKED = np.dtype([("tokens", "<i4"), ("segments", "<i4"), ("loss_mask", "?")])


def as_packed(rows: dict[str, np.ndarray]) -> np.ndarray:
    """A batch of packed rows (spmd.data.packing.Packing.batch) as PACKED records."""
    out = np.empty(rows["tokens"].shape, PACKED)
    for name in PACKED.names:
        out[name] = rows[name]
    return out


def read_packed(path: str) -> np.ndarray | None:
    """The memory-mapped rows of a pre-packed .npy file; None for any other file."""
    file = Path(path)
    if file.suffix != ".npy" or not file.is_file():
        return None
    try:
        rows = np.load(file, mmap_mode="r", allow_pickle=False)
    except ValueError:
        return None  # spmd.data.corpus names what is wrong with a token file
    if rows.dtype.names is None:
        return None
    if rows.dtype != PACKED or rows.ndim != 2:
        raise UserError(f"--data {path} holds a {rows.ndim}-d array of fields {', '.join(rows.dtype.names)}; "
                        f"pre-packed rows are 2-d, of fields tokens (int32), segments (int32) and loss_mask (bool)")
    return rows


CHUNK_TOKENS = 1 << 22  # of the rows checked at a time: the file is memory-mapped, maybe larger than memory


def check_rows(rows: np.ndarray, vocab: int | None, name: str) -> np.ndarray:
    """Each row's count of target tokens, once every row is checked to be one that
    spmd.data.packing makes; anything else would train on what no example holds, or
    silently on nothing. Refused naming the first row that is not."""
    counts, chunk_rows = np.zeros(len(rows), np.int64), max(1, CHUNK_TOKENS // rows.shape[1])
    for start in range(0, len(rows), chunk_rows):
        chunk = rows[start:start + chunk_rows]
        for what, bad in _problems(chunk, vocab):
            if bad.any():
                raise UserError(f"--data {name}: row {start + int(np.flatnonzero(bad)[0]):,} {what}; pre-packed rows "
                                f"are python -m spmd.corpus --seq's")
        counts[start:start + len(chunk)] = chunk["loss_mask"].sum(axis=1)
    return counts


def _problems(chunk: np.ndarray, vocab: int | None) -> list[tuple[str, np.ndarray]]:
    """(what is wrong, the rows where it is) of a chunk of rows: a row's token ids are in
    [0, vocab); its segments are 1, 1, 2, 2, 2, 3, ... from its start, then padding (segment
    0, token 0, no target); no segment's first token is a target (nothing before it in the
    segment predicts it)."""
    tokens, segments, loss = chunk["tokens"], chunk["segments"], chunk["loss_mask"]
    before, after = segments[:, :-1], segments[:, 1:]
    follows = (after == before) | ((before > 0) & ((after == before + 1) | (after == 0)))
    first = np.zeros(segments.shape, bool)  # a segment's first token
    first[:, 0], first[:, 1:] = True, after != before
    problems = [("holds a negative token id", (tokens < 0).any(axis=1))]
    if vocab is not None:
        problems.append((f"holds a token id outside the model's vocabulary of {vocab:,} (packed with another "
                         f"tokenizer?)", (tokens >= vocab).any(axis=1)))
    return problems + [
        ("does not start with segment 1", segments[:, 0] != 1),
        ("numbers its segments out of order (1, 1, 2, 2, 2, 3, ..., then padding, 0)", ~follows.all(axis=1)),
        ("holds a token or a target on padding (segment 0)", ((segments == 0) & ((tokens != 0) | loss)).any(axis=1)),
        ("has a target on a segment's first token, which nothing in its segment predicts",
         (loss & first & (segments > 0)).any(axis=1)),
    ]


class PackedFileSource(DataSource):
    """The rows of a pre-packed file, served by (step, row)."""

    packed = True  # its rows are dicts of tokens, segments and loss masks (spmd.parallel.step)
    finite = True  # an evaluation visits each row once (spmd.inference.evaluation)

    def __init__(self, rows: np.ndarray, length: int, batch: int, seed: int, eval_fraction: float = 0.0,
                 name: str = "data", vocab: int | None = None):
        if rows.shape[1] != length:
            raise UserError(f"--data {name} holds rows of {rows.shape[1]} tokens, packed for --seq "
                            f"{rows.shape[1] - 1}; this run has --seq {length - 1}")
        self.stored, self.length, self.batch, self.seed, self.name = rows, length, batch, seed, name
        self.train_samples, self.eval_samples = held_out_split(len(rows), eval_fraction,
                                                               f"--data {name}: {len(rows):,} row(s)")
        targets = check_rows(rows, vocab, name)
        if not targets[:self.train_samples].any():
            raise UserError(f"--data {name}: no target tokens (loss_mask) in its {self.train_samples:,} training "
                            f"row(s)")
        if self.eval_samples and not targets[self.train_samples:].any():
            raise UserError(f"--data {name}: no target tokens in the held-out examples (--eval-fraction)")
        self.rows_read = 0

    def describe(self, seq: int) -> str:
        held_out = f", {self.eval_samples:,} held out" if self.eval_samples else ""
        return (f"{self.name}: {len(self.stored):,} pre-packed rows of {seq}{held_out}; an epoch is "
                f"{self.train_samples / self.batch:,.1f} steps")

    def _indices(self, step: int, start: int, stop: int, split: str) -> np.ndarray:
        index = step * self.batch + np.arange(start, stop)
        if split == "eval":
            return np.where(index < self.eval_samples, self.train_samples + index, -1)
        if split == "in order":
            return np.where(index < self.train_samples, index, -1)
        return shuffled(index, self.train_samples, self.seed)

    def rows(self, step: int, start: int, stop: int, length: int, split: str = "train") -> dict[str, np.ndarray]:
        out = Packing.empty_batch(stop - start, length)
        for i, r in enumerate(self._indices(step, start, stop, split).tolist()):
            if r >= 0:  # past an ordered split's end: padding
                row = self.stored[r]
                for name in PACKED.names:
                    out[name][i] = row[name]
        self.rows_read += stop - start if split == "train" else 0
        return out

    def has_rows(self, row: int, split: str) -> bool:
        return row < (self.eval_samples if split == "eval" else self.train_samples)
