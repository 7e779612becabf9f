"""The one exception type for mistakes in what the user asked for, and how CLIs report it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import sys
import tempfile
import threading


class UserError(Exception):
    """Bad input: the CLI prints `error: <message>` on one line and exits 2."""


class OutputFailed(Exception):
    """Writing an output failed mid-run (disk full, permission lost, I/O error): the CLI
    prints `error: <message>` on one line, naming what is safe, and exits non-zero."""


def first_line(exc: BaseException) -> str:
    """An exception's first line (XLA's runtime errors run to many), or its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def why_io_failed(exc: BaseException) -> str:
    """The reason of a failed write, short: an OSError's own words, else the end of the
    first line (TensorStore's errors put the file system's words last)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = first_line(exc)
    return re.sub(r"\s*\[os_error_code=.*$", "", text.rsplit(": ", 1)[-1]) if len(text) > 160 else text


def file_kind(path) -> str:
    """What is at `path`, for a message: "missing", "a regular file", "a directory", "a
    character device", ... (a symbolic link is followed; one that leads nowhere or in a
    loop says so)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else "missing"
    except OSError as exc:  # a loop of links, a name too long, a directory we may not search
        # A loop is named as what it is: its own words ("too many levels") read as a limit to raise.
        return "a symbolic link loop" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


EXIT_OUTPUT_FAILED = 5  # the input was fine; writing an output failed (disk full, permission lost)


@contextlib.contextmanager
def held_stderr(hold: bool = True):
    """Hold back stderr for every thread (fd 2 goes to a temporary file); yields a
    descriptor of the real stderr, for a command's own one line. When the block ends, the
    held text is written out. A command that exits inside the block drops it."""
    sys.stderr.flush()
    stderr = os.dup(2)
    held = tempfile.TemporaryFile() if hold else None
    if held:
        os.dup2(held.fileno(), 2)
    try:
        yield stderr
    finally:
        sys.stderr.flush()
        os.dup2(stderr, 2)
        os.close(stderr)
        if held:
            held.seek(0)
            os.write(2, held.read())
            held.close()


@contextlib.contextmanager
def one_line_errors(hold_stderr: bool = True):
    """Run a CLI's checks and set-up; a UserError becomes one `error: ...` line and exit 2.

    Meanwhile stderr is held back (unless `hold_stderr` is False): a failed checkpoint
    read leaves Orbax's I/O threads printing tracebacks, which must not surround the one
    line. When the block ends otherwise (ready, or crashed), stderr comes back with what
    was held. A step that may end in a native abort (joining other processes) is run
    without the hold, so that its message is not lost with the process.
    """
    with held_stderr(hold_stderr) as stderr:
        try:
            yield
        except UserError as exc:
            if sys.stdout:  # None when the command started with descriptor 1 closed
                sys.stdout.flush()
            os.write(stderr, f"error: {exc}\n".encode())
            os._exit(2)  # nothing has been written; exit before those threads are done


def quiet_library_threads():
    """Orbax and TensorStore report a failed write from their own threads, with tracebacks
    (absl's and asyncio's logs, Python's hooks called from their threads): a full disk printed 649
    lines. A command reports the failure itself, in one line, so theirs are not printed;
    the main thread's own uncaught exceptions still are. Returns a function that puts
    the hooks back (for a command's main called from Python)."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]  # asyncio: "Task exception was never retrieved"
    saved = [log.level for log in loggers], sys.unraisablehook, threading.excepthook

    def main_thread_only(hook):
        def quiet(*args):
            if threading.current_thread() is threading.main_thread():
                hook(*args)
        return quiet

    for log in loggers:
        log.setLevel(logging.CRITICAL)
    sys.unraisablehook, threading.excepthook = main_thread_only(saved[1]), main_thread_only(saved[2])

    def restore():
        for log, level in zip(loggers, saved[0]):
            log.setLevel(level)
        sys.unraisablehook, threading.excepthook = saved[1:]
    return restore


def optional_module(module: str, what: str):
    """The optional dependency `module` (of spmd[data]), needed for reading `what`."""
    try:
        return __import__(module)
    except ImportError:
        raise UserError(f"reading {what} needs the '{module}' package: pip install 'spmd[data]'") from None
