"""The tiers (tests/tiers.py) hold what they say: CI's slices of the slow tier cover it
whole and rotate one a CI run (.ci/slices.py, on small git repositories), every test's tier
is declared where the test is defined (a marker pytest knows), and the tier options refuse in
one line what they cannot do. Collection only."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
import types
from pathlib import Path

import pytest
import tiers

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("ci_slices", ROOT / ".ci" / "slices.py")
ci_slices = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_slices)
# .ci/run: the slice of the slow tier that .ci/slow-slices' last line names, one more each
# submission, so each slow test runs within any 3 consecutive CI runs.
CI_SLICES = ci_slices.SLICES
# The costliest slice's test time by tiers.UNIT_SECONDS (a third of the tier's 2,930 s: 973),
# shared by two workers: slice 0 took 11.4 minutes of wall time. With the gate (19.7), the
# newest install (1.2) and the floor pass (3.4), .ci/run took 35.7 minutes here on 2026-12-08:
# past its 30 (docs/contributing.md); no more than that.
SLICE_BUDGET_S = 1000


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


# CI's slice of the slow tier, in turn (.ci/slices.py): on small git repositories.

class Repo:
    """A git repository with .ci/slices.py (and .ci/run), commits made with a ledger or without."""

    def __init__(self, path: Path):
        self.path = path
        (path / ".ci").mkdir(parents=True)
        for name in ("slices.py", "run"):
            shutil.copy2(ROOT / ".ci" / name, path / ".ci" / name)
        self.git("init", "-q")
        self.commit(None, "the code")

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.path), *args], check=True, capture_output=True,
                              text=True).stdout

    def commit(self, ledger: list | None, message: str = "a change") -> None:
        """A commit of a change, and of `ledger` (one line each) unless None; [] removes it."""
        work = self.path / "work"
        work.write_text(work.read_text() + "x" if work.exists() else "x")
        path = self.path / ci_slices.LEDGER
        if ledger == [] and path.exists():
            path.unlink()
        elif ledger:
            path.write_text("".join(f"{x}\n" for x in ledger))
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)

    def ledger(self) -> list[int]:
        return ci_slices.parse((self.path / ci_slices.LEDGER).read_text(), "here")


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Repo:
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "spmd tests")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "tests@spmd.invalid")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return Repo(tmp_path / "repo")


def test_each_ci_run_takes_the_next_slice_however_many_commits_its_submission_has(repo):
    """Submissions of 3, 0, 1 and 5 commits, each ending with `--advance`'s commit: their CI
    runs take slices 0, 1, 2, 0 after the first line (2), which starts the rotation."""
    repo.commit([2], "the ledger")
    taken = []
    for commits in (3, 0, 1, 5):
        for _ in range(commits):
            repo.commit(None)
        assert ci_slices.advance(repo.path, again=commits == 0) == len(taken) % CI_SLICES
        taken.append(ci_slices.check(repo.path))
        assert repo.git("status", "--porcelain") == ""
        assert repo.git("show", "--name-only", "--format=", "HEAD").split() == [ci_slices.LEDGER]  # alone
    assert taken == [0, 1, 2, 0] and repo.ledger() == [2, 0, 1, 2, 0]


@pytest.mark.parametrize("history,why", [
    ([[2], [2, 0], None], "does not append the slow tier's next slice"),  # a commit after the ledger's
    ([[2], [2, 2]], "repeats slice 2"),
    ([[2], [2, 1]], "skips to slice 1"),
    ([[2], [2, 0, 1]], "other than by appending one line"),  # two slices at once
    ([[2], [2, 0], [1, 0, 1]], "other than by appending one line"),  # an earlier line changed
    ([[2], [2, 0], [2, 1], None, [2, 1, 2]], "changes .ci/slow-slices other than by appending"),  # since the last
    ([[2], [2, 0], [], [2, 0], [2, 0, 1]], "changes .ci/slow-slices other than by appending"),  # removed, restored
    ([[2], [2, 0], [0]], "other than by appending one line"),
    ([[2], [2, 3]], "line 2: '3' is not a slice"),
    ([[2], [2, "1 "]], "line 2: '1 ' is not a slice"),
    ([None], "HEAD has no .ci/slow-slices"),
    ([[2]], "HEAD's commit makes .ci/slow-slices"),
])
def test_a_head_that_does_not_append_the_next_slice_is_refused(repo, history, why):
    for ledger in history:
        repo.commit(ledger)
    with pytest.raises(ci_slices.Refused, match=why.replace("(", r"\(")):
        ci_slices.check(repo.path)


def test_the_first_line_starts_the_rotation_and_no_other_line_does(repo):
    repo.commit([1], "the ledger")
    repo.commit(None)
    repo.commit([1, 2], "the first submission's")
    assert ci_slices.check(repo.path) == 2
    repo.commit([0], "the ledger made again, shorter")  # a restart is no append
    repo.commit([0, 1])
    with pytest.raises(ci_slices.Refused, match="other than by appending one line"):
        ci_slices.check(repo.path)


def test_advance_refuses_a_ledger_not_committed_or_appended_twice(repo):
    repo.commit([2], "the ledger")
    (repo.path / ci_slices.LEDGER).write_text("2\n0\n")
    with pytest.raises(ci_slices.Refused, match="changes not committed"):
        ci_slices.advance(repo.path)
    repo.git("checkout", "--", ci_slices.LEDGER)
    assert ci_slices.advance(repo.path) == 0
    with pytest.raises(ci_slices.Refused, match="HEAD already appends slice 0.*add --again"):
        ci_slices.advance(repo.path)
    assert repo.ledger() == [2, 0] and ci_slices.check(repo.path) == 0
    repo.commit([2, 1], "an edit")
    with pytest.raises(ci_slices.Refused, match="changes .ci/slow-slices other than by appending"):
        ci_slices.advance(repo.path)
    assert repo.ledger() == [2, 1]


def test_the_slice_or_one_error_line_from_the_command(repo):
    """As .ci/run runs it: the slice as K/N on stdout, or one `error:` line and exit 1."""
    repo.commit([2], "the ledger")
    run = lambda *args: subprocess.run([sys.executable, ".ci/slices.py", *args], cwd=repo.path,  # noqa: E731
                                       capture_output=True, text=True, timeout=60)
    refused = run()
    assert (refused.returncode, refused.stdout) == (1, "") and len(refused.stderr.splitlines()) == 1, refused
    assert refused.stderr.startswith("error: HEAD's commit makes"), refused.stderr
    assert run("--advance").returncode == 0
    taken = run()
    assert (taken.returncode, taken.stdout, taken.stderr) == (0, f"0/{CI_SLICES}\n", "")


def test_this_repository_s_ledger_rotates():
    """Each line of .ci/slow-slices is the slice after the line before it (the first starts)."""
    lines = ci_slices.parse((ROOT / ci_slices.LEDGER).read_text(), ci_slices.LEDGER)
    assert lines and all(b == (a + 1) % CI_SLICES for a, b in zip(lines, lines[1:])), lines


def _stub_ci(repo: Repo, tmp_path: Path) -> tuple[dict, Path]:
    """.ci/run's environment with virtualenvs whose pip, lint-imports and pytest only write
    their arguments to a log, and whose gate fails."""
    bin_dir, log = tmp_path / "bin", tmp_path / "ci.log"
    bin_dir.mkdir()
    activate = f"""
pip() {{ echo "pip $*" >> {log}; }}
lint-imports() {{ echo lint-imports >> {log}; }}
python() {{ echo "python ${{*: -1}}" >> {log}; }}
pytest() {{ echo "pytest $*" >> {log}; [ "$*" != --durations=30 ]; }}
"""
    stub = f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cat > "$3/bin/activate" <<'ACTIVATE'
{activate}
ACTIVATE
else exec {sys.executable} "$@"; fi
"""
    for name in ("python3.12", "python3.11"):
        (bin_dir / name).write_text(stub)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def test_ci_takes_the_ledger_s_slice_even_when_the_gate_fails(repo, tmp_path):
    """.ci/run checks the ledger first (nothing else runs when it refuses), then runs the gate,
    the ledger's slice of the slow tier even when the gate failed, the floor, and fails at the end."""
    env, log = _stub_ci(repo, tmp_path)
    repo.commit([1], "the ledger")
    refused = subprocess.run(["bash", ".ci/run"], cwd=repo.path, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stdout == "" and not log.exists(), refused
    assert refused.stderr.splitlines() == [refused.stderr.strip()] and refused.stderr.startswith("error: HEAD's")
    ci_slices.advance(repo.path)
    done = subprocess.run(["bash", ".ci/run"], cwd=repo.path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done
    assert f"slice 2/{CI_SLICES} of the slow tier" in done.stdout and "ci: failed: the gate" in done.stdout, done.stdout
    ran = log.read_text().splitlines()
    # The floor's install runs beside the newest pass's tests, from after the layers' check
    # to before the floor pass: its line falls anywhere between.
    floor_install = next(i for i, line in enumerate(ran) if "-c .ci/floor.txt" in line)
    assert 2 < floor_install < len(ran) - 2 and ran[floor_install].startswith("pip install"), ran
    ran = ran[:floor_install] + ran[floor_install + 1:]
    assert [line.partition(" ")[0] for line in ran] == [
        "pip", "python", "lint-imports", "pytest", "pytest", "python", "pytest"], ran
    assert ran[3] == "pytest --durations=30" and f"--tier slow --slow-slice 2/{CI_SLICES} " in ran[4], ran
