"""spmd.launch, spmd.corpus and spmd.export: bad input gives one `error:` line, exit code 2
and nothing written; real faults (Linux namespaces, a process limit, kill -9, not mocks)
give one line, leave nothing half-written behind, and the rerun works.

The bad-input table runs in one private mount namespace (as root: `unshare -rm`), where
`ro/` is read-only, `ro/inner/` a writable directory inside it, and `theirs/` belongs to a
user the namespace does not map (writes refused), so "cannot be written" is real too.
"""

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.commands import in_namespace, one_error_line, snapshot

pytestmark = pytest.mark.xdist_group("tools")

DRIVER = Path(__file__).with_name("cli_driver.py")
HOST = socket.gethostname()


# name -> (module, argv, fragment of the one error line). {names} are the fixture's files;
# relative outputs land in the case's own (empty) working directory.
CASES = {
    # spmd.launch
    "launch: command not found": ("spmd.launch", ["--nproc", "2", "--", "/no/such/command", "-x"],
                                  "command not found: /no/such/command"),
    "launch: command not executable": ("spmd.launch", ["--nproc", "2", "--", "{file}"], "permission denied"),
    "launch: absurd nproc": ("spmd.launch", ["--nproc", "100000", "--", "true"], "more than the 1024 processes"),
    # spmd.corpus
    "corpus: parquet of integers": ("spmd.corpus", ["--data", "{ints_parquet}", "--out", "t.npy"],
                                    "ints.parquet: column 'text' holds int64, not strings"),
    "corpus: parquet of lists": ("spmd.corpus", ["--data", "{lists_parquet}", "--out", "t.npy"],
                                 "lists.parquet: column 'text' holds list<"),
    "corpus: parquet of bytes": ("spmd.corpus", ["--data", "{bytes_parquet}", "--out", "t.npy"],
                                 "bytes.parquet: column 'text' holds binary, not strings"),
    "corpus: parquet with a null": ("spmd.corpus", ["--data", "{nulls_parquet}", "--out", "t.npy"],
                                    "nulls.parquet: column 'text' is null in row 1"),
    "corpus: jsonl number": ("spmd.corpus", ["--data", "{number_jsonl}", "--out", "t.npy"],
                             "number.jsonl, line 2: the text field 'text' is a number, not a string"),
    "corpus: jsonl null": ("spmd.corpus", ["--data", "{null_jsonl}", "--out", "t.npy"],
                           "null.jsonl, line 2: the text field 'text' is null"),
    "corpus: jsonl array": ("spmd.corpus", ["--data", "{array_jsonl}", "--out", "t.npy"],
                            "array.jsonl, line 2: the text field 'text' is an array"),
    "corpus: jsonl NaN": ("spmd.corpus", ["--data", "{nan_jsonl}", "--out", "t.npy"],
                          "nan.jsonl, line 1: x: must be finite (got nan)"),
    "corpus: jsonl lone surrogate": ("spmd.corpus", ["--data", "{surrogate_jsonl}", "--out", "t.npy"],
                                     "surrogate.jsonl, line 1: the text field 'text' holds a lone surrogate"),
    "corpus: jsonl key twice": ("spmd.corpus", ["--data", "{twice_jsonl}", "--out", "t.npy"],
                                "twice.jsonl, line 1: text: is given twice"),
    "corpus: data folder holding a FIFO": ("spmd.corpus", ["--data", "{with_fifo}", "--out", "t.npy"],
                                           "b.txt is a FIFO, not a data file"),
    "corpus: out is a directory": ("spmd.corpus", ["--data", "{corpus}", "--out", "{dir_npy}"], "is a directory"),
    "corpus: out under a file": ("spmd.corpus", ["--data", "{corpus}", "--out", "{file}/t.npy"],
                                 "is a file, not a directory"),
    "corpus: out in a directory under a file": ("spmd.corpus", ["--data", "{corpus}", "--out", "{file}/new/t.npy"],
                                                "cannot be created"),
    "corpus: out read-only": ("spmd.corpus", ["--data", "{corpus}", "--out", "{ro}/t.npy"], "Read-only file system"),
    "corpus: out in a new directory, read-only": ("spmd.corpus", ["--data", "{corpus}", "--out", "{ro}/new/t.npy"],
                                                  "cannot be written: Read-only file system"),
    "corpus: out not ours": ("spmd.corpus", ["--data", "{corpus}", "--out", "{theirs}/t.npy"], "Permission denied"),
    "corpus: out is the data": ("spmd.corpus", ["--data", "{tokens}", "--out", "{tokens}"],
                                "would write over the input --data"),
    "corpus: out inside the data": ("spmd.corpus", ["--data", "{text}", "--out", "{text}/t.npy"],
                                    "would write over the input --data"),
    "corpus: out is the tokenizer": ("spmd.corpus", ["--data", "{corpus}", "--tokenizer", "{tokens}", "--out",
                                                     "{tokens}"], "would write over the input --tokenizer"),
    "corpus: tokenizer directory without tokenizer.json": (
        "spmd.corpus", ["--data", "{corpus}", "--tokenizer", "{empty}", "--out", "t.npy"],
        "no tokenizer.json in the directory"),
    "corpus: data empty": ("spmd.corpus", ["--data", "", "--out", "t.npy"], "argument --data: the value is empty"),
    "corpus: out empty": ("spmd.corpus", ["--data", "{corpus}", "--out", ""], "argument --out: the value is empty"),
    "corpus: text field empty": ("spmd.corpus", ["--data", "{corpus}", "--out", "t.npy", "--text-field", ""],
                                 "argument --text-field: the value is empty"),
    "corpus: tokenizer empty": ("spmd.corpus", ["--data", "{corpus}", "--out", "t.npy", "--tokenizer", ""],
                                "argument --tokenizer: the value is empty"),
    # spmd.export
    "export: unknown flag": ("spmd.export", ["--checkpoint", "{run}", "--out", "e", "--bogus"],
                             "unrecognized arguments: --bogus"),
    "export: missing flags": ("spmd.export", [], "the following arguments are required: --out"),
    "export: neither checkpoint nor base": ("spmd.export", ["--out", "{file}/e"],
                                            "give one of --checkpoint RUN and --init-from DIR --adapter ADAPTER"),
    "export: peft of a run without adapters": ("spmd.export", ["--checkpoint", "{run}", "--format", "peft", "--out", "e"],
                                               "was trained without adapters (no --lora-rank)"),
    "export: out is a file": ("spmd.export", ["--checkpoint", "{run}", "--out", "{file}"], "is a file, not a directory"),
    "export: out under a file": ("spmd.export", ["--checkpoint", "{run}", "--out", "{file}/e"], "cannot be created"),
    "export: out read-only": ("spmd.export", ["--checkpoint", "{run}", "--out", "{ro}/e"], "Read-only file system"),
    "export: out an empty read-only dir": ("spmd.export", ["--checkpoint", "{run}", "--out", "{ro}"],
                                           "cannot be written: Read-only file system"),
    "export: out in a read-only dir": ("spmd.export", ["--checkpoint", "{run}", "--out", "{ro}/inner"],
                                       "its directory"),
    "export: out not ours": ("spmd.export", ["--checkpoint", "{run}", "--out", "{theirs}/e"], "Permission denied"),
    "export: out is a FIFO": ("spmd.export", ["--checkpoint", "{run}", "--out", "{fifo}"],
                              "fifo is a FIFO, not a directory"),
    "export: out not empty": ("spmd.export", ["--checkpoint", "{run}", "--out", "{full}"], "is not empty"),
    "export: out is the checkpoint": ("spmd.export", ["--checkpoint", "{run}", "--out", "{run}"],
                                      "would write over the input --checkpoint"),
    "export: out inside the run": ("spmd.export", ["--checkpoint", "{run}/2", "--out", "{run}/7"],
                                   "would write over the input --checkpoint"),
    "export: checkpoint missing": ("spmd.export", ["--checkpoint", "no/such/run", "--out", "e"],
                                   "--checkpoint no/such/run does not exist"),
    "export: checkpoint is a file": ("spmd.export", ["--checkpoint", "{file}", "--out", "e"], "is a file"),
    "export: checkpoint not a run": ("spmd.export", ["--checkpoint", "{empty}", "--out", "e"], "no spmd checkpoint"),
    "export: step negative": ("spmd.export", ["--checkpoint", "{run}", "--step", "-1", "--out", "e"],
                              "--step must be at least 0"),
    "export: step not a checkpoint": ("spmd.export", ["--checkpoint", "{run}", "--step", "7", "--out", "e"],
                                      "no checkpoint of that step"),
    "export: step against a step dir": ("spmd.export", ["--checkpoint", "{run}/2", "--step", "1", "--out", "e"],
                                        "--step 1 disagrees with --checkpoint"),
    "export: step not an integer": ("spmd.export", ["--checkpoint", "{run}", "--step", "1.5", "--out", "e"],
                                    "must be an integer, got '1.5'"),
    "export: cpu devices 0": ("spmd.export", ["--checkpoint", "{run}", "--cpu-devices", "0", "--out", "e"],
                              "--cpu-devices must be positive"),
    "export: cpu devices negative": ("spmd.export", ["--checkpoint", "{run}", "--cpu-devices", "-2", "--out", "e"],
                                     "--cpu-devices must be positive"),
    "export: mesh empty": ("spmd.export", ["--checkpoint", "{run}", "--mesh", "", "--out", "e"],
                           "argument --mesh: the value is empty"),
    "export: out empty": ("spmd.export", ["--checkpoint", "{run}", "--out", ""], "argument --out: the value is empty"),
    "export: checkpoint empty": ("spmd.export", ["--checkpoint", "", "--out", "e"], "the value is empty"),
}
# Cases that need the namespace's read-only and unmapped directories.


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A two-step checkpoint of the tiny model (step 2), for every export test."""
    run = tmp_path_factory.mktemp("checkpoint") / "run"
    done = subprocess.run([sys.executable, "-m", "spmd.train", "--batch", "8", "--seq", "32", "--steps", "2",
                           "--log-every", "1", "--out", str(run)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (run / "2" / "params").is_dir()
    return run


def _inputs(tmp: Path, run: Path) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp / "corpus.txt").write_text("some text " * 100)
    (tmp / "file.txt").write_text("not a program, not a directory\n")  # mode 644: exec refused, even for root
    (tmp / "text").mkdir()
    (tmp / "text" / "a.txt").write_text("a document")
    np.save(tmp / "tokens.npy", np.arange(100, dtype=np.uint16))
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp / "ints.parquet")
    pq.write_table(pa.table({"text": [["a", "b"], ["c"]]}), tmp / "lists.parquet")
    pq.write_table(pa.table({"text": pa.array([b"ab", b"cd"], pa.binary())}), tmp / "bytes.parquet")
    pq.write_table(pa.table({"text": pa.array(["ab", None], pa.string())}), tmp / "nulls.parquet")
    for name, value in (("number", 5), ("null", None), ("array", ["a"])):
        (tmp / f"{name}.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    (tmp / "nan.jsonl").write_text('{"text": "a", "x": NaN}\n')
    (tmp / "twice.jsonl").write_text('{"text": "a", "text": "b"}\n')
    (tmp / "surrogate.jsonl").write_text('{"text": "a\\ud800b"}\n')  # JSON's escape of no character
    (tmp / "with_fifo").mkdir()
    (tmp / "with_fifo" / "a.txt").write_text("a document")
    os.mkfifo(tmp / "with_fifo" / "b.txt")  # read, it would block the command
    for folder in ("dir.npy", "empty", "full", "ro/inner", "theirs"):
        (tmp / folder).mkdir(parents=True)
    (tmp / "full" / "keep.txt").write_text("mine")
    os.mkfifo(tmp / "fifo")
    os.chown(tmp / "theirs", 12345, 12345)  # a user the namespace does not map: no writes for us
    names = {"corpus": "corpus.txt", "file": "file.txt", "text": "text", "tokens": "tokens.npy",
             "ints_parquet": "ints.parquet", "lists_parquet": "lists.parquet", "bytes_parquet": "bytes.parquet",
             "nulls_parquet": "nulls.parquet", "number_jsonl": "number.jsonl", "null_jsonl": "null.jsonl",
             "array_jsonl": "array.jsonl", "dir_npy": "dir.npy", "empty": "empty", "full": "full", "ro": "ro", "fifo": "fifo",
             "theirs": "theirs", "nan_jsonl": "nan.jsonl", "twice_jsonl": "twice.jsonl", "with_fifo": "with_fifo",
             "surrogate_jsonl": "surrogate.jsonl"}
    return {key: str(tmp / name) for key, name in names.items()} | {"run": str(run)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, run_dir):
    """Every case, each in its own empty working directory, run by one driver (one fork
    per case) inside the namespace; the inputs (the checkpoint too) must be untouched."""
    inputs = tmp_path_factory.mktemp("inputs")
    files = _inputs(inputs, run_dir)
    before = snapshot(inputs), snapshot(run_dir)
    work = tmp_path_factory.mktemp("work")
    names = list(CASES)
    batch = []
    for i, name in enumerate(names):
        module, argv, _ = CASES[name]
        (work / str(i)).mkdir()
        batch.append({"module": module, "cwd": str(work / str(i)), "argv": [a.format(**files) for a in argv]})
    ro = files["ro"]
    command = ["unshare", "-rm", "sh", "-ec", f"mount --bind {ro} {ro}; mount -o remount,bind,ro {ro}; "
               f"mount -t tmpfs -o size=64k tmpfs {ro}/inner; exec {sys.executable} {DRIVER}"]
    done = subprocess.run(command, input=json.dumps(batch), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    after = snapshot(inputs), snapshot(run_dir)
    cases = {name: (result, work / str(i)) for i, (name, result) in enumerate(zip(names, json.loads(done.stdout)))}
    return cases, before, after


def test_bad_input_touches_no_input_and_leaves_nothing_beside_them(results):
    _, before, after = results
    assert after == before


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_error_line_exit_2_and_writes_nothing(results, case):
    result, cwd = results[0][case]
    assert result["code"] == 2, result
    assert result["stdout"] == ""
    line = one_error_line(result["stderr"])
    assert CASES[case][2] in line, line
    assert not any(cwd.iterdir()), list(cwd.iterdir())  # the working directory is as it was: empty


def _procs_of(uid: int) -> list[int]:
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if re.search(rf"^Uid:\s+{uid}\s", status.read_text(), re.M):
                pids.append(int(status.parent.name))
        except OSError:  # the process ended meanwhile
            pass
    return pids


def test_launch_that_cannot_start_every_process_stops_those_it_started(tmp_path):
    # A user of its own with at most 4 processes (a limit that applies to no root): the
    # launcher is one, three `sleep`s start, the fourth fork fails with EAGAIN.
    uid = 40000 + os.getpid() % 20000
    done = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
         "--ambient-caps=+dac_read_search", "prlimit", "--nproc=4",
         sys.executable, "-m", "spmd.launch", "--nproc", "10", "--", "sleep", "120"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    line = one_error_line(done.stderr)
    found = re.fullmatch(r"error: cannot start process (\d+) of 10: Resource temporarily unavailable; "
                         r"stopped the (\d+) already started", line)
    assert found and found[1] == found[2] and int(found[1]) >= 1, line
    assert _procs_of(uid) == []  # not one `sleep` left running


def test_a_signal_to_launch_reaches_every_process_group_and_ends_within_the_grace(tmp_path):
    """SIGTERM to the launcher goes to each process's group (a shell's children too), and
    those that ignore it are killed after --grace: the launch ends, naming the process, and
    nothing it started runs on (it used to leave the shells' children, or wait forever)."""
    uid = 40000 + os.getpid() % 20000  # a user of its own, so that what it runs can be found
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
         "--ambient-caps=+dac_read_search", sys.executable, "-m", "spmd.launch",
         "--nproc", "2", "--grace", "1", "--", "sh", "-c", "trap '' TERM; sleep 300; true"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(_procs_of(uid)) < 5:  # the launcher, two shells, two sleeps
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 137 and took < 1 + 2 + 1, (proc.returncode, took, err)  # --grace + 2 s, and a second
    assert re.fullmatch(r"error: process [01] of 2 failed \(killed by SIGKILL\)", one_error_line(err)), err
    deadline = time.monotonic() + 5  # (the shells' children, killed with them, are reaped by init)
    while _procs_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _procs_of(uid) == []


def test_corpus_on_a_full_disk_leaves_no_temporary_and_says_one_line(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "big.txt").write_bytes(rng.choice(list(b"abcdefgh "), 400_000).astype(np.uint8).tobytes())
    done = in_namespace(f"""
        mkdir disk
        mount -t tmpfs -o size=300k tmpfs disk
        {sys.executable} -m spmd.corpus --data big.txt --out disk/new/t.npy >out.txt 2>err.txt && echo "exit 0" \
            || echo "exit $?"
        ls -A disk""", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit 5"  # the disk's contents follow the exit code: nothing, not even new/
    assert one_error_line((tmp_path / "err.txt").read_text()) == \
        "error: writing --out disk/new/t.npy failed (No space left on device); nothing was written"
    assert (tmp_path / "out.txt").read_text() == ""


def test_text_beyond_memory_is_refused_in_one_line_before_or_while_tokenizing(tmp_path):
    from spmd.base.hardware import host_memory_bytes

    # More text than the host's memory: refused before a byte is read (a sparse file: no disk used).
    with open(tmp_path / "huge.txt", "wb") as f:
        f.truncate(host_memory_bytes() + 1)
    done = subprocess.run([sys.executable, "-m", "spmd.corpus", "--data", "huge.txt", "--out", "t.npy"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "of text, more than this host's memory" in one_error_line(done.stderr)
    # Less than the host's memory, more than the process may have (an address-space limit
    # of 1.5 GB against 350 MB of text, its decoded string and two bytes a token): refused
    # before it is tokenized (spmd.data.tokenizer.check_memory), naming both amounts.
    (tmp_path / "big.txt").write_text(("the quick brown fox jumps over the lazy dog " * 20 + "\n") * 400_000)
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))  # noqa: E731
    done = subprocess.run([sys.executable, "-m", "spmd.corpus", "--data", "big.txt", "--out", "t.npy"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(r"error: --data big.txt: tokenizing its 352,400,000 bytes of text takes up to 5.3 GiB of "
                        r"memory, and this process has [0-9.]+ MiB free; make token files \(.npy\) of it with "
                        r"python -m spmd.corpus on a larger host, or give less text", one_error_line(done.stderr))
    assert not (tmp_path / "t.npy").exists()


def test_export_on_a_full_disk_removes_what_it_wrote_and_says_one_line(tmp_path, run_dir):
    # The tiny model's parameters take 0.5 MB; the directories the export made go too.
    done = in_namespace(f"""
        mkdir disk
        mount -t tmpfs -o size=300k tmpfs disk
        {sys.executable} -m spmd.export --checkpoint {run_dir} --out disk/new/e >out.txt 2>err.txt && echo "exit 0" \
            || echo "exit $?"
        ls -A disk""", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit 5"
    assert one_error_line((tmp_path / "err.txt").read_text()) == \
        "error: writing --out disk/new/e failed (No space left on device); nothing was written"
    assert (tmp_path / "out.txt").read_text() == ""


def _exported_params(directory: Path):
    import jax
    import orbax.checkpoint as ocp

    from spmd.parallel.skeleton import model_skeleton

    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), model_skeleton("tiny").shapes)
    with ocp.StandardCheckpointer() as checkpointer:
        return jax.tree.leaves(checkpointer.restore(directory, target))


def test_a_killed_export_leaves_no_out_and_the_rerun_completes_it(tmp_path, run_dir):
    out = tmp_path / "exported"
    out.mkdir()  # an empty --out is accepted, and replaced
    others = [tmp_path / f"exported.tmp-{os.getpid()}@{HOST}", tmp_path / "exported.tmp-1@another-host"]
    for other in others:  # a live export's, another host's: never touched
        other.mkdir()
    cmd = [sys.executable, "-m", "spmd.export", "--checkpoint", str(run_dir), "--out", str(out)]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(f"exported.tmp-{first.pid}@*")):
            assert first.poll() is None and time.monotonic() < deadline, "the export ended before writing"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)  # mid-write
    finally:
        first.kill()
        first.wait()
    stale = tmp_path / f"exported.tmp-{first.pid}@{HOST}"
    assert stale.is_dir() and list(out.iterdir()) == []  # what was written is beside --out, not in it

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"exported the parameters of {run_dir / '2'} (tiny) to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["exported", *(o.name for o in others)])
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "params"]
    assert json.loads((out / "model.json").read_text())["step"] == 2
    for got, want in zip(_exported_params(out / "params"), _exported_params(run_dir / "2" / "params"), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_sigterm_ends_export_and_corpus_in_one_line_leaving_nothing(tmp_path, run_dir):
    """Export stopped mid-write, and corpus while it tokenizes: each says so in one line,
    exits 143, and leaves no output and no temporary."""
    (tmp_path / "corpus.txt").write_text("some text, " * 3_000_000)  # 33 MB: seconds of tokenizing
    commands = {
        "export": ([sys.executable, "-m", "spmd.export", "--checkpoint", str(run_dir), "--out", "exported"],
                   lambda pid: list(tmp_path.glob(f"exported.tmp-{pid}@*"))),  # its temporary: mid-write
        "corpus": ([sys.executable, "-m", "spmd.corpus", "--data", "corpus.txt", "--out", "t.npy"],
                   lambda pid: len(os.listdir(f"/proc/{pid}/task")) > 1),  # its signal thread: signals served
    }
    for name, (cmd, ready) in commands.items():
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not ready(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, f"{name} ended first"
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 143, (name, err)
        assert err.strip().splitlines() == ["SIGTERM: stopped; nothing was written"], (name, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"], name


def test_a_killed_corpus_runs_temporary_is_removed_by_the_rerun(tmp_path):
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free: the process that left the temporary is gone
    stale = tmp_path / f".t.npy.tmp-{dead.pid}@{HOST}"
    stale.write_bytes(b"\x93NUMPY half a file")
    live = tmp_path / f".t.npy.tmp-{os.getpid()}@{HOST}"
    live.write_bytes(b"another run's, still writing")
    done = subprocess.run([sys.executable, "-m", "spmd.corpus", "--data", "corpus.txt", "--out", "t.npy"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["corpus.txt", "t.npy", live.name])
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy")[:10], np.frombuffer(b"some text ", np.uint8))
    (tmp_path / "plain").write_text("")
    assert (tmp_path / "t.npy").stat().st_mode == (tmp_path / "plain").stat().st_mode  # as any new file, not 0600
