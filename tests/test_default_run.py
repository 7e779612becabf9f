"""`python -m spmd.train` with no arguments: a multi-axis mesh on emulated CPU devices
that learns the synthetic chain to within 0.1 nats of its floor."""

import json
import os
import re
import subprocess
import sys

from spmd.data.synthetic import MarkovSource


def test_default_run_reaches_the_synthetic_floor(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # As a user runs it: nothing set. The test extra installs libtpu (to compile for TPUs)
    # on this TPU-less host, which must change nothing: no TPU flags, no libtpu start.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    # The one flag only records metrics; everything else is the built-in default.
    proc = subprocess.run([sys.executable, "-m", "spmd.train", "--metrics-file", str(metrics)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "LIBTPU_INIT_ARGS" not in out and "TPU" not in proc.stderr, proc.stderr[-2000:]
    assert "mesh: dp=2,fsdp=2,tp=2 over 8 x cpu" in out
    assert re.search(r"model: tiny, 131,392 parameters", out)
    assert "state per device:" in out

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(300))
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "tflops_per_device"):
        assert all(r[key] >= 0 for r in records), key

    floor = MarkovSource(256, seed=0).entropy_floor(64)
    assert f"floor {floor:.4f}" in out
    final = sum(r["loss"] for r in records[-10:]) / 10
    assert records[0]["loss"] > floor + 3  # it started far away ...
    assert final - floor < 0.1  # ... and learned the chain
