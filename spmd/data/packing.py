"""Tokenized examples packed into rows of `length` tokens (the trainer's seq + 1); served
window by window by spmd.data.stream.

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
it is asked for.
"""

from __future__ import annotations

import bisect
import dataclasses
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

    @staticmethod
    def empty_batch(rows: int, length: int) -> dict[str, np.ndarray]:
        """`tokens`, `segments` and `loss_mask` of `rows` padding rows."""
        return {"tokens": np.zeros((rows, length), np.int32), "segments": np.zeros((rows, length), np.int32),
                "loss_mask": np.zeros((rows, length), bool)}

    def row_into(self, out: dict[str, np.ndarray], i: int, r: int) -> None:
        """Row `r` into row `i` of a batch (an `empty_batch`)."""
        first, last = self.row_starts[r], self.row_starts[r + 1]
        start, stop = self.piece_starts[first], self.piece_starts[last]
        out["tokens"][i, :stop - start] = self.tokens[start:stop]
        out["loss_mask"][i, :stop - start] = self.loss[start:stop]
        sizes = np.diff(self.piece_starts[first:last + 1])
        out["segments"][i, :stop - start] = np.repeat(np.arange(1, sizes.size + 1, dtype=np.int32), sizes)

    def batch(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """Rows `rows` as a batch; a row past the last is padding."""
        out = self.empty_batch(len(rows), self.length)
        for i, r in enumerate(rows):
            if r < self.rows:
                self.row_into(out, i, r)
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


def pack(examples: Sequence, length: int, overlong: str = "truncate", name: str = "data",
         empty: bool = False) -> Packing:
    """`examples` ((ids, loss) pairs) packed into rows of `length` tokens; without a target
    token among them, refused (or, `empty`, no rows)."""
    pieces, counts = _pieces(examples, length, overlong)
    if not pieces and not empty:
        within = f" within its first {length} tokens" if counts["truncated"] else ""
        raise UserError(f"--data {name}: no target tokens: none of its {len(examples):,} example(s) has a token "
                        f"to learn after its first{within}")
    rows = best_fit_decreasing([p[0].size for p in pieces], length)
    order = [i for row in rows for i in row]
    sizes = np.array([pieces[i][0].size for i in order], np.int64)
    return Packing(length=length, tokens=np.concatenate([pieces[i][0] for i in order] + [np.zeros(0, np.int32)]),
                   loss=np.concatenate([pieces[i][1] for i in order] + [np.zeros(0, bool)]),
                   piece_starts=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                   row_starts=np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64),
                   examples=len(examples), **counts)
