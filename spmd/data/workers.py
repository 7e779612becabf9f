"""Fine-tuning records tokenized in worker processes, ahead of the steps that need them.

Rendering a chat template and tokenizing are Python and Rust work of the host's CPUs; a
process of its own per worker (started fresh, "spawn": forking a process that runs JAX's
threads is unsafe) lets them run beside the training step. Each worker loads the
tokenizer directory once. A record's mistake comes back as its `error:` line.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import threading
import time
from collections.abc import Sequence

from spmd.base.errors import UserError
from spmd.data.records import Example, examples_of
from spmd.data.tokenizer import load_tokenizer_directory

MAX_WORKERS = 8
_worker: dict = {}  # in a worker: its tokenizer and --loss-on


def default_workers() -> int:
    """One worker per CPU this process may run on, less one for the trainer, at most
    MAX_WORKERS (the CPUs a scheduler gave the job: SLURM's --cpus-per-task)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: all
    return max(1, min(MAX_WORKERS, cpus - 1))


class Tokenizing:
    """Records to examples: in `workers` processes, or in this one (0)."""

    def __init__(self, tokenizer, tokenizer_path: str, loss_on: str, workers: int):
        self.tokenizer, self.loss_on, self.workers = tokenizer, loss_on, workers
        if workers:
            _start_resource_tracker()
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(tokenizer_path, loss_on)) if workers else None

    def submit(self, items: Sequence) -> _Pending:
        """Start tokenizing `items` (spmd.data.index.RecordIndex.read's); `.result()` waits."""
        if self._pool is None:  # in this process, when asked for
            return _Pending([], lambda: examples_of(items, self.tokenizer, self.loss_on))
        size = max(16, -(-len(items) // (4 * self.workers)))  # a few pieces per worker, for balance
        return _Pending([self._pool.submit(_tokenize, items[i:i + size]) for i in range(0, len(items), size)])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, keeping this thread's blocked signals:
    starting it unblocks SIGINT and SIGTERM in the thread that does (CPython 3.12), which
    would let a scheduler's SIGTERM kill a trainer that takes its signals in a thread of its
    own (spmd.base.signals) instead of stopping it after a step."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    multiprocessing.resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _Pending:
    def __init__(self, futures: list, compute=None):
        self._futures, self._compute = futures, compute

    def result(self) -> list[Example]:
        if self._compute is not None:
            return self._compute()
        try:
            return [Example(ids, loss) for f in self._futures for ids, loss in f.result()]
        except concurrent.futures.process.BrokenProcessPool:
            raise UserError("a data worker process ended abruptly (killed, out of memory, or started from a script "
                            "without `if __name__ == \"__main__\":`, which each worker imports); --data-workers 0 "
                            "tokenizes in the trainer's own process") from None


def _start(tokenizer_path: str, loss_on: str) -> None:
    # Ctrl-C and a scheduler's SIGTERM or time-limit SIGUSR1 (sent to every process of the
    # job) are the trainer's: it stops after its step, saves, and ends its workers. A worker
    # whose trainer was killed outright ends itself.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(os.getppid(),), daemon=True).start()
    _worker.update(tokenizer=load_tokenizer_directory(tokenizer_path), loss_on=loss_on)


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _tokenize(items: Sequence) -> list[tuple]:
    return [tuple(e) for e in examples_of(items, _worker["tokenizer"], _worker["loss_on"])]
