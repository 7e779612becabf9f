"""The tiers (tests/tiers.py) hold what they say: CI's slices of the slow tier cover it
whole, every test's tier is declared where the test is defined (a marker pytest knows), and
the tier options refuse in one line what they cannot do. Collection only."""

import json
import subprocess
import sys
import tracemalloc
import types
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
    """Every test of the suite, both tiers, as one collection (no worker processes) sees it.
    With --strict-markers: a misspelt tier (`pytest.mark.slwo`) fails here, where it would
    leave a slow test in the gate unseen."""
    out = tmp_path_factory.mktemp("tiers") / "tiers.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-o", "addopts=",
                           "--strict-markers", "--tier", "all", f"--list-tiers={out}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # (xdist loaded, no workers: it registers xdist_group)
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


def test_every_tier_is_declared_where_its_test_is_defined(collected):
    """`slow` and `floor` come from the test's module, class, function or case, never from a
    hook (tests/tiers.py only reads them); a test whose cases are split between the tiers
    marks its slow cases one by one (`pytest.param`, `support.cases.tiered`), and every
    module of a marked test has its areas."""
    elsewhere = [(t["id"], name) for t in collected for name, where in t["declared"].items() if where == "elsewhere"]
    assert not elsewhere, f"markers not declared with their tests: {elsewhere[:10]}"
    cases: dict[str, list[dict]] = {}
    for t in collected:
        cases.setdefault(t["id"].partition("[")[0], []).append(t)
    split = {name for name, ts in cases.items() if len({t["slow"] for t in ts}) == 2}
    assert split, "no parametrized test keeps some cases in the gate (the parity layouts did)"
    loose = [t["id"] for name in split for t in cases[name] if t["slow"] and t["declared"]["slow"] != "case"]
    assert not loose, f"slow cases of a split test not marked by their case: {loose[:10]}"
    unknown = {t["id"].partition("::")[0] for t in collected if t["declared"]} - {
        f"tests/{module}.py" for module in tiers.AREAS}
    assert not unknown, f"marked tests in modules without areas (tests/tiers.py AREAS): {unknown}"
    print(f"{len(split)} tests split between the tiers; slow tests: {sum(t['slow'] for t in collected)}, "
          f"floor: {sum(t['floor'] for t in collected)}")


def test_ci_runs_the_gate_then_a_slice_chosen_by_the_commit():
    text = (ROOT / ".ci" / "run").read_text()
    assert f"SLICES={CI_SLICES}" in text and "% SLICES" in text and '--tier slow --slow-slice "$slice/$SLICES"' in text


def test_a_slice_of_a_million_is_made_without_the_others():
    """`--slow-slice K/N` makes slice K alone, in memory that N does not change: the N
    slices were all made first (a list and a heap entry each), 5 GB in 17 s for
    `--slow-slice 0/100000000` (issue 76). Past the units' number the slices are empty."""
    tests = [(f"unit{u}", f"test{u}-{i}") for u in range(5) for i in range(u + 1)]  # u + 1 tests of 20 s
    n = 1_000_000
    tracemalloc.start()
    try:
        first, last = tiers.one_slice(tests, 0, n), tiers.one_slice(tests, n - 1, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes for a slice of {n}"  # made whole, the slices took about 150 MB
    assert first == [f"test4-{i}" for i in range(5)] and last == []  # the costliest unit alone
    assert [tiers.one_slice(tests, k, 8) for k in range(8)] == tiers.slices(tests, 8)
    assert [tiers.one_slice(tests, k, 2) for k in range(2)] == tiers.slices(tests, 2)


@pytest.mark.parametrize("name,why", [
    ("{dir}", "is a directory, not a file"),
    ("{dir}/missing/tiers.json", "no such directory"),
    ("{file}/tiers.json", "is not a directory"),
    ("", "takes a file name"),
    ("/proc/spmd-tiers.json", "cannot make a file in /proc"),  # a place no file can be made, even by root
])
def test_a_list_tiers_file_that_cannot_be_written_is_refused_before_collecting(tmp_path, name, why):
    (tmp_path / "file").write_text("")
    name = name.format(dir=tmp_path, file=tmp_path / "file")
    if name.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    with pytest.raises(pytest.UsageError, match=why):
        tiers.check_list_tiers(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_slow_slice_of_the_gate_is_refused():
    """The gate has no slices: `pytest --slow-slice 1/4` ran the whole gate."""
    options = {"--slow-slice": (1, 4), "--tier": "gate", "--list-tiers": None}
    config = types.SimpleNamespace(getoption=options.get, addinivalue_line=lambda *_: None)
    with pytest.raises(pytest.UsageError, match="add --tier slow"):
        tiers.configure(config)


def test_list_tiers_given_a_directory_is_one_error_line(tmp_path):
    """As pytest runs it: one line and pytest's usage error (4), not an INTERNALERROR after
    collecting (IsADirectoryError), and nothing written."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-o", "addopts=",
                           f"--list-tiers={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == pytest.ExitCode.USAGE_ERROR and lines == [
        f"ERROR: --list-tiers '{tmp_path}': is a directory, not a file"], done.stdout + done.stderr
    assert not list(tmp_path.iterdir())
