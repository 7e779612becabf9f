"""Fine-tuning records tokenized in worker processes, ahead of the steps that need them.

Rendering a chat template and tokenizing are Python and Rust work of the host's CPUs; a
process of its own per worker (started fresh, "spawn": forking a process that runs JAX's
threads is unsafe) lets them run beside the training step. Each worker loads the
tokenizer directory once. A record's mistake comes back as its `error:` line, and so does
a worker's death (killed, out of memory), naming the worker and how it ended.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import signal
import threading
import time
from collections.abc import Sequence

from spmd.base.cli import MAX_RECORD_BYTES
from spmd.base.errors import UserError
from spmd.base.hardware import usable_cpus
from spmd.data.records import Example, examples_of
from spmd.data.tokenizer import load_tokenizer_directory

MAX_WORKERS = 8
_worker: dict = {}  # in a worker: its tokenizer, --loss-on and --max-record-bytes


def default_workers() -> int:
    """One worker per CPU this process may run on, less one for the trainer, at most
    MAX_WORKERS (the CPUs a scheduler gave the job: SLURM's --cpus-per-task)."""
    return max(1, min(MAX_WORKERS, usable_cpus() - 1))


class Tokenizing:
    """Records to examples: in `workers` processes, or in this one (0)."""

    def __init__(self, tokenizer, tokenizer_path: str, loss_on: str, workers: int,
                 max_record_bytes: int = MAX_RECORD_BYTES):
        self.tokenizer, self.loss_on, self.workers = tokenizer, loss_on, workers
        self.max_record_bytes = max_record_bytes
        if workers:
            _start_resource_tracker()
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(tokenizer_path, loss_on, max_record_bytes, os.getpid())) if workers else None
        # The pool's worker processes by pid, in the order they started (the pool fills this
        # dict, a private one of concurrent.futures, as it starts them): how a worker ended
        # is read there, since the pool's own error says only that one did.
        self._processes = self._pool._processes if self._pool else {}

    def submit(self, items: Sequence) -> _Pending:
        """Start tokenizing `items` (spmd.data.index.RecordIndex.read's); `.result()` waits."""
        if self._pool is None:  # in this process, when asked for
            return _Pending([], lambda: examples_of(items, self.tokenizer, self.loss_on, self.max_record_bytes))
        size = max(16, -(-len(items) // (4 * self.workers)))  # a few pieces per worker, for balance
        try:
            return _Pending([self._pool.submit(_tokenize, items[i:i + size]) for i in range(0, len(items), size)],
                            died=self.died)
        except concurrent.futures.process.BrokenProcessPool:  # a worker died while none was waited for
            raise self.died() from None

    def died(self) -> UserError:
        """The error of a pool that lost a worker: which one, and how it ended. The others
        are ended (they leave SIGTERM to the trainer, so the pool's own ending would wait
        for them forever)."""
        processes = list(self._processes.values())
        ended = [p for p in processes if multiprocessing.connection.wait([p.sentinel], 0)]
        for process in processes:
            if process not in ended:
                process.kill()
        if not ended:
            return UserError("a data worker process ended abruptly")
        n = processes.index(ended[0]) + 1
        return UserError(f"data worker {n} of {self.workers} (pid {ended[0].pid}) {_ending(_exit_code(ended[0]))}; "
                         f"a smaller --max-record-bytes refuses large records before they are tokenized")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _exit_code(process, wait: float = 5.0) -> int | None:
    """A dead process's exit code, once read: the pool's thread reaps it too, and may be
    the one that reads it."""
    deadline = time.monotonic() + wait
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode


def _ending(code: int | None) -> str:
    """How a process ended, from its exit code, and the likely why."""
    if code is None:
        return "ended"
    if code == 0:
        return "exited"
    if code > 0:
        return (f"exited with status {code} (started from a script without `if __name__ == \"__main__\":`, which "
                f"each worker imports?)")
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a real-time signal has no name
        name = f"signal {-code}"
    return f"was killed by {name} (out of memory, or killed by hand?)"


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, keeping this thread's blocked signals:
    starting it unblocks SIGINT and SIGTERM in the thread that does (CPython 3.12), which
    would let a scheduler's SIGTERM kill a trainer that takes its signals in a thread of its
    own (spmd.base.signals) instead of stopping it after a step."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    multiprocessing.resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _Pending:
    """Examples on their way: computed here when asked for (`compute`), or the workers'
    `futures` (`died`: the error of a pool that lost a worker)."""

    def __init__(self, futures: list, compute=None, died=None):
        self._futures, self._compute, self._died = futures, compute, died

    def result(self) -> list[Example]:
        if self._compute is not None:
            return self._compute()
        try:
            return [Example(ids, loss) for f in self._futures for ids, loss in f.result()]
        except concurrent.futures.process.BrokenProcessPool:
            raise self._died() from None


class Failed:
    """Examples that could not be read (a record over its bound): the error, raised when
    they are asked for, as a bad record's is."""

    def __init__(self, error: UserError):
        self.error = error

    def result(self) -> list[Example]:
        raise self.error


def _start(tokenizer_path: str, loss_on: str, max_record_bytes: int, trainer: int) -> None:
    # Ctrl-C and a scheduler's SIGTERM or time-limit SIGUSR1 (sent to every process of the
    # job) are the trainer's: it stops after its step, saves, and ends its workers. A worker
    # whose trainer ended outright ends itself, also one that ended before this worker
    # started (its pid is given, not read here: by then this worker's parent may be init).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(trainer,), daemon=True).start()
    _worker.update(tokenizer=load_tokenizer_directory(tokenizer_path), loss_on=loss_on,
                   max_record_bytes=max_record_bytes)


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _tokenize(items: Sequence) -> list[tuple]:
    return [tuple(e) for e in examples_of(items, _worker["tokenizer"], _worker["loss_on"],
                                          _worker["max_record_bytes"])]
