"""Where commands write: every output of a command claimed at once, before anything runs.

`claim` refuses, in one line and before any work: an output that is, or sits inside, an
input (a checkpoint being read, the prompts, the data, the config, the tokenizer, the
directory imported from); two outputs that coincide, or one inside a directory that holds
only its own kind of files (a run's checkpoints) or inside a file; a path that cannot be
written; and a special file that cannot take a stream.

What is then written: a regular file whole or not at all (a temporary beside it, renamed
over it; through a symbolic link, the file it names). A path that is no regular file is
never replaced: it is written as a stream when it is this process's own stdout or stderr
(`/dev/stdout`, whatever fd 1 is: a pipe, a terminal, a file), a FIFO that has a reader
(opened when claimed, so that nothing waits on it later), the null device or a terminal;
any other device node, a socket or a FIFO that no one reads is refused.

Each check creates nothing that stays: writability is tried with a probe file that is
removed at once, in the directory itself or, when it does not exist yet, in the nearest
ancestor that does (which is where it would be created).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from spmd.base.errors import UserError, file_kind, why_io_failed
from spmd.base.signals import served

LOCK_NAME = ".spmd-lock"
# The process's own stdout and stderr: their names by descriptor, and the paths that name them.
STREAMS = ("", "stdout", "stderr")
STREAM_PATHS = {**dict.fromkeys(("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"), 1),
                **dict.fromkeys(("/dev/stderr", "/dev/fd/2", "/proc/self/fd/2"), 2)}
# Character devices written as streams besides the process's own stdout and stderr: the
# null device, and terminals (virtual consoles, /dev/tty and the console, pseudo-terminals).
NULL_DEVICE = (1, 3)
TERMINALS = {(4, None), (5, 0), (5, 1), *((major, None) for major in range(136, 144))}


@dataclasses.dataclass(frozen=True)
class Output:
    """One output of a command, as its flag names it."""

    flag: str
    path: str | None
    directory: bool = False  # a directory written into (else one file)
    holds: str | None = None  # a directory holding only this (a run's "checkpoints"): no other output goes in it
    parents: bool = False  # a file whose missing directories are made
    reopened: bool = False  # a file its writer opens anew for each write: a FIFO would see its end at the first


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A claimed output: where it goes and how it is written."""

    flag: str
    path: str  # as given
    target: Path  # links resolved: the file a whole write replaces
    stream: str | None = None  # None: a regular file, written whole; else what takes the stream
    fd: int | None = None  # the stream's descriptor: this process's stdout (1) or stderr (2), or a FIFO's

    @property
    def to_stdout(self) -> bool:
        """Whether this output is the command's stdout (its messages then go to stderr)."""
        return self.fd == 1

    def write(self, produce: Callable[[BinaryIO], None]) -> None:
        """`produce(file)` writes the content. A regular file is written whole or not at
        all: a hidden temporary beside it (synced, then renamed over it); the directories
        made for it and the temporary are removed if anything fails, and a temporary
        left by a killed process is removed by the next write. A stream is written in place."""
        if self.fd is not None:
            if sys.stdout:
                sys.stdout.flush()
            # A FIFO's descriptor is closed once written (its reader sees the end); stdout stays open.
            with os.fdopen(os.dup(self.fd) if self.fd in (1, 2) else self.fd, "wb") as f:
                produce(f)
        elif self.stream is not None:
            with open(self.target, "wb") as f:
                produce(f)
        else:
            _write_whole(self.target, produce)

    def failed(self, exc: BaseException) -> str:
        """The one line for a write that failed with `exc`."""
        done = "nothing was written" if self.stream is None else f"{self.stream} may have taken part of it"
        return f"writing {self.flag} {self.path} failed ({why_io_failed(exc)}); {done}"


def claim(outputs: Sequence[Output], inputs: Mapping[str, str | Path | None] = {},
          allowed: Collection[tuple[str, str]] = ()) -> dict[str, Claimed]:
    """Check every output of a command before it does any work (see the module's
    docstring). `inputs`: what the command reads, by flag (or by a phrase such as "the
    run's tokenizer"); `allowed`: (output flag, flag) pairs where the first may be at or
    inside the second (a run writing on into the directory it resumes). -> flag: Claimed"""
    given = [o for o in outputs if o.path]
    claimed = {o.flag: _kind(o) for o in given}
    for o in given:
        for name, inp in inputs.items():
            if inp and (o.flag, name) not in allowed and _within(o.path, str(inp)):
                what = f"the input {name}" if name.startswith("--") else name
                raise UserError(f"{o.flag} {o.path} would write over {what} {inp}; choose another path")
    # None inside a directory that holds only its own files (a run's checkpoints) or
    # inside a file, and no two at one path.
    for outer in sorted(given, key=lambda o: 0 if o.holds else 2 if o.directory else 1):
        for o in given:
            if o is outer or (o.flag, outer.flag) in allowed or (outer.flag, o.flag) in allowed and \
                    _resolved(o.path) == _resolved(outer.path):
                continue
            if outer.holds and _within(o.path, outer.path):
                raise UserError(f"{o.flag} {o.path} would write into {outer.flag} {outer.path}, which holds only "
                                f"{outer.holds}; choose a path outside it")
            if _resolved(o.path) == _resolved(outer.path):
                raise UserError(f"{o.flag} {o.path} and {outer.flag} {outer.path} are the same path; give each "
                                "output its own")
            if not outer.directory and _within(o.path, outer.path):
                raise UserError(f"{o.flag} {o.path} would write into {outer.flag} {outer.path}, a file; give each "
                                "output its own path")
    runs = [_resolved(o.path) for o in given if o.holds]  # the command's own run directory (train's --out)
    for o in given:
        run = None if o.holds else _run_directory_around(o.path)
        if run is not None and run not in runs and not any(run in r.parents for r in runs):
            raise UserError(f"{o.flag} {o.path} would write into the spmd run {run}, whose directory holds only "
                            "its checkpoints; choose a path outside it")
    for o in given:
        if claimed[o.flag].stream is None:
            _check_writable(o)
        elif claimed[o.flag].fd is None and not os.access(o.path, os.W_OK):
            raise UserError(f"{o.flag} {o.path} cannot be written: permission denied")
    return claimed


def _resolved(path: str) -> Path:
    return Path(os.path.realpath(path))


def _within(path: str, inp: str) -> bool:
    """Whether the output is `inp`, or sits inside it: by name with links resolved, and by
    identity (a hard link, the stdout of a shell's redirection, a directory bind-mounted
    at another path)."""
    out_path, in_path = _resolved(path), _resolved(inp)
    if out_path == in_path or in_path in out_path.parents:
        return True
    try:
        target = os.stat(inp)
    except OSError:
        return False
    for place in (out_path, *out_path.parents):
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(place), target):
                return True
    return False


def _run_directory_around(path: str) -> Path | None:
    """The spmd run directory (it holds a run's lock file) or checkpoint step directory
    (`<step>/meta`) that `path` is, or sits inside, if any: a file written there makes
    the run refuse to resume, or lands in a checkpoint."""
    for place in (_resolved(path), *_resolved(path).parents):
        if (place / LOCK_NAME).is_file() or place.name.isdigit() and (place / "meta").exists():
            return place
    return None


def _kind(o: Output) -> Claimed:
    """What the path is, and how it is written: refused when it cannot be what `o` needs."""
    fd = STREAM_PATHS.get(os.path.abspath(o.path))
    if fd is not None and (None, sys.stdout, sys.stderr)[fd] is None:
        # Closed when the command started: its number may since belong to a file the process opened.
        raise UserError(f"{o.flag} {o.path}: this command has no {STREAMS[fd]} (descriptor {fd} was closed "
                        "when it started); give a file")
    try:
        st = os.stat(o.path)
    except (FileNotFoundError, NotADirectoryError):  # a new path (under a file: refused as unwritable below)
        if os.path.islink(o.path):  # never a temporary renamed over a link into nowhere (/dev/stdout with fd 1 closed)
            raise UserError(f"{o.flag} {o.path} is a broken symbolic link") from None
        return Claimed(o.flag, o.path, _resolved(o.path))
    except OSError as exc:  # a loop of links is named as one; a directory we may not search, by its reason
        what = file_kind(o.path)
        why = f"cannot be used: {exc.strerror}" if what.startswith("unreadable") else f"is {what}; give another path"
        raise UserError(f"{o.flag} {o.path} {why}") from None
    # (fd 1 or 2 closed when the command started: Python has no such stream, and the number
    # may since belong to a file the process opened.)
    own = next((fd for fd, stream in ((1, sys.stdout), (2, sys.stderr)) if stream and _same_as_fd(st, fd)), None)
    if o.directory:
        if not stat.S_ISDIR(st.st_mode):
            what = "a file" if stat.S_ISREG(st.st_mode) else file_kind(o.path)
            raise UserError(f"{o.flag} {o.path} is {what}, not a directory")
        return Claimed(o.flag, o.path, _resolved(o.path))
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{o.flag} {o.path} is a directory, not a file")
    if own is not None:
        if o.reopened and stat.S_ISREG(st.st_mode):  # opening it again would truncate what the shell opened
            raise UserError(f"{o.flag} {o.path} is this command's {STREAMS[own]}, a file that "
                            f"{o.flag} would open again; name the file itself")
        return Claimed(o.flag, o.path, _resolved(o.path), STREAMS[own], own)
    if stat.S_ISREG(st.st_mode):
        return Claimed(o.flag, o.path, _resolved(o.path))
    if stat.S_ISFIFO(st.st_mode):
        if o.reopened:
            raise UserError(f"{o.flag} {o.path} is a FIFO, which {o.flag} would open again for each write (its "
                            "reader would see the end at the first); give a regular file or /dev/stdout")
        return Claimed(o.flag, o.path, _resolved(o.path), "a FIFO", _fifo_writer(o))
    if stat.S_ISCHR(st.st_mode):
        device = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if device == NULL_DEVICE or (device[0], None) in TERMINALS or device in TERMINALS:
            what = "the null device" if device == NULL_DEVICE else "a terminal"
            return Claimed(o.flag, o.path, _resolved(o.path), what)
        what = f"a character device ({device[0]}:{device[1]})"
    else:
        what = file_kind(o.path)
    raise UserError(f"{o.flag} {o.path} is {what}, not a regular file; give a file, a FIFO or /dev/stdout "
                    "(a special file is never replaced)")


def _fifo_writer(o: Output) -> int:
    """The FIFO opened for writing, now: one that no one reads is refused rather than waited on."""
    try:
        fd = os.open(o.path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise UserError(f"{o.flag} {o.path} is a FIFO that no process reads; start its reader first") from None
        raise UserError(f"{o.flag} {o.path} cannot be written: {exc.strerror}") from None
    os.set_blocking(fd, True)
    return fd


def _same_as_fd(st: os.stat_result, fd: int) -> bool:
    try:
        return os.path.samestat(st, os.fstat(fd))
    except OSError:  # closed
        return False


def _check_writable(o: Output) -> None:
    if o.directory:
        check_writable_dir(o.path, o.flag)
        return
    parent = Path(os.path.realpath(o.path)).parent
    if o.parents and not parent.is_dir():  # made when the file is written
        check_writable_dir(str(parent), f"{o.flag} {o.path}: the directory")
    else:
        check_writable_file(o.path, o.flag)


def _probe(directory: Path, flag: str, path: str) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".spmd-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise UserError(f"{flag} {path} cannot be written: {exc.strerror} (in {directory})") from None


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(path: str, flag: str) -> None:
    """`path` is a directory we can write into, or one we can create."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path} is {'a file' if p.is_file() else file_kind(p)}, not a directory")
    existing = _existing_ancestor(p)
    if not existing.is_dir():
        raise UserError(f"{flag} {path} cannot be created: {existing} is a file")
    _probe(existing, flag, path)


def check_writable_file(path: str, flag: str) -> None:
    """`path` names a file we can create or replace, in a directory that exists."""
    p = Path(os.path.realpath(path))
    if p.is_dir():
        raise UserError(f"{flag} {path} is a directory, not a file")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {path}: {p.parent} is a file, not a directory" if p.parent.exists() else
                        f"{flag} {path}: the directory {p.parent} does not exist")
    _probe(p.parent, flag, path)
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {path} cannot be written: permission denied")


def regular_file(path: str, flag: str) -> Path:
    """An input that must be a regular file: missing, a directory, a device or a FIFO
    is refused, saying which."""
    kind = file_kind(path)
    if kind == "missing":
        raise UserError(f"{flag} {path}: no such file")
    if kind != "a regular file":
        raise UserError(f"{flag} {path} is {kind}, not a regular file")
    return Path(path)


def read_text(file: Path, flag: str = "--data") -> str:
    """A UTF-8 text file whole (`flag`: the option that named it, for the one line of a failure)."""
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{flag} {file}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{flag} {file} cannot be read: {exc.strerror or exc}") from None


def _write_whole(out: Path, produce: Callable[[BinaryIO], None]) -> None:
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    remove_stale_temporaries(out, hidden=True)
    tmp = temporary_name(out, hidden=True)
    cleanup = lambda: tmp.unlink(missing_ok=True)  # noqa: E731 - also run by a signal's exit (spmd.base.signals)
    if served():
        served().cleanups.append(cleanup)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            produce(f)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):  # a file replaced keeps its permissions
            os.chmod(tmp, stat.S_IMODE(os.stat(out).st_mode))
        os.replace(tmp, out)
    except BaseException:
        cleanup()
        for directory in made:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    finally:
        if served():
            served().cleanups.remove(cleanup)


def temporary_name(out: Path, hidden: bool = False) -> Path:
    """Where this process writes `out` before renaming it to `out`: beside it, named for
    the process and the host (a shared file system may hold other hosts' exports)."""
    return out.with_name(f"{'.' if hidden else ''}{out.name}.tmp-{os.getpid()}@{socket.gethostname()}")


def remove_stale_temporaries(out: Path, hidden: bool = False) -> list[Path]:
    """Remove the temporaries of `out` left by killed processes of this host; those of
    live processes, or of other hosts, are left alone. Returns what was removed."""
    pattern = re.compile(rf"{'[.]' if hidden else ''}{re.escape(out.name)}\.tmp-([0-9]+)@(.+)")
    host, removed = socket.gethostname(), []
    with contextlib.suppress(OSError):
        for path in out.parent.iterdir():
            found = pattern.fullmatch(path.name)
            if found and found[2] == host and not _alive(int(found[1])):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    except OverflowError:  # no process has such a pid
        return False
    return True


class DirectoryLock:
    """An exclusive lock on a run directory (`flock` on the directory itself), held until
    the process ends.

    `flock` dies with its process, so a lock left by a killed run is never stale: the
    next run takes it. Taking it writes nothing, so a run takes it before it reads the
    directory and can still fail on bad input without a trace; once the run is ready,
    `hold` makes the directory if needed and records who holds it, for the message of
    a run that is refused.
    """

    def __init__(self, directory: str | Path, flag: str = "--out"):
        self.directory, self.flag = Path(directory), flag
        self.created = False
        self._fd = -1

    def check(self) -> None:
        """Refuse a directory whose lock file is no regular file (a directory, a link, a
        FIFO): the holder could not be recorded there, or would be written elsewhere."""
        lock = self.directory / LOCK_NAME
        if lock.is_symlink() or lock.exists() and not lock.is_file():
            kind = "a symbolic link" if lock.is_symlink() else file_kind(lock)
            raise UserError(f"{self.flag} {self.directory} holds {kind} named {LOCK_NAME}, the file where a run "
                            "records that it holds the directory; remove it")

    def take(self) -> None:
        """Lock the directory if it exists (a missing one is no other run's yet)."""
        if self._fd >= 0 or not self.directory.is_dir():
            return
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = (self.directory / LOCK_NAME).read_text().strip()
            except OSError:
                holder = "starting"
            raise UserError(f"{self.flag} {self.directory} is in use by another run ({holder}); "
                            "wait for it to end or choose another directory") from None
        self._fd = fd

    def hold(self) -> None:
        """Make the directory if needed, lock it, and record this process as the holder."""
        try:
            if not self.directory.exists():
                self.directory.mkdir(parents=True)
                self.created = True
            self.take()
            (self.directory / LOCK_NAME).write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
        except OSError as exc:
            raise UserError(f"{self.flag} {self.directory} cannot be written: {exc.strerror}") from None

    def release(self) -> None:
        """Unlock; a directory this run made and left with nothing in it is removed."""
        if self._fd < 0:
            return
        if self.created and [p.name for p in self.directory.iterdir()] == [LOCK_NAME]:
            (self.directory / LOCK_NAME).unlink()
            self.directory.rmdir()
        os.close(self._fd)
        self._fd = -1
