"""Where commands write: checked before anything runs, never over an input, one run at a time.

Each check creates nothing that stays: writability is tried with a probe file that is
removed at once, in the directory itself or, when it does not exist yet, in the nearest
ancestor that does (which is where it would be created).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

from spmd.errors import UserError

LOCK_NAME = ".spmd-lock"


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
        raise UserError(f"{flag} {path} is a file, not a directory")
    existing = _existing_ancestor(p)
    if not existing.is_dir():
        raise UserError(f"{flag} {path} cannot be created: {existing} is a file")
    _probe(existing, flag, path)


def check_writable_file(path: str, flag: str) -> None:
    """`path` names a file we can create or append to, in a directory that exists."""
    p = Path(path).absolute()
    if p.is_dir():
        raise UserError(f"{flag} {path} is a directory, not a file")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {path}: the directory {p.parent} does not exist")
    _probe(p.parent, flag, path)
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} {path} cannot be written: permission denied")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_outputs_apart(outputs: Mapping[str, str | None], inputs: Mapping[str, str | None],
                        allowed: Mapping[tuple[str, str], bool] = {}) -> None:
    """No output may be, or sit inside, an input: `--metrics-file` equal to `--data`
    would overwrite the training data. `allowed` names (output flag, input flag) pairs
    that may coincide (a run writing on into the directory it resumes)."""
    for out_flag, out in outputs.items():
        if not out:
            continue
        out_path = Path(out).resolve()
        for in_flag, inp in inputs.items():
            if inp and not allowed.get((out_flag, in_flag)) and _inside(out_path, Path(inp).resolve()):
                raise UserError(f"{out_flag} {out} would write over the input {in_flag} {inp}; choose another path")


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
