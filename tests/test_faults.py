"""Real faults, made with Linux namespaces rather than mocks (the tests run as root:
`unshare -rm` gives a private mount namespace for a read-only bind mount or a tiny tmpfs,
and a directory owned by a user the namespace does not map refuses writes): each ends in
one `error:` line, with nothing lost and nothing hanging."""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.commands import in_namespace, one_error_line

from spmd.formats.checkpoint import finalized_steps
from spmd.launch import free_port, process_env

FAST = ["--batch", "8", "--seq", "32", "--log-every", "1"]
TRAIN = [sys.executable, "-m", "spmd.train", *FAST]


@pytest.mark.slow  # test_outputs' too, in the gate
def test_an_out_that_cannot_be_written_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", 12345, 12345)  # a user the namespace does not map: no write for us
    os.chmod(tmp_path / "theirs", 0o755)
    train = " ".join(TRAIN)
    done = in_namespace(f"""
        mount --bind ro ro && mount -o remount,bind,ro ro
        for out in ro/run theirs/run ro; do
            {train} --out $out >/dev/null 2>err.txt && echo "exit 0" || echo "exit $?"
            cat err.txt
        done""", tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0::2] == ["exit 2"] * 3, done.stdout
    for line, why in zip(lines[1::2], ("Read-only file system", "Permission denied", "Read-only file system")):
        assert line.startswith("error: --out ") and "cannot be written" in line and why in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["err.txt", "ro", "theirs"]  # nothing made


def test_a_full_disk_during_a_save_ends_in_one_line_and_the_last_checkpoint_resumes(tmp_path):
    # A checkpoint of the tiny model takes 1.6 MB: the tmpfs holds the one of step 10, not the next.
    train = " ".join(TRAIN)
    done = in_namespace(f"""
        mkdir disk kept
        mount -t tmpfs -o size=2500k tmpfs disk
        {train} --steps 40 --save-every 10 --keep 5 --out disk/run >out.txt 2>err.txt && echo "exit 0" || echo "exit $?"
        cp -r disk/run kept/""", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit 5"
    line = one_error_line((tmp_path / "err.txt").read_text())
    assert re.fullmatch(r"error: saving the checkpoint of step 20 in \S+/disk/run failed \(No space left on device\); "
                        r"the last complete checkpoint is \S+/disk/run/10", line), line
    kept = tmp_path / "kept" / "run"
    assert finalized_steps(kept) == [10]
    resumed = subprocess.run([*TRAIN, "--steps", "40", "--save-every", "10", "--keep", "5", "--resume", str(kept / "10"),
                              "--out", str(tmp_path / "again")], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {kept / '10'}" in resumed.stdout
    assert finalized_steps(tmp_path / "again") == [20, 30, 40]


def test_a_metrics_file_on_a_full_disk_ends_in_one_line_and_leaves_no_empty_out(tmp_path):
    # One free page (4 KiB) for the metrics file: about 15 steps' records, then the disk is full.
    train = " ".join(TRAIN)
    done = in_namespace(f"""
        mkdir disk
        mount -t tmpfs -o size=64k tmpfs disk
        dd if=/dev/zero of=disk/filler bs=4k count=15 2>/dev/null
        {train} --steps 200 --metrics-file disk/m.jsonl --out run >out.txt 2>err.txt && echo "exit 0" || echo "exit $?"
        """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit 5"
    line = one_error_line((tmp_path / "err.txt").read_text())
    assert line == "error: cannot write --metrics-file disk/m.jsonl: No space left on device"
    assert not (tmp_path / "run").exists()  # made by this run, never saved into: removed


@pytest.mark.slow  # a fault of two processes
def test_two_processes_stop_after_the_same_step_when_one_is_told_to(tmp_path):
    port = free_port()
    cmd = [*TRAIN, "--steps", "100000", "--out", str(tmp_path / "run"), "--step-timeout", "60"]
    procs = [subprocess.Popen(cmd, env=process_env(i, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    try:
        for line in procs[0].stdout:  # process 0 logs every step; let both train a little
            if re.match(r"\[\s*3/", line):
                break
        procs[1].send_signal(signal.SIGTERM)  # only one of them
        (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], (err0, err1)
    assert "SIGTERM: finishing this step" in err1 and "SIGTERM" not in err0
    # Each process says where it stopped: the same step, told or not.
    reports = [re.findall(rf"^\[process {i}/2\] stopped by SIGTERM after step (\d+); saved \S+$", out, re.M)
               for i, out in enumerate((out0, out1))]
    assert len(reports[0]) == 1 and reports[0] == reports[1], (out0, out1)
    assert finalized_steps(tmp_path / "run") == [int(reports[0][0])]  # both wrote their shards of that one step


def test_a_second_run_on_the_same_out_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    run, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    cmd = [*TRAIN, "--steps", "100000", "--save-every", "3", "--out", str(run), "--metrics-file", str(metrics)]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:
            if re.match(r"\[\s*5/", line):
                break
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        line = one_error_line(second.stderr)
        assert f"--out {run} is in use by another run (pid {first.pid} on " in line
        first.kill()  # kill -9 mid-run: its lock goes with it
        first.wait()
    finally:
        first.kill()
    third = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in third.stdout:
            out.append(line)
            if re.match(r"\[\s*\d+/", line):  # its first step after the resume
                third.send_signal(signal.SIGTERM)
                break
        rest, err = third.communicate(timeout=120)
    finally:
        third.kill()
    assert third.returncode == 0, err
    resumed = re.search(rf"^resumed from {run}/(\d+) ", "".join(out), re.M)
    assert resumed and int(resumed[1]) >= 3, "".join(out)
    # The metrics file lives in --out; after the resume each step is there once, in order.
    steps = [int(m) for m in re.findall(r'"step": (\d+)', metrics.read_text())]
    assert steps == list(range(len(steps))) and len(steps) > int(resumed[1])


def test_signals_during_start_up_end_cleanly_with_nothing_written(tmp_path):
    procs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / sig.name
        procs[sig] = (subprocess.Popen([*TRAIN, "--out", str(out), "--metrics-file", str(out) + ".jsonl"],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)
    time.sleep(3)  # importing, building and compiling: the step is some seconds away
    for sig, (proc, _) in procs.items():
        proc.send_signal(sig)
    for sig, (proc, out) in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 0}[sig], stderr
        assert stderr.strip() == f"{sig.name}: stopped during start-up, before the first step; nothing was written"
        assert "[" not in stdout  # no step ran
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_coordinator_is_given_up_in_one_line():
    started = time.monotonic()
    done = subprocess.run([*TRAIN, "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                           "--process-id", "1", "--join-timeout", "3"], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60  # JAX's own deadline (ours + 30 s) would abort with a C++ stack
    assert done.returncode == 3
    waiting, error = done.stderr.strip().splitlines()
    assert waiting.startswith("process 1 of 2 waits for the others at 127.0.0.1:") and "up to 3 s" in waiting
    assert error.startswith("error: the run's processes did not all join within 3 s at 127.0.0.1:")


def test_a_step_that_does_not_fit_is_refused_before_anything_is_allocated(tmp_path):
    # The xla kernel keeps every layer's seq x seq scores: terabytes at 100k tokens (the
    # chunked one needs memory linear in the sequence, and this step would fit).
    done = subprocess.run([*TRAIN, "--seq", "100000", "--attention-kernel", "xla", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert re.search(r"the step needs [\d.]+ TiB per device at its peak, more than the [\d.]+ GiB of this host's "
                     r"memory, shared by 8 CPU devices; .*--ignore-fit", line), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a fault past those the gate holds (full disks, kill -9, signals)
def test_a_non_finite_update_is_dropped_even_when_loss_and_gradient_are_finite():
    from spmd.config import TrainConfig, validate
    from spmd.data.feed import global_batch
    from spmd.data.synthetic import MarkovSource
    from spmd.layout import make_layout
    from spmd.parallel.step import build_program

    cfg = validate(TrainConfig.of(mesh="", batch=4, seq=16, steps=2))
    layout = make_layout(cfg, jax.devices()[:1])
    program = build_program(cfg.step, layout)
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(0))
    # A second moment gone bad (as a NaN learning rate would make the update): the loss and
    # the gradient are finite, the update is not.
    adam = state["opt_state"][1][0]
    poisoned = adam._replace(nu=jax.tree.map(lambda v: jnp.full_like(v, jnp.nan), adam.nu))
    state["opt_state"] = (state["opt_state"][0], (poisoned, *state["opt_state"][1][1:]), *state["opt_state"][2:])
    before = jax.device_get(state["params"])
    batch = global_batch(MarkovSource(layout.skeleton.model_cfg.vocab, 0), 0, cfg.training.batch, cfg.training.seq + 1,
                         layout.batch_sharding)
    state, metrics = program.compile_step()(state, batch)
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert bool(metrics["skipped"])
    for got, want in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, want)
