"""The tiers (tests/tiers.py) hold what they say: CI's slices of the slow tier cover it
whole, and every pattern naming slow or floor tests still names a test. Collection only."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiers

ROOT = Path(__file__).parents[1]
CI_SLICES = 4  # .ci/run: slice (commit count mod 4) of the slow tier, so each runs in any 4 consecutive commits
# The costliest slice's test time by tiers.UNIT_SECONDS, shared by two workers (at most about
# 7.5 minutes of wall time): with the gate (10 minutes), both installs (3) and the floor pass
# (4), within .ci/run's 30 minutes.
SLICE_BUDGET_S = 900


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> list[dict]:
    """Every test of the suite, both tiers, as one collection (no worker processes) sees it."""
    out = tmp_path_factory.mktemp("tiers") / "tiers.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-o", "addopts=",
                           "--tier", "all", f"--list-tiers={out}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_ci_slices_cover_the_slow_tier_once(collected):
    slow = [(t["unit"], t["id"]) for t in collected if t["slow"]]
    assert slow, "no slow test was collected"
    parts = tiers.slices(slow, CI_SLICES)
    assert sorted(i for part in parts for i in part) == sorted(i for _, i in slow), "a slow test in no slice or two"
    unit_of = dict((i, u) for u, i in slow)
    units = [{unit_of[i] for i in part} for part in parts]
    for a in range(CI_SLICES):
        for b in range(a + 1, CI_SLICES):
            assert not units[a] & units[b], f"a unit split between slices {a} and {b} would pay its fixtures twice"
    costs = [sum(tiers.unit_cost(u, sum(1 for v, _ in slow if v == u)) for u in part) for part in units]
    print(f"the slices' estimated seconds: {[round(c) for c in costs]}")
    assert max(costs) <= SLICE_BUDGET_S, costs


def test_every_pattern_names_a_test(collected):
    ids = [t["id"] for t in collected]
    stale = [p for p in tiers.SLOW + tiers.GATE + tiers.FLOOR if not any(tiers.pattern_matches(p, i) for i in ids)]
    assert not stale, f"these patterns of tests/tiers.py match no test: {stale}"


def test_ci_runs_the_gate_then_a_slice_chosen_by_the_commit():
    text = (ROOT / ".ci" / "run").read_text()
    assert f"SLICES={CI_SLICES}" in text and "% SLICES" in text and '--tier slow --slow-slice "$slice/$SLICES"' in text
