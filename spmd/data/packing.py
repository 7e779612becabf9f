"""Tokenized examples packed into rows of `length` tokens (the trainer's seq + 1), and a
source that serves them by (step, row) as spmd.data.corpus.TokenSource serves windows.

A row holds whole examples one after another, each its own segment: `segments` numbers
them 1, 2, 3, ... in the row (0 is padding), `tokens` are 0 on padding, and `loss_mask`
is the examples' loss, False on padding and on each segment's first token (nothing in
the row before it may predict it). An example longer than a row is cut: "truncate" keeps
its first `length` tokens, "split" cuts it into pieces of `length`, each its own segment.
An example (or piece) left with no target token is dropped; all are counted.

Examples go to rows by best-fit decreasing: longest first, each into the row it fills
most tightly (a new row when none has room). Bin packing's first-fit decreasing has the
same worst case (11/9 of the fewest rows, plus one), but best fit needs only the rows
sorted by free space, and free space takes at most `length` values: a lookup by bisection
in the sorted list of free-space values that some row has, where first fit must search
the rows in order. Ties keep the examples' order, so the packing is deterministic; a
row's examples are then in their order in the data, and rows in the order of their first
example.

Rows are kept as ranges of one flat array of the examples' tokens, so a row is built when
it is asked for; the held-out examples (the last ones, `eval_fraction` of them) are
packed apart, so that no evaluation row holds a training example.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from spmd.base.cli import OVERLONG
from spmd.base.errors import UserError


@dataclasses.dataclass(frozen=True)
class Packing:
    """Rows of packed pieces: row r is the pieces `row_starts[r]:row_starts[r + 1]`, whose
    tokens are `tokens[piece_starts[first]:piece_starts[last + 1]]`, in order."""

    length: int
    tokens: np.ndarray  # int32, every piece's tokens, row after row
    loss: np.ndarray  # bool, beside them; False at each piece's start
    piece_starts: np.ndarray  # int64 (pieces + 1)
    row_starts: np.ndarray  # int64 (rows + 1)
    examples: int  # examples given
    truncated: int  # examples cut to `length`
    split: int  # examples cut into pieces
    dropped: int  # examples or pieces without a target token

    @property
    def rows(self) -> int:
        return self.row_starts.size - 1

    @property
    def targets(self) -> int:
        return int(self.loss.sum())

    def batch(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """`tokens`, `segments` and `loss_mask`, (len(rows), length) each."""
        out = {"tokens": np.zeros((len(rows), self.length), np.int32),
               "segments": np.zeros((len(rows), self.length), np.int32),
               "loss_mask": np.zeros((len(rows), self.length), bool)}
        for i, r in enumerate(rows):
            if r >= self.rows:  # past the last row (a finite pass's last batch): padding
                continue
            first, last = self.row_starts[r], self.row_starts[r + 1]
            start, stop = self.piece_starts[first], self.piece_starts[last]
            out["tokens"][i, :stop - start] = self.tokens[start:stop]
            out["loss_mask"][i, :stop - start] = self.loss[start:stop]
            sizes = np.diff(self.piece_starts[first:last + 1])
            out["segments"][i, :stop - start] = np.repeat(np.arange(1, sizes.size + 1, dtype=np.int32), sizes)
        return out


def positions(segments: np.ndarray) -> np.ndarray:
    """Each token's position in its segment (0 at a segment's start; 0 on padding)."""
    index = np.arange(segments.shape[-1])
    starts = np.ones(segments.shape, bool)
    starts[..., 1:] = segments[..., 1:] != segments[..., :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return np.where(segments > 0, index - first, 0).astype(np.int32)


def _pieces(examples: Sequence, length: int, overlong: str) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict]:
    """The examples cut to rows' length, each piece's first token no target; those left
    with no target dropped."""
    if overlong not in OVERLONG:
        raise UserError(f"--overlong {overlong}: choose {' or '.join(OVERLONG)}")
    pieces, counts = [], {"truncated": 0, "split": 0, "dropped": 0}
    for ids, loss in examples:
        cuts = range(0, max(len(ids), 1), length)
        if len(ids) > length:
            counts["truncated" if overlong == "truncate" else "split"] += 1
            cuts = cuts[:1] if overlong == "truncate" else cuts
        for start in cuts:
            piece, mask = ids[start:start + length], np.array(loss[start:start + length], bool)
            mask[:1] = False
            if not mask.any():
                counts["dropped"] += 1
                continue
            pieces.append((np.asarray(piece, np.int32), mask))
    return pieces, counts


def best_fit_decreasing(sizes: Sequence[int], length: int) -> list[list[int]]:
    """Items of `sizes` (each at most `length`) in bins of `length`: each bin's items in
    their order, bins in the order of their first item."""
    bins: list[list[int]] = []
    free: dict[int, list[int]] = {}  # free space -> the bins with that much, the last made on top
    spaces: list[int] = []  # the keys of `free`, sorted
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size = sizes[item]
        k = bisect.bisect_left(spaces, size)
        if k < len(spaces):
            space = spaces[k]
            b = free[space].pop()
            if not free[space]:
                del free[space], spaces[k]
        else:
            space, b = length, len(bins)
            bins.append([])
        bins[b].append(item)
        left = space - size
        if left:
            if left not in free:
                bisect.insort(spaces, left)
                free[left] = []
            free[left].append(b)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def pack(examples: Sequence, length: int, overlong: str = "truncate", name: str = "data") -> Packing:
    """`examples` ((ids, loss) pairs) packed into rows of `length` tokens."""
    pieces, counts = _pieces(examples, length, overlong)
    if not pieces:
        within = f" within its first {length} tokens" if counts["truncated"] else ""
        raise UserError(f"--data {name}: no target tokens: none of its {len(examples):,} example(s) has a token "
                        f"to learn after its first{within}")
    rows = best_fit_decreasing([p[0].size for p in pieces], length)
    order = [i for row in rows for i in row]
    sizes = np.array([pieces[i][0].size for i in order], np.int64)
    return Packing(length=length, tokens=np.concatenate([pieces[i][0] for i in order]),
                   loss=np.concatenate([pieces[i][1] for i in order]),
                   piece_starts=np.concatenate([[0], np.cumsum(sizes)]),
                   row_starts=np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64),
                   examples=len(examples), **counts)


class PackedSource:
    """Packed rows of examples, `length` tokens each, served as TokenSource serves
    windows: row r of step k's batch is training row `order[k * batch + r]` of its epoch
    (a seeded permutation per epoch, whatever the mesh or process count); eval batch j is
    the held-out rows in order, from row j * batch. `rows_read` counts the training rows
    this process has read."""

    packed = True  # its rows are dicts of tokens, segments and loss masks (spmd.parallel.step)

    def __init__(self, examples: Sequence, length: int, batch: int, seed: int, eval_fraction: float = 0.0,
                 name: str = "data", tokenizer: str = "tokens", overlong: str = "truncate"):
        self.length, self.batch, self.seed, self.name, self.tokenizer = length, batch, seed, name, tokenizer
        held_out = int(np.ceil(len(examples) * eval_fraction)) if eval_fraction else 0
        if len(examples) - held_out < 1 or (eval_fraction and held_out < 1):
            raise UserError(f"--data {name}: {len(examples):,} example(s); too few for training"
                            f"{' and evaluation' if eval_fraction else ''}")
        self.train = pack(examples[:len(examples) - held_out], length, overlong, name)
        self.eval = pack(examples[len(examples) - held_out:], length, overlong, f"{name} (held out)") \
            if held_out else None
        self.train_samples, self.eval_samples = self.train.rows, self.eval.rows if self.eval else 0
        self.rows_read = 0

    def describe(self, seq: int) -> str:
        parts = [self.train] + ([self.eval] if self.eval else [])
        count = {k: sum(getattr(p, k) for p in parts) for k in ("examples", "targets", "truncated", "split",
                                                                "dropped")}
        held_out = f", {self.eval_samples:,} held out" if self.eval_samples else ""
        cut = ", ".join(f"{count[k]:,} {k}" for k in ("truncated", "split", "dropped") if count[k])
        return (f"{self.name}: {count['examples']:,} examples ({self.tokenizer}) packed into "
                f"{self.train_samples + self.eval_samples:,} rows of {seq}{held_out}, {count['targets']:,} target "
                f"tokens{f' ({cut})' if cut else ''}; an epoch is {self.train_samples / self.batch:,.1f} steps")

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.train_samples)

    def samples(self, step: int, start: int, stop: int, split: str = "train") -> np.ndarray:
        """The row indices (of the training or the held-out rows) of rows [start, stop) of
        batch `step`. The held-out rows ("eval") and, for an evaluation that visits every
        example once, the training rows ("in order") come in order, each once: indices past
        the last are padding rows, which hold no targets."""
        index = step * self.batch + np.arange(start, stop)
        if split in ("eval", "in order"):  # each row at most once: past the last, padding rows
            return index
        epochs, positions = np.divmod(index, self.train_samples)
        return np.array([self._order(int(e))[p] for e, p in zip(epochs, positions)], np.int64)

    def rows(self, step: int, start: int, stop: int, length: int, split: str = "train") -> dict[str, np.ndarray]:
        if length != self.length:
            raise ValueError(f"this source packs rows of {self.length} tokens, not {length}")
        rows = (self.eval if split == "eval" else self.train).batch(self.samples(step, start, stop, split))
        self.rows_read += stop - start if split == "train" else 0
        return rows
