"""Under a real SLURM (tests/slurm_cluster.py): the documented job script
(examples/slurm/train.sbatch), submitted with sbatch for two tasks, trains as one run with
the losses of one process; stopped by SIGTERM (as a preemption stops it) or by the
time-limit warning, every process saves the same step, and the requeued job resumes from
it to the losses of a run never stopped."""

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.commands import losses_by_step
from slurm_cluster import Slurm, install

from spmd.formats.checkpoint import finalized_steps

pytestmark = [pytest.mark.xdist_group("multihost"),  # one worker for the runs of several processes
              pytest.mark.slow]  # a SLURM cluster's processes and hosts

SCRIPT = Path(__file__).parents[1] / "examples" / "slurm" / "train.sbatch"
STEPS = 100
FLAGS = ["--mesh", "dp=2,fsdp=2,tp=2", "--steps", str(STEPS), "--batch", "16", "--seq", "32", "--warmup", "1",
         "--log-every", "1"]
STOPPED = re.compile(r"^\[process (\d)/2\] stopped by (SIG\w+) after step (\d+); saved", re.M)


@pytest.fixture(scope="session")  # once per worker, whatever runs between its tests
def slurm(tmp_path_factory):
    reason = install()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    # Jobs run this interpreter (the script calls `python`) with the tests' environment
    # (sbatch passes the submitting shell's on): the same compilation cache and XLA flags.
    cluster.env["PATH"] = f"{Path(sys.executable).parent}:{cluster.env['PATH']}"
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(slurm: Slurm, workdir: Path, *train_args: str) -> tuple[str, Path]:
    """The documented script as a user submits it, for one node of two tasks (the script asks
    for two nodes of one: there is one node here). -> the job id and its log file"""
    job = slurm.command("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--chdir={workdir}",
                        str(SCRIPT), *FLAGS, *train_args).stdout.strip()
    return job, workdir / f"spmd-{job}.out"


def _wait(what: str, ready, slurm: Slurm, log: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := ready()) is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:g} s:\n{log.read_text() if log.exists() else ''}\n{slurm.logs()}")


def _job_over(slurm: Slurm, job: str, log: Path, timeout: float = 300) -> str:
    over = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    return _wait(f"end of job {job}", lambda: s if (s := slurm.job_state(job)) in over else None, slurm, log, timeout)



@pytest.fixture(scope="session")  # once per worker, whatever runs between its tests
def uninterrupted(slurm, tmp_path_factory):
    """The script's 2-task job and one process with the whole mesh, at once."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    one = subprocess.Popen([sys.executable, "-m", "spmd.train", *FLAGS, "--metrics-file", str(tmp / "one.jsonl")],
                           env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job, log = _submit(slurm, tmp, "--dcn", "dp=2", "--metrics-file", str(tmp / "two.jsonl"))
    _, err = one.communicate(timeout=600)
    assert one.returncode == 0, err
    assert _job_over(slurm, job, log) == "COMPLETED", log.read_text()
    return {"one": losses_by_step(tmp / "one.jsonl"), "two": losses_by_step(tmp / "two.jsonl"), "log": log.read_text()}


def test_the_job_script_runs_two_tasks_as_one_run_with_the_losses_of_one_process(uninterrupted):
    log = uninterrupted["log"]
    # jax.distributed found the processes in srun's environment; process 0 speaks for the run.
    assert "process 0 of 2 (SLURM) waits for the others" in log and "process 1 of 2 (SLURM)" in log
    assert "over 8 x cpu" in log and log.count("mesh:") == 1
    assert list(uninterrupted["two"]) == list(range(STEPS))
    # The same rows and math on 2 x 4 devices as on 1 x 8: sums over the devices in another
    # grouping (across the processes, then within) differ in the last bits of float32.
    np.testing.assert_allclose(list(uninterrupted["two"].values()), list(uninterrupted["one"].values()), rtol=1e-6)


def test_stopped_three_times_and_requeued_the_job_ends_with_the_losses_of_one_never_stopped(
        slurm, uninterrupted, tmp_path):
    seed = random.randrange(1 << 30)
    chance = random.Random(seed)  # the steps differ from run to run; the seed replays them
    job, log = _submit(slurm, tmp_path, "--dcn", "dp=2", "--out", str(tmp_path / "ckpt"),
                       "--metrics-file", str(tmp_path / "ckpt" / "metrics.jsonl"))
    stops = []
    # Twice SIGTERM to the tasks, as a preemption (or scancel) sends it, then requeued as
    # SLURM requeues a preempted job; once the time limit's warning, USR1 to the script
    # (what --signal=B:USR1@300 sends), which stops the run and requeues the job itself.
    for how in ("TERM", "TERM", "USR1"):
        start = stops[-1] if stops else 0
        at = start + chance.randint(2, 8)
        _wait(f"step {at} (seed {seed})", lambda: True if _logged_step(log, len(stops)) >= at else None, slurm, log)
        if how == "TERM":
            slurm.command("scancel", "--signal=TERM", job)
        else:
            slurm.command("scancel", "--batch", "--signal=USR1", job)
        reports = _wait("both processes' stop", lambda: r if len(r := STOPPED.findall(log.read_text())) >= 2 * (
            len(stops) + 1) else None, slurm, log)[2 * len(stops):]
        assert {name for _, name, _ in reports} == {f"SIG{how}"} and {p for p, _, _ in reports} == {"0", "1"}
        step = {int(s) for _, _, s in reports}
        assert len(step) == 1, reports  # both processes stopped after the same step
        stops.append(step.pop())
        assert start < stops[-1] < STEPS
        if how == "TERM":
            assert _job_over(slurm, job, log) == "COMPLETED"  # the tasks stopped cleanly (exit 0)
            slurm.command("scontrol", "requeue", job)
        else:  # the script requeues the job
            _wait("the requeue", lambda: True if slurm.restarts(job) == len(stops) else None, slurm, log)
        assert finalized_steps(tmp_path / "ckpt")[-1] == stops[-1]  # saved, whole, before the job ended
    print(f"stopped after steps {stops} (seed {seed})")
    assert _job_over(slurm, job, log, timeout=600) == "COMPLETED"
    text = log.read_text()
    for step in stops:
        assert f"resumed from {tmp_path / 'ckpt' / str(step)}" in text
    losses = losses_by_step(tmp_path / "ckpt" / "metrics.jsonl")
    assert list(losses) == list(range(STEPS))  # each step once, across the four starts of the job
    # Resumed on the same mesh and processes, a stopped run computes what an unstopped one does.
    assert losses == uninterrupted["two"], f"stopped after steps {stops} (seed {seed})"


def _logged_step(log: Path, starts: int) -> int:
    """The last step process 0 logged in the job's `starts`-th start (0: the first)."""
    text = log.read_text() if log.exists() else ""
    parts = re.split(r"^resumed from .*$", text, flags=re.M)
    if len(parts) <= starts:
        return -1
    steps = re.findall(r"^\[\s*(\d+)/\d+", parts[starts], re.M)
    return int(steps[-1]) if steps else -1
