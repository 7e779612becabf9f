"""The devices that run a step decide whether it fits; `--hardware` plans for others and
decides nothing in spmd.train (spmd.plan keeps using it)."""

import math
import re
import subprocess
import sys

import pytest
from support.commands import one_error_line

from spmd.base.hardware import GIB, get, host_memory_bytes

pytestmark = pytest.mark.xdist_group("fit")

# The xla kernel keeps every layer's seq x seq scores: the tiny model's step at batch 8 on
# 8 devices peaks at about 300 GiB per device at seq 40,000, and grows as seq squared.
PEAK_AT_40K = 300 * GIB


def test_hardware_does_not_turn_off_the_host_memory_check(tmp_path):
    share, h200 = host_memory_bytes() / 8, get("h200").memory_bytes(8)
    if 2 * share > h200 / 2:
        pytest.skip("this host's share per device is as large as an H200's memory")
    seq = int(40_000 * math.sqrt(min(4 * share, h200 / 2) / PEAK_AT_40K))  # past the host, well inside an H200
    done = subprocess.run([sys.executable, "-m", "spmd.train", "--batch", "8", "--seq", str(seq), "--steps", "1",
                           "--attention-kernel", "xla", "--hardware", "h200", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    line = one_error_line(done.stderr)
    found = re.search(r"the step needs ([\d.]+) GiB per device at its peak, more than the [\d.]+ GiB of this host's "
                      r"memory, shared by 8 CPU devices; ", line)
    assert found, line
    assert share < float(found[1]) * GIB < h200  # it would fit the H200 it was planned for
    assert not (tmp_path / "run").exists()
