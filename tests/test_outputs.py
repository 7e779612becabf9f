"""One way to claim an output (spmd.base.paths.claim), seen through the commands: a regular file
is written whole, a FIFO, the null device or the command's own stdout takes a stream, and
any other special file is refused in one line and left as it was: never replaced.

Device nodes are made here with mknod in a temporary directory (as root; the tests skip
otherwise), never aimed at /dev's own. spmd.corpus is the writer (no JAX: fast); spmd.train's
outputs are refused before anything compiles. spmd.generate's --output is tested with its
checkpoint in test_generate.
"""

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.commands import one_error_line

from spmd.base.errors import UserError
from spmd.config import TrainConfig
from spmd.data.corpus import token_stream
from spmd.data.tokenizer import load_tokenizer
from spmd.train import check_outputs

pytestmark = pytest.mark.xdist_group("outputs")

DRIVER = Path(__file__).with_name("cli_driver.py")
CORPUS = [sys.executable, "-m", "spmd.corpus", "--data", "corpus.txt", "--out"]


def _mknod(path: Path, kind: int, major: int, minor: int) -> None:
    try:
        os.mknod(path, 0o666 | kind, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("making a device node needs root")


def _kinds(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (stat.S_IFMT(p.lstat().st_mode), p.lstat().st_rdev) for p in folder.iterdir()}


def _tokens(folder: Path) -> np.ndarray:
    return token_stream(str(folder / "corpus.txt"), load_tokenizer(None))


def _npy(data: bytes, folder: Path) -> np.ndarray:
    (folder / "got.npy").write_bytes(data)
    return np.load(folder / "got.npy")


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    return tmp_path


def test_special_files_are_refused_in_one_line_and_left_as_they_were(folder):
    _mknod(folder / "full.npy", stat.S_IFCHR, 1, 7)  # what /dev/full is
    _mknod(folder / "zero.npy", stat.S_IFCHR, 1, 5)
    _mknod(folder / "loop.npy", stat.S_IFBLK, 7, 0)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "socket.npy"))
    os.mkfifo(folder / "fifo")
    (folder / "lock").mkdir()
    cases = {  # name -> (module, argv, the error line's end)
        "device": ("spmd.corpus", ["--out", "full.npy"], "--out full.npy is a character device (1:7), not a regular "
                   "file; give a file, a FIFO or /dev/stdout (a special file is never replaced)"),
        "zero": ("spmd.corpus", ["--out", "zero.npy"], "is a character device (1:5), not a regular file"),
        "block device": ("spmd.corpus", ["--out", "loop.npy"], "--out loop.npy is a block device, not a regular file"),
        "socket": ("spmd.corpus", ["--out", "socket.npy"], "--out socket.npy is a socket, not a regular file"),
        "train: metrics file is a device": ("spmd.train", ["--metrics-file", "full.npy"],
                                            "--metrics-file full.npy is a character device (1:7)"),
        # The metrics file is opened anew for each batch of records: a FIFO's reader would stop at the first.
        "train: metrics file is a FIFO": ("spmd.train", ["--metrics-file", "fifo"], "--metrics-file fifo is a FIFO, "
                                          "which --metrics-file would open again"),
        "train: out is a FIFO": ("spmd.train", ["--out", "fifo"], "--out fifo is a FIFO, not a directory"),
        "train: tensorboard is a device": ("spmd.train", ["--tensorboard", "zero.npy"],
                                           "--tensorboard zero.npy is a character device, not a directory"),
        "train: profile dir is a socket": ("spmd.train", ["--profile-steps", "1:1", "--profile-dir", "socket.npy"],
                                           "--profile-dir socket.npy is a socket, not a directory"),
    }
    before = _kinds(folder)
    batch = [{"module": module, "cwd": str(folder),
              "argv": (["--data", "corpus.txt"] if module == "spmd.corpus" else []) + argv}
             for module, argv, _ in cases.values()]
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    for (name, (_, _, fragment)), result in zip(cases.items(), json.loads(done.stdout)):
        assert result["code"] == 2 and result["stdout"] == "", (name, result)
        assert fragment in one_error_line(result["stderr"]), name
    assert _kinds(folder) == before  # not one replaced, nothing beside them


def test_a_fifo_with_a_reader_and_the_null_device_take_the_stream(folder):
    os.mkfifo(folder / "fifo.npy")
    _mknod(folder / "null.npy", stat.S_IFCHR, 1, 3)
    before = _kinds(folder)
    reader = subprocess.Popen(["cat", "fifo.npy"], cwd=folder, stdout=subprocess.PIPE)
    done = subprocess.run([*CORPUS, "fifo.npy"], cwd=folder, capture_output=True, text=True, timeout=120)
    streamed = reader.communicate(timeout=60)[0]
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(_npy(streamed, folder), _tokens(folder))
    (folder / "got.npy").unlink()
    done = subprocess.run([*CORPUS, "null.npy"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _kinds(folder) == before


def test_a_fifo_that_no_one_reads_is_refused_at_once(folder):
    os.mkfifo(folder / "fifo.npy")
    done = subprocess.run([*CORPUS, "fifo.npy"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == \
        "error: --out fifo.npy is a FIFO that no process reads; start its reader first"
    assert stat.S_ISFIFO((folder / "fifo.npy").stat().st_mode)


def test_dev_stdout_is_the_commands_own_stdout_whatever_it_is(folder):
    # A pipe: the token file alone on stdout, the command's line on stderr.
    done = subprocess.run([*CORPUS, "/dev/stdout"], cwd=folder, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(_npy(done.stdout, folder), _tokens(folder))
    assert done.stderr.decode().startswith("wrote ")
    # A shell's redirection to a file: written through the shell's descriptor, so the
    # file is the one the shell opened (a rename would leave the shell's behind, or
    # replace /dev/stdout itself).
    link = os.readlink("/dev/stdout") if os.path.islink("/dev/stdout") else None
    with open(folder / "out.npy", "wb") as out:
        done = subprocess.run([*CORPUS, "/dev/stdout"], cwd=folder, stdout=out, stderr=subprocess.PIPE, timeout=120)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(folder / "out.npy"), _tokens(folder))
    assert (os.readlink("/dev/stdout") if os.path.islink("/dev/stdout") else None) == link
    # Appending to the data itself: refused, as the data's own path is.
    before = (folder / "corpus.txt").read_bytes()
    with open(folder / "corpus.txt", "ab") as out:
        done = subprocess.run([*CORPUS, "/dev/stdout"], cwd=folder, stdout=out, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert done.returncode == 2
    assert "--out /dev/stdout would write over the input --data corpus.txt" in one_error_line(done.stderr)
    assert (folder / "corpus.txt").read_bytes() == before
    # Started with descriptor 1 closed: Python has no stdout, and the number may since name
    # a file the command opened (its held-back stderr, say). Refused, saying why.
    done = subprocess.run(["sh", "-c", 'exec "$@" 1>&-', "sh", *CORPUS, "/dev/stdout"], cwd=folder,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == ("error: --out /dev/stdout: this command has no stdout (descriptor 1 was "
                                           "closed when it started); give a file")


def test_a_link_is_written_through_and_a_broken_one_refused(folder):
    (folder / "real").mkdir()
    (folder / "link.npy").symlink_to(folder / "real" / "t.npy")  # to a file not made yet
    (folder / "dangling").symlink_to(folder / "no" / "such" / "dir")
    done = subprocess.run([*CORPUS, "link.npy"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == "error: --out link.npy is a broken symbolic link"
    (folder / "real" / "t.npy").write_bytes(b"old")
    done = subprocess.run([*CORPUS, "link.npy"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (folder / "link.npy").is_symlink()  # the link stays; the file it names is replaced whole
    np.testing.assert_array_equal(np.load(folder / "real" / "t.npy"), _tokens(folder))
    assert sorted(p.name for p in (folder / "real").iterdir()) == ["t.npy"]  # no temporary left


def test_outputs_that_coincide_are_refused_and_a_trace_may_join_the_scalars(tmp_path):
    def check(**outputs):
        check_outputs(TrainConfig.of(**outputs))

    tb = str(tmp_path / "tb")
    check(tensorboard=tb, profile_steps="1:1", profile_dir=tb)  # TensorBoard's layout: tb/plugins/profile
    check(tensorboard=tb, profile_steps="1:1", profile_dir=f"{tb}/trace", metrics_file=str(tmp_path / "m.jsonl"))
    check(out=str(tmp_path / "run"), metrics_file=str(tmp_path / "run" / "m.jsonl"))  # made with the run
    with pytest.raises(UserError, match="are the same path"):
        check(tensorboard=tb, metrics_file=tb)
    with pytest.raises(UserError, match="which holds only checkpoints"):
        check(out=tb, profile_steps="1:1", profile_dir=f"{tb}/trace")
    assert list(tmp_path.iterdir()) == []


def test_no_output_goes_into_a_run_or_a_step_directory_or_through_another_name_of_an_input(folder):
    """A file written into a run's directory makes the run refuse to resume (or lands in a
    checkpoint): refused for every command's outputs, whoever's run it is. An input seen
    through another name (a bind mount) is still the input."""
    run = folder / "run"
    (run / "3" / "meta").mkdir(parents=True)
    (run / ".spmd-lock").write_text("pid 1 on elsewhere\n")
    for out, where in ((run / "t.npy", run), (run / "3" / "t.npy", run / "3")):
        done = subprocess.run([*CORPUS, str(out)], cwd=folder, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and f"would write into the spmd run {where}," in one_error_line(done.stderr)
    with pytest.raises(UserError, match=f"--metrics-file {run}/m.jsonl would write into the spmd run {run},"):
        check_outputs(TrainConfig.of(out=str(folder / "mine"), metrics_file=str(run / "m.jsonl")))
    assert sorted(p.name for p in run.rglob("*")) == [".spmd-lock", "3", "meta"]

    (folder / "data").mkdir()
    (folder / "data" / "corpus.txt").write_text("some text " * 100)
    (folder / "alias").mkdir()
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind data alias && exec {' '.join(CORPUS[:3])} "
                           "--data data --out alias/t.npy"], cwd=folder, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "would write over the input --data data" in one_error_line(done.stderr)
    assert sorted(p.name for p in (folder / "data").iterdir()) == ["corpus.txt"]
