"""Fine-tuning records served as packed rows by (step, row), tokenized and packed as
training reaches them, so that start-up costs one pass over the file's bytes
(spmd.data.index), not its tokenization.

Training: epoch e's order of the training examples is a seeded permutation (seed, e),
cut into windows of WINDOW examples; each window is packed by best-fit decreasing
(spmd.data.packing) into rows, and the run's rows are the windows' rows one after another,
epoch after epoch. Row g of step k's batch (g = k * batch + r) is therefore fixed by the
data, --seed and --seq alone: not by the mesh, the batch's split or the number of
processes. A window's row count is known once it is packed, so the stream is walked
forward: from row 0, or from the position a checkpoint saved (`state`, `resume`). Every
process walks every window (each needs the count of rows before its own), with its own
worker processes (spmd.data.workers) tokenizing the next windows while the devices step.

Evaluation: the held-out examples (the last `eval_fraction` of them) and, for spmd.eval,
the training examples come in order ("eval", "in order"), windows in order, each row once;
past the end, padding rows.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading

import numpy as np

from spmd.base.cli import MAX_RECORD_BYTES
from spmd.base.errors import UserError
from spmd.data.corpus import epoch_order, held_out_split
from spmd.data.index import RecordIndex
from spmd.data.packing import Packing, pack
from spmd.data.source import DataSource
from spmd.data.tokenizer import check_vocab, load_tokenizer_directory
from spmd.data.workers import Failed, Tokenizing, default_workers

WINDOW = 2048  # examples packed together: best fit within them fills rows as tightly as over all
AHEAD = 2  # windows tokenized ahead of the one being read (by the worker processes)
KEEP = 3  # packed windows kept in memory


class _Stream:
    """Rows of windows packed one after another; `examples_of(n)` names window n's
    examples (record numbers), None past the end."""

    def __init__(self, examples_of, pack_window, submit, first: tuple[int, int] = (0, 0)):
        self._examples_of, self._pack_window, self._submit = examples_of, pack_window, submit
        self.first_window, self.starts = first[0], [first[1]]  # starts[i]: first row of window first_window + i
        self._packed: collections.OrderedDict[int, Packing | None] = collections.OrderedDict()
        self._pending: dict[int, object] = {}
        self._lock = threading.Lock()  # training's prefetch thread and evaluations may both read

    def locate(self, row: int) -> tuple[Packing, int] | None:
        """The packed window that holds `row` and its row there; None past the end."""
        with self._lock:
            while True:
                i = bisect.bisect_right(self.starts, row) - 1
                if i < 0:
                    raise ValueError(f"row {row} is before this stream's first known window")
                packing = self._window(self.first_window + i)
                if packing is None:
                    return None
                if row < self.starts[i] + packing.rows:
                    return packing, row - self.starts[i]
                if i == len(self.starts) - 1:  # the next window starts where this one ends
                    self.starts.append(self.starts[i] + packing.rows)

    def known_start(self, row: int) -> tuple[int, int]:
        """(window, first row) of the last window known to start at or before `row`."""
        with self._lock:
            i = max(bisect.bisect_right(self.starts, row) - 1, 0)
            return self.first_window + i, self.starts[i]

    def rows(self, rows: np.ndarray, length: int) -> dict[str, np.ndarray]:
        out = Packing.empty_batch(len(rows), length)
        for i, row in enumerate(rows.tolist()):
            found = self.locate(row)
            if found is not None:
                found[0].row_into(out, i, found[1])
        return out

    def _window(self, n: int) -> Packing | None:
        if n in self._packed:
            self._packed.move_to_end(n)
            return self._packed[n]
        examples = self._examples_of(n)
        pending = self._pending.pop(n, None) or (self._submit(examples) if examples is not None else None)
        for m in range(n + 1, n + 1 + AHEAD):  # the next windows, started while this one is read
            if m not in self._pending and m not in self._packed and (ahead := self._examples_of(m)) is not None:
                self._pending[m] = self._submit(ahead, later=True)
        self._pending = {m: p for m, p in self._pending.items() if m > n and p is not None}
        packing = None if pending is None else self._pack_window(n, pending.result())
        self._packed[n] = packing
        while len(self._packed) > KEEP:
            self._packed.popitem(last=False)
        return packing


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows a source is asked for: `length` tokens each, `batch` of them a step, the
    training examples in an order drawn from `seed` each epoch, the last `eval_fraction` of
    the examples held out for evaluation."""
    length: int
    batch: int
    seed: int = 0
    eval_fraction: float = 0.0


class RecordSource(DataSource):
    """Fine-tuning records (a spmd.data.index.RecordIndex), packed into `rows` (`Rows`) as
    they are asked for, a record longer than a row cut as `overlong` says; tokenized by
    `tokenizing` (spmd.data.workers). `name` and `tokenizer` name the data and the
    tokenizer in what it says."""

    packed = True  # its rows are dicts of tokens, segments and loss masks (spmd.parallel.step)
    finite = True  # an evaluation visits each example once (spmd.inference.evaluation)

    def __init__(self, index, tokenizing, rows: Rows, name: str = "data", tokenizer: str = "tokens",
                 overlong: str = "truncate"):
        length, seed = rows.length, rows.seed
        self.index, self.tokenizing, self.length, self.batch, self.seed = index, tokenizing, length, rows.batch, seed
        self.name, self.tokenizer, self.overlong = name, tokenizer, overlong
        examples = len(index)
        self.train_examples, self.held_out = held_out_split(examples, rows.eval_fraction,
                                                            f"--data {name}: {examples:,} example(s)")
        self.epoch_windows = -(-self.train_examples // WINDOW)
        self.counts = collections.Counter()  # of the training windows packed so far (first packing of each)
        self._empty_windows = 0  # training windows in a row without a target token
        self._train = self._training_stream()
        self._in_order = _Stream(lambda n: self._range(n, 0, self.train_examples), self._pack_ordered, self._submit)
        self._eval = _Stream(lambda n: self._range(n, self.train_examples, examples), self._pack_ordered,
                             self._submit)
        self.rows_read = 0
        # What a saved position is valid for: the same examples, rows and order.
        self._identity = {"records": examples, "held_out": self.held_out, "length": length, "seed": seed,
                          "window_examples": WINDOW, "overlong": overlong, "loss_on": tokenizing.loss_on}
        # The first window now: a bad record or a template that fails stops the run here.
        self.first = self._train.locate(0)[0]

    def _training_stream(self, first: tuple[int, int] = (0, 0)) -> _Stream:
        return _Stream(self._training_window, self._pack_training, self._submit, first)

    def _training_window(self, n: int) -> np.ndarray:
        epoch, w = divmod(n, self.epoch_windows)
        return epoch_order(self.seed, epoch, self.train_examples)[w * WINDOW:(w + 1) * WINDOW]

    @staticmethod
    def _range(n: int, start: int, stop: int) -> np.ndarray | None:
        first = start + n * WINDOW
        return np.arange(first, min(first + WINDOW, stop)) if first < stop else None

    def _submit(self, numbers: np.ndarray, later: bool = False):
        if later and not self.tokenizing.workers:  # in this process: only when needed
            return None
        try:
            items = self.index.read(numbers)
        except UserError as exc:  # a record over its bound stops the run when training reaches it, as a bad one does
            return Failed(exc)
        return self.tokenizing.submit(items)

    def _pack_training(self, n: int, examples) -> Packing:
        packing = pack(examples, self.length, self.overlong, self.name, empty=True)
        self.counts.update(examples=packing.examples, rows=packing.rows, targets=packing.targets,
                           truncated=packing.truncated, split=packing.split, dropped=packing.dropped)
        self._empty_windows = 0 if packing.rows else self._empty_windows + 1
        if self._empty_windows >= self.epoch_windows:  # a whole epoch without a target: no end to the walk
            within = f" within its first {self.length} tokens" if packing.truncated else ""
            raise UserError(f"--data {self.name}: no target tokens: none of its {self.train_examples:,} training "
                            f"example(s) has a token to learn after its first{within}")
        return packing

    def _pack_ordered(self, n: int, examples) -> Packing:
        return pack(examples, self.length, self.overlong, self.name, empty=True)

    def describe(self, seq: int) -> str:
        first, held_out = self.first, f", {self.held_out:,} held out" if self.held_out else ""
        cut = ", ".join(f"{getattr(first, k):,} {k}" for k in ("truncated", "split", "dropped") if getattr(first, k))
        cut = f" ({cut})" if cut else ""
        if self.epoch_windows == 1:
            return (f"{self.name}: {len(self.index):,} examples ({self.tokenizer}){held_out}; the {self.train_examples:,} "
                    f"for training packed into {first.rows:,} rows of {seq}, {first.targets:,} target tokens{cut}; "
                    f"an epoch is {first.rows / self.batch:,.1f} steps")
        steps = first.rows * self.train_examples / WINDOW / self.batch
        return (f"{self.name}: {len(self.index):,} examples ({self.tokenizer}){held_out}, packed into rows of {seq} as "
                f"training reaches them, {WINDOW:,} at a time; the first {WINDOW:,}: {first.rows:,} rows, "
                f"{first.targets:,} target tokens{cut}; an epoch is about {steps:,.1f} steps")

    def packed_so_far(self) -> str:
        """What the training windows packed so far held (the end of a run reports it)."""
        c = self.counts
        cut = "".join(f", {c[k]:,} {k}" for k in ("truncated", "split", "dropped") if c[k])
        return f"packed {c['examples']:,} examples into {c['rows']:,} rows, {c['targets']:,} target tokens{cut}"

    def rows(self, step: int, start: int, stop: int, length: int, split: str = "train") -> dict[str, np.ndarray]:
        if length != self.length:
            raise ValueError(f"this source packs rows of {self.length} tokens, not {length}")
        rows = self._stream(split).rows(step * self.batch + np.arange(start, stop), length)
        self.rows_read += stop - start if split == "train" else 0
        return rows

    def has_rows(self, row: int, split: str) -> bool:
        """Whether an ordered split ("eval", "in order") has a row `row` (its rows are finite)."""
        return self._stream(split).locate(row) is not None

    def _stream(self, split: str) -> _Stream:
        return {"train": self._train, "in order": self._in_order, "eval": self._eval}[split]

    def state(self, step: int) -> dict:
        """Where the training rows of step `step` are found without packing the windows
        before: a window known to start at or before them (for a checkpoint's metadata)."""
        window, row = self._train.known_start(step * self.batch)
        return {**self._identity, "window": int(window), "row": int(row)}

    def resume(self, state: dict | None) -> bool:
        """Continue from a checkpoint's `state`; False (the stream is walked from its
        start) when it is of other data, rows or order, or missing."""
        if not isinstance(state, dict) or any(state.get(k) != v for k, v in self._identity.items()):
            return False
        window, row = state.get("window"), state.get("row")
        if not (type(window) is int and type(row) is int and window >= 0 and row >= 0):
            return False
        self._train = self._training_stream((window, row))
        return True

    def close(self) -> None:
        self.tokenizing.close()


def record_source(data: str, tokenizer: str, rows: Rows, vocab: int | None = None, loss_on: str = "completion",
                  overlong: str = "truncate", workers: int | None = None,
                  max_record_bytes: int = MAX_RECORD_BYTES) -> RecordSource:
    """The fine-tuning records of `data` in `rows` (`Rows`), tokenized by `tokenizer` (a
    tokenizer directory, checked against a model's `vocab` if given) in `workers` processes (default: spmd.data.workers.default_workers
    when there is more than one window of records, else this process); a record of more
    than `max_record_bytes` is refused."""
    directory = load_tokenizer_directory(tokenizer)
    if vocab is not None:
        check_vocab(directory, vocab)
    index = RecordIndex(data, max_record_bytes)
    workers = workers if workers is not None else default_workers() if len(index) > WINDOW else 0
    return RecordSource(index, Tokenizing(directory, tokenizer, loss_on, workers, max_record_bytes), rows, name=data,
                        tokenizer=directory.name, overlong=overlong)


def packed_rows(source: RecordSource) -> tuple[list[dict[str, np.ndarray]], int]:
    """Every training example of `source`, in order, packed: its "in order" batches (the
    last without its padding rows), and their target tokens."""
    batches, targets, j = [], 0, 0
    while source.has_rows(j * source.batch, "in order"):
        rows = source.rows(j, 0, source.batch, source.length, "in order")
        used = int(np.count_nonzero(rows["segments"].any(axis=1)))  # padding rows come last
        batches.append({k: v[:used] for k, v in rows.items()})
        targets += int(rows["loss_mask"].sum())
        j += 1
    return batches, targets
