"""What a run's data is to the trainer, the training loop and evaluation: the one surface
they read (spmd.run.trainer, spmd.run.loop, spmd.inference.evaluation). Each source
(the synthetic chain, a token stream, fine-tuning records, a pre-packed file) says what it
is here; the defaults are an endless source of plain token rows that keeps no state."""

from __future__ import annotations


class DataSource:
    packed = False  # rows() gives dicts of tokens, segments and loss masks (spmd.parallel.step)
    finite = False  # a set of examples an evaluation visits once each, in order, up to where has_rows ends
    rows_read = 0  # training rows this process read: the run's last line reports them
    held_out_rows: int | None = None  # rows of an endless source's held-out split, where it is a set (None: endless)

    def rows(self, step: int, start: int, stop: int, length: int, split: str = "train"):
        """Rows [start, stop) of batch `step` of `split` ("train", "eval", or "in order"),
        each `length` tokens."""
        raise NotImplementedError

    def describe(self, seq: int) -> str:
        """The run's data line."""
        raise NotImplementedError

    def has_rows(self, row: int, split: str) -> bool:
        """Whether `split` holds row `row` (a finite source's end)."""
        return True

    def state(self, step: int) -> dict | None:
        """What a checkpoint at `step` keeps to find the next rows without reading the data
        again (None: nothing, the rows follow from the step alone)."""
        return None

    def resume(self, state: dict | None) -> bool:
        """Continue from a checkpoint's `state`; whether it told where (False: the rows are
        found by preparing the ones before them again)."""
        return True

    def entropy_floor(self, seq: int) -> float | None:
        """The lowest loss a model could reach on it, where known (the synthetic chain)."""
        return None

    def packed_so_far(self) -> str:
        """What the rows prepared so far held, for the run's last line ("": nothing to say)."""
        return ""

    def close(self) -> None:
        """Stop what it runs besides the trainer (worker processes)."""
