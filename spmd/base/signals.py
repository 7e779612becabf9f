"""SIGINT, SIGTERM and SIGUSR1: before training they end the run cleanly; during it they
ask the loop to stop after a step and save (`spmd.base.signals.StopSignals`).

SIGTERM is how a scheduler stops a job (SLURM's preemption and `scancel`, Kubernetes'
pod deletion); SIGUSR1 is the warning SLURM sends ahead of a time limit when a job asks
for it (`--signal=USR1@SECONDS`). Both stop after the step and save: the steps after a
warning would be lost at the limit anyway, and the job can be requeued at once.

Python runs a signal handler in the main thread, between two bytecodes: a Ctrl-C during
a long XLA compile waits for the compile, then unwinds as a KeyboardInterrupt through
JAX's C++ (it ended in a segmentation fault at exit, 3 of 3 tries). A command-line run
blocks both signals in every thread and takes them in a thread of its own, which acts at
once whatever the main thread is doing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}
# Ctrl-C as a shell reports it; a scheduler's stop or time-limit warning is no failure.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 0, signal.SIGUSR1: 0}
# A command that, stopped, has produced nothing fails: the code a shell reports for the signal.
STOPPED = {sig: 128 + sig for sig in SIGNALS}

_served: Interrupts | None = None


class Interrupts:
    """The process's SIGINT, SIGTERM and SIGUSR1, served by one thread. Until the training loop
    takes them (`handler`), a signal ends the process: the `cleanups` run, one line is
    printed, and the process exits with its code in `exit_codes`."""

    def __init__(self, stopped: str, exit_codes: dict[int, int] = EXIT_CODES):
        self.stopped = stopped  # what the line says after the signal's name
        self.exit_codes = exit_codes
        self.handler: Callable[[int], None] | None = None
        self.cleanups: list[Callable[[], None]] = []
        self.stopping = threading.Event()  # set once a signal is ending the process (its cleanups under way)
        self._stderr = os.dup(2)  # a held-back stderr (spmd.base.errors) must not swallow the line

    def say(self, line: str) -> None:
        os.write(self._stderr, (line + "\n").encode())

    def _serve(self) -> None:
        while True:
            signum = signal.sigwait(SIGNALS)
            if self.handler is not None:
                self.handler(signum)
                continue
            self.stopping.set()
            for cleanup in self.cleanups:
                cleanup()
            self.say(f"{signal.Signals(signum).name}: {self.stopped}")
            os._exit(self.exit_codes[signum])


def serve(stopped: str = "stopped during start-up, before the first step; nothing was written",
          exit_codes: dict[int, int] = EXIT_CODES) -> Interrupts:
    """From now on this process's SIGINT, SIGTERM and SIGUSR1 are served by `Interrupts` (call it
    first thing in a command's main, before threads exist: they inherit the blocked mask)."""
    global _served
    if _served is None:
        threads = f"/proc/{os.getpid()}/task"
        if os.path.isdir(threads) and len(os.listdir(threads)) > 1:  # e.g. OpenBLAS's, started by importing numpy
            raise RuntimeError("spmd.base.signals.serve() must run before any thread starts")
        _served = Interrupts(stopped, exit_codes)
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        threading.Thread(target=_served._serve, name="spmd-signals", daemon=True).start()
    return _served


def served() -> Interrupts | None:
    """The process's `Interrupts` when a command serves its signals, else None (a
    notebook or a test calling the library keeps Python's own handling)."""
    return _served


class StopSignals:
    """SIGTERM, SIGUSR1 or SIGINT asks the loop to stop after the current step (and save); a second
    SIGINT aborts at once. A command-line run's signals come from its signal thread
    (spmd.base.signals); a library caller's through Python's handlers, while the loop runs."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def __enter__(self):
        if served() is not None:
            served().handler = self._handle  # until the process ends: a signal then waits for the last save
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self._handle(signum))
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum):
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            print(f"{name} again: aborting now", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = name
        print(f"{name}: finishing this step, saving, then exiting (SIGINT again aborts)", file=sys.stderr, flush=True)
