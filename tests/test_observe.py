"""What users watch: a profiler trace of chosen steps, TensorBoard scalars equal to the
metrics file, the ETA and the peak memory of the log line. (Bad --profile-steps,
--profile-dir and --tensorboard values are rows of test_bad_input.)"""

import glob
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.commands import in_namespace, one_error_line

from spmd.run.loop import log_line
from spmd.run.observe import duration, peak_memory_bytes

TRAIN = [sys.executable, "-m", "spmd.train", "--mesh", "dp=2", "--batch", "8", "--seq", "32", "--log-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run of 6 steps that traces steps 2-3 and writes scalars; then one that resumes it
    at step 3 (past the range) with the same scalars directory and metrics file."""
    tmp = tmp_path_factory.mktemp("observe")
    common = ["--steps", "6", "--profile-steps", "2:3", "--profile-dir", str(tmp / "prof"),
              "--tensorboard", str(tmp / "tb"), "--metrics-file", str(tmp / "m.jsonl")]
    first = subprocess.run([*TRAIN, *common, "--out", str(tmp / "run"), "--save-every", "3"],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    trace = sorted(glob.glob(str(tmp / "prof" / "plugins" / "profile" / "*")))
    resumed = subprocess.run([*TRAIN, *common, "--resume", str(tmp / "run" / "3"), "--out", str(tmp / "again")],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    return tmp, first.stdout, resumed.stdout, trace


@pytest.mark.filterwarnings("ignore:builtin type event_stats has no __module__")  # jaxlib 0.12's binding, when read
def test_profile_steps_write_a_trace_of_exactly_those_steps(runs):
    from jax.profiler import ProfileData

    tmp, out, _, trace = runs
    assert len(trace) == 1, trace  # one time-named folder, in TensorBoard's profile layout
    folder = Path(trace[0])
    xplane = list(folder.glob("*.xplane.pb"))  # what TensorBoard's profile plugin and xprof read
    assert len(xplane) == 1 and xplane[0].stat().st_size > 0
    events = [e for plane in ProfileData.from_file(str(xplane[0])).planes for line in plane.lines for e in line.events]
    assert [dict(e.stats)["step_num"] for e in events if e.name == "train"] == [2, 3]  # the step markers
    # The train step's dispatches (each a span, with nested spans of the same name): steps 2 and 3, no others.
    spans = sorted((e.start_ns, e.end_ns) for e in events if e.name == "PjitFunction(jit(_train_step))")
    outer = [s for i, s in enumerate(spans) if not any(a <= s[0] and s[1] <= b for a, b in spans[:i])]
    assert len(outer) == 2, spans
    perfetto = json.loads(gzip.decompress((folder / "perfetto_trace.json.gz").read_bytes()))  # for ui.perfetto.dev
    assert any(e.get("name") == "PjitFunction(jit(_train_step))" for e in perfetto["traceEvents"])
    lines = out.splitlines()
    start = lines.index(f"profile: tracing steps 2-3 into {tmp / 'prof'}")
    written = [i for i, line in enumerate(lines) if line.startswith(f"profile: steps 2-3 written to {folder} ")]
    assert written and lines[start + 1].startswith("[2/6") and written[0] == start + 2  # after step 2's log line


@pytest.mark.slow  # beyond what the gate holds of --profile: a resumed run
def test_a_run_resumed_past_the_profiled_steps_says_so_and_traces_nothing(runs):
    _, _, resumed, trace = runs
    assert "profile: steps 2-3 come before step 4, where this resumed run starts; no trace is taken" in resumed
    assert "tracing" not in resumed


def test_tensorboard_scalars_equal_the_metrics_file(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, _, _ = runs
    records = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))  # the resumed run replaced steps 3-5
    assert len(list((tmp / "tb").iterdir())) == 2  # one event file per run
    events = EventAccumulator(str(tmp / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    # Every number of the records is a scalar; the resumed run's restart at step 3 hid the first run's later events.
    assert set(events.Tags()["scalars"]) == {k for r in records for k in r} - {"step"}
    for name in ("loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "skipped"):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert got == [(r["step"], float(np.float32(r[name]))) for r in records], name


def test_an_unwritable_tensorboard_or_profile_dir_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "ro").mkdir()
    train = " ".join(TRAIN)
    done = in_namespace(f"""
        mount --bind ro ro && mount -o remount,bind,ro ro
        for flags in "--tensorboard ro/tb" "--profile-steps 1:1 --profile-dir ro/prof"; do
            {train} --steps 2 --metrics-file m.jsonl $flags >/dev/null 2>err.txt && echo "exit 0" || echo "exit $?"
            cat err.txt
        done""", tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0::2] == ["exit 2"] * 2, done.stdout
    for line, flag in zip(lines[1::2], ("--tensorboard ro/tb", "--profile-dir ro/prof")):
        assert one_error_line(line) == f"error: {flag} cannot be written: Read-only file system (in {tmp_path / 'ro'})"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["err.txt", "ro"]  # nothing made, not even m.jsonl


RECORD = {"step": 9, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1000.0, "step_time_s": 0.5,
          "tflops_per_device": 0.1, "skipped": False}


@pytest.mark.parametrize(("steps", "step_time", "eta"), [
    (10, 0.5, None),  # the last step: no ETA
    (34, 0.5, "eta 12s"),  # 24 steps left at 0.5 s
    (12, 0.1, "eta 1s"),  # rounded up: not 0 s while steps are left
    (410, 0.5, "eta 3m20s"),
    (3730, 1.0, "eta 1h02m"),
    (100_010, 2.0, "eta 55h33m"),
])
def test_the_log_line_ends_with_the_eta_of_the_steps_left_at_the_windows_pace(steps, step_time, eta):
    line = log_line(RECORD | {"step_time_s": step_time}, steps, 2.0, 0)
    assert line.startswith(f"[{10:>{len(str(steps))}}/{steps} ")
    if eta is None:
        assert "eta" not in line
    else:
        assert line.endswith(f"  {eta}"), line


def test_durations():
    assert [duration(s) for s in (0, 0.2, 59, 60, 61.5, 3599, 3600, 3661)] == [
        "0s", "1s", "59s", "1m00s", "1m02s", "59m59s", "1h00m", "1h01m"]


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_peak_memory_is_the_largest_devices_and_absent_where_the_backend_does_not_say():
    assert peak_memory_bytes([_Device(None), _Device(None)]) is None  # the CPU
    assert peak_memory_bytes([_Device({"peak_bytes_in_use": 5 << 30, "bytes_in_use": 1}),
                              _Device({"peak_bytes_in_use": 6 << 30})]) == 6 << 30
    line = log_line(RECORD | {"peak_memory_bytes": 3 << 29}, 10, 2.0, 0)
    assert re.search(r"TFLOP/s/device  peak 1\.5 GiB", line), line
    assert "peak" not in log_line(RECORD, 10, 2.0, 0)
