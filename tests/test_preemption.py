"""The CLI survives: SIGTERM saves and exits 0, kill -9 never corrupts the last good
checkpoint, and bad checkpoints are refused with one line."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import snapshot

from spmd.formats.checkpoint import finalized_steps, read_meta

SFT = Path(__file__).parent / "sft"

FAST = ["--batch", "8", "--seq", "32", "--log-every", "1"]


def _start(*args, session: bool = False):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, "-m", "spmd.train", *FAST, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=session)


def _wait_for_line(proc, prefix: str, timeout: float = 120) -> list[str]:
    """Read stdout until a line starts with `prefix`; returns the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return lines
    proc.kill()
    raise AssertionError(f"no line starting with {prefix!r}: {''.join(lines)}{proc.stderr.read()}")


@pytest.mark.slow  # a job stopped as a scheduler stops it: processes and signals
def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path):
    """As a scheduler stops a job: SIGTERM to every process of it, the data's worker
    processes too (which leave the stop to the trainer, then end with it). The checkpoint
    holds where the records' rows of its step begin."""
    proc = _start("--steps", "100000", "--out", str(tmp_path), "--init-from", str(SFT / "model"), "--data",
                  str(SFT / "chat.jsonl"), "--data-workers", "1", session=True)
    _wait_for_line(proc, "[")  # training has started
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM: finishing this step" in err
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM")]
    assert stopped, out
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert finalized_steps(tmp_path) == [step]
    assert read_meta(tmp_path, step)["data"]["records"] == 12
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the workers end with the trainer
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("processes of the run outlived it")


def test_a_second_sigint_aborts_at_once(tmp_path):
    proc = _start("--steps", "100000", "--out", str(tmp_path))
    _wait_for_line(proc, "[")
    proc.send_signal(signal.SIGINT)
    # Two signals sent at once would merge into one: wait until the first one was handled.
    for line in iter(proc.stderr.readline, ""):
        if "SIGINT: finishing this step" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "SIGINT again: aborting now" in err


def test_kill_9_at_random_times_never_leaves_a_bad_latest_checkpoint(tmp_path):
    chance = random.Random(7)  # fixed, so a failure can be replayed
    latest = None
    for _ in range(3):
        # Save after every step, so most instants fall inside some save.
        proc = _start("--steps", "100000", "--out", str(tmp_path), "--save-every", "1")
        lines = _wait_for_line(proc, "[")
        if latest is not None:  # the previous kill left a checkpoint this run resumed from
            assert any(f"resumed from {tmp_path / str(latest)}" in line for line in lines), lines
        time.sleep(chance.uniform(0.0, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        steps = finalized_steps(tmp_path)
        assert steps, "no complete checkpoint after several steps"
        assert latest is None or steps[-1] >= latest
        latest = steps[-1]
    # A last run resumes from the latest and finishes normally.
    proc = _start("--steps", str(latest + 2), "--out", str(tmp_path), "--resume-with-changes")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"resumed from {tmp_path / str(latest)}" in out
    assert finalized_steps(tmp_path)[-1] == latest + 2


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("good")
    proc = _start("--steps", "2", "--out", str(run))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return run


def test_bad_checkpoints_give_one_error_line_and_change_nothing(good_run, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(good_run, truncated)
    for chunk in (truncated / "2" / "params").rglob("d/*"):
        chunk.write_bytes(chunk.read_bytes()[:10])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint\n")
    cases = {
        "another model": (["--resume", str(good_run), "--model", "small"], "parameters differ"),
        "truncated": (["--resume", str(truncated)], "is unreadable"),
        "foreign --resume": (["--resume", str(foreign)], "no spmd checkpoint"),
        "foreign --out": (["--out", str(foreign)], "not spmd checkpoints"),
        "missing --resume": (["--resume", str(tmp_path / "nowhere")], "does not exist"),
    }
    before = {p: snapshot(p) for p in (good_run, truncated, foreign)}
    procs = {name: _start("--steps", "2", *args) for name, (args, _) in cases.items()}  # good_run's
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and cases[name][1] in lines[0], (name, err)
    assert {p: snapshot(p) for p in before} == before  # nothing overwritten
