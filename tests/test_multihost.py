"""Several processes: 2 processes x 4 emulated devices train like 1 process x 8, each
reading only its own rows; their checkpoint resumes in one process; a killed process
makes the other exit with an error instead of waiting forever."""

import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from spmd.launch import free_port, process_env

pytestmark = pytest.mark.xdist_group("multihost")  # one worker: the runs are started together

WORDS = "the cat sat on a mat and a dog ran to the big red house by the small blue door".split()
# 4 steps of 16 rows of 32 tokens; a log line and an evaluation every 2 steps.
FLAGS = ["--mesh", "dp=2,fsdp=2,tp=2", "--steps", "4", "--batch", "16", "--seq", "32", "--warmup", "1",
         "--log-every", "2", "--eval-every", "2", "--eval-batches", "2"]


def _train(*args):
    return [sys.executable, "-m", "spmd.train", *FLAGS, *args]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows_read(stdout: str) -> dict[str, int]:
    """`data: read N training rows` per process ('' when there is one)."""
    return {who: int(n.replace(",", "")) for who, n in
            re.findall(r"^(\[process \d/\d\] )?data: read ([\d,]+) training rows", stdout, re.M)}


@pytest.fixture(scope="session")  # once per worker, whatever runs between its tests
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):  # ~27k bytes: 800+ samples of 32, of which 5% held out
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, 500)) + "\n")
    data = ["--data", str(corpus)]
    two = subprocess.Popen(
        [sys.executable, "-m", "spmd.launch", "--nproc", "2", "--",
         *_train(*data, "--dcn", "dp=2", "--metrics-file", str(tmp / "two.jsonl"),
                 "--out", str(tmp / "ckpt"), "--save-every", "2")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = subprocess.Popen(_train(*data, "--metrics-file", str(tmp / "one.jsonl")),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (two_out, two_err), (one_out, one_err) = two.communicate(timeout=600), one.communicate(timeout=600)
    assert two.returncode == 0, two_err
    assert one.returncode == 0, one_err
    # The checkpoint of step 2, written by two processes, resumed by one on another mesh.
    resumed = subprocess.run(_train(*data, "--mesh", "fsdp=4,tp=2", "--resume", str(tmp / "ckpt" / "2"),
                                    "--metrics-file", str(tmp / "resumed.jsonl")),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    return {"two": (_records(tmp / "two.jsonl"), two_out), "one": (_records(tmp / "one.jsonl"), one_out),
            "resumed": (_records(tmp / "resumed.jsonl"), resumed.stdout), "corpus": corpus}


def test_two_processes_give_the_losses_of_one_and_read_only_their_rows(runs):
    two, two_out = runs["two"]
    one, one_out = runs["one"]
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2, 3]
    # The same rows, the same math, sums over devices in the same order: the spec's
    # 1e-5 relative (as the parity matrix) holds with room to spare.
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5)
    evals = [[r["eval_loss"] for r in rs if "eval_loss" in r] for rs in (two, one)]
    assert len(evals[0]) == 2 and evals[0][1] < evals[0][0]  # held-out loss, measured twice, falls
    np.testing.assert_allclose(evals[0], evals[1], rtol=1e-5)
    # dp=2 spans the processes: each holds 8 of the 16 rows, and read only those (4 steps).
    assert _rows_read(two_out) == {"[process 0/2] ": 32, "[process 1/2] ": 32}
    assert _rows_read(one_out) == {"": 64}
    assert "over 8 x cpu" in two_out and two_out.count("mesh:") == 1  # process 0 speaks for the run


def test_a_checkpoint_of_two_processes_resumes_in_one(runs):
    one, _ = runs["one"]
    resumed, out = runs["resumed"]
    assert "resumed from" in out
    assert [r["step"] for r in resumed] == [2, 3]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in one[2:]], rtol=1e-5)
    assert resumed[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)


@pytest.mark.slow  # a fault of two processes
def test_killing_one_process_makes_the_other_exit_with_an_error(runs):
    port = free_port()
    cmd = _train("--data", str(runs["corpus"]), "--steps", "100000", "--log-every", "1", "--eval-every", "0",
                 "--step-timeout", "30")
    survivor = subprocess.Popen(cmd, env=process_env(0, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    victim = subprocess.Popen(cmd, env=process_env(1, 2, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for line in survivor.stdout:  # process 0 logs every step; let both train a little
            if re.match(r"\[\s*3/", line):
                break
        victim.kill()
        killed = time.monotonic()
        _, err = survivor.communicate(timeout=120)
    finally:
        for p in (survivor, victim):
            p.kill()
    # Bounded: a collective with the dead process fails at once, or --step-timeout (30 s) ends the wait.
    assert time.monotonic() - killed < 60
    assert survivor.returncode not in (0, None)
    assert re.search(r"^error: process 0 of 2 stops: .*(did another process die\?)|^error: .* did not finish within",
                     err, re.M), err


def test_the_processes_come_from_flags_else_the_environment_else_there_is_one():
    from spmd.base.errors import UserError
    from spmd.config import TrainConfig
    from spmd.run.distributed import one_task_per_node, processes

    flags = TrainConfig.of(coordinator="10.0.0.1:1234", num_processes=4, process_id=3)
    env = {"JAX_COORDINATOR_ADDRESS": "h:99", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "n[1-16]"}
    got = processes(flags, env)  # flags win over the environment
    assert (got.count, got.index, got.coordinator, got.found_in) == (4, 3, "10.0.0.1:1234", "flags")
    got = processes(TrainConfig.of(), env)
    assert (got.count, got.index, got.coordinator, got.found_in) == (2, 1, "h:99", "environment")
    got = processes(TrainConfig.of(), {**slurm, "SLURM_PROCID": "5"})  # JAX finds the coordinator itself
    assert (got.count, got.index, got.coordinator, got.found_in) == (16, 5, None, "SLURM")
    # One task per node drives all the node's GPUs; several share them, one GPU each (JAX's default).
    assert one_task_per_node({**slurm, "SLURM_STEP_NUM_NODES": "16"})
    assert not one_task_per_node({**slurm, "SLURM_STEP_NUM_NODES": "2"}) and not one_task_per_node({})
    assert processes(TrainConfig.of(coordinator="auto"), {}).count == 0  # JAX detects the cluster
    assert not processes(TrainConfig.of(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).multi
    assert not processes(TrainConfig.of(), {}).multi
    for cfg, environ, message in (
            (TrainConfig.of(num_processes=2), {}, "need all of --coordinator"),
            (TrainConfig.of(coordinator="nohost", num_processes=2, process_id=0), {}, "is not host:port"),
            (TrainConfig.of(coordinator="h:1", num_processes=2, process_id=2), {}, "not one of 2 processes"),
            (TrainConfig.of(), {"JAX_COORDINATOR_ADDRESS": "h:1"}, "but not JAX_NUM_PROCESSES, JAX_PROCESS_ID"),
            (TrainConfig.of(), {**env, "JAX_PROCESS_ID": "one"}, "is not an integer")):
        with pytest.raises(UserError, match=message):
            processes(cfg, environ)
