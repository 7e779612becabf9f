"""The suite's tiers and areas (docs/contributing.md).

- The *gate* is what `pytest` runs (the README's test command): every area's strongest
  tests, within 20 minutes on a 2-core machine.
- The *slow* tier is everything else: more layouts of what the gate already holds once,
  plans of many devices, end-to-end runs of many processes. `--tier slow` runs it,
  `--tier all` runs both, `--slow-slice K/N` keeps the K-th of N slices of the slow tier
  (CI runs one slice of 3 a run, in turn: .ci/slices.py).
- Every test also carries the marker of its *area* (`-m pipelines`, `-m "hf or lora"`), and
  the tests that CI repeats on the oldest supported JAX carry `floor`.

A test's tier is declared where the test is defined: `@pytest.mark.slow` on a slow test,
`pytestmark` for a slow module, `pytest.param(..., marks=pytest.mark.slow)` for the slow cases
of a parametrized test whose other cases stay in the gate (`support.cases.tiered` for a list
built elsewhere), and `floor` likewise. This module keeps the options, the areas, the markers'
registration, the selection by marker and the balancing of the slow tier's slices.
"""

import argparse
import heapq
import json
import os
import tempfile
from pathlib import Path

import pytest

# Each module's areas: `pytest -m AREA` runs the tests of what you change.
AREAS = {
    "test_attention_kernels": ("kernels", "parity"),
    "test_bad_input": ("cli",),
    "test_bad_files": ("cli", "data"),
    "test_balance": ("moe", "parity"),
    "test_checkpoint": ("checkpoint", "parity"),
    "test_checkpoint_integrity": ("checkpoint",),
    "test_cli_errors": ("cli",),
    "test_cluster_files": ("cluster",),
    "test_combinations": ("plan", "parity"),
    "test_composition": ("pipelines", "moe", "parity"),
    "test_config": ("cli",),
    "test_corpus": ("data",),
    "test_data": ("data",),
    "test_deepseek": ("hf", "moe", "pipelines", "parity"),
    "test_default_run": ("cli",),
    "test_docs": ("docs",),
    "test_faults": ("checkpoint", "cli"),
    "test_finetune": ("data", "hf"),
    "test_fit": ("plan",),
    "test_fp8": ("model", "parity"),
    "test_generate": ("generate", "hf"),
    "test_hardening_data": ("data", "cli"),
    "test_hardening_defaults": ("cli", "generate"),
    "test_hardening_inputs": ("cli",),
    "test_hf": ("hf",),
    "test_hf_files": ("hf",),
    "test_hlo": ("plan", "parity"),
    "test_layers": ("docs",),
    "test_lora": ("lora", "parity"),
    "test_model": ("model",),
    "test_moe": ("moe", "parity"),
    "test_mtp": ("model", "moe", "pipelines", "parity"),
    "test_multihost": ("cluster", "checkpoint"),
    "test_network": ("cluster",),
    "test_notebooks": ("docs",),
    "test_objective": ("model", "hf"),
    "test_observe": ("cli",),
    "test_outputs": ("cli",),
    "test_packing": ("data", "parity"),
    "test_parity": ("parity",),
    "test_pipeline": ("pipelines", "parity"),
    "test_plan": ("plan",),
    "test_preemption": ("checkpoint",),
    "test_presets": ("plan",),
    "test_readme": ("docs", "cli"),
    "test_records": ("data",),
    "test_sequence_parallel": ("parity",),
    "test_sharding": ("parity",),
    "test_slurm": ("cluster",),
    "test_targets": ("plan",),
    "test_tiers": ("docs",),
    "test_tools_hardening": ("cli",),
    "test_xla_flags": ("cli",),
}
MARKERS = {
    "slow": "the slow tier: not in the gate (`--tier slow` or `--tier all` runs it)",
    "floor": "repeated by CI on the oldest supported JAX (.ci/floor.txt)",
    **{area: f"area: {area}" for area in sorted({a for areas in AREAS.values() for a in areas})},
}

TIERS = ("gate", "slow", "all")


def add_options(parser) -> None:
    group = parser.getgroup("spmd tiers")
    group.addoption("--tier", choices=TIERS, default="gate",
                    help="gate (default: the README's test command), slow, or all of the suite")
    group.addoption("--slow-slice", metavar="K/N", default=None, type=_slice,
                    help="of the slow tier (--tier slow or all), keep only slice K of N (0 <= K < N)")
    group.addoption("--list-tiers", metavar="FILE", default=None,
                    help="write every collected test's id, unit, tiers and where they are declared to FILE as JSON "
                         "(tests/test_tiers.py)")


def configure(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    # Refused here, before collecting (a minute) and before pytest-xdist starts its workers.
    if config.getoption("--slow-slice") and config.getoption("--tier") == "gate":
        raise pytest.UsageError("--slow-slice takes a slice of the slow tier: add --tier slow (or --tier all)")
    if config.getoption("--list-tiers") is not None:
        check_list_tiers(config.getoption("--list-tiers"))


def check_list_tiers(name: str) -> None:
    """`--list-tiers FILE`: one line saying why FILE cannot be written, and nothing written."""
    path = Path(name)
    if not name:
        why = "takes a file name"
    elif path.is_dir():
        why = "is a directory, not a file"
    elif not path.parent.is_dir():
        why = f"{path.parent} is not a directory" if path.parent.exists() else f"no such directory: {path.parent}"
    elif path.exists():
        if os.access(path, os.W_OK):
            return
        why = "permission denied (or a read-only file system)"
    else:
        try:  # a file made there and removed at once, as the one written after collecting would be made
            tempfile.TemporaryFile(dir=path.parent).close()
            return
        except OSError as e:
            why = f"cannot make a file in {path.parent}: {e.strerror}"
    raise pytest.UsageError(f"--list-tiers {name!r}: {why}")


def select(config, items: list) -> None:
    """Mark every test with its areas, then keep those of the tier asked for (its markers)."""
    for item in items:
        module = item.module.__name__
        if module not in AREAS:
            raise pytest.UsageError(f"{module} has no area: add it to AREAS in tests/tiers.py")
        for name in AREAS[module]:
            item.add_marker(name)
    if config.getoption("--list-tiers") is not None:
        listed = [{"id": item.nodeid, "unit": unit(item), "slow": is_slow(item),
                   "floor": item.get_closest_marker("floor") is not None,
                   "declared": {name: declared(item, name) for name in ("slow", "floor")
                                if item.get_closest_marker(name)}} for item in items]
        try:  # (checked at configure; what can still fail here, a full disk, is said the same way)
            Path(config.getoption("--list-tiers")).write_text(json.dumps(listed))
        except OSError as e:
            raise pytest.UsageError(f"--list-tiers {config.getoption('--list-tiers')!r}: {e.strerror}") from None
    tier, cut = config.getoption("--tier"), config.getoption("--slow-slice")
    keep = {"gate": lambda i: not is_slow(i), "slow": is_slow, "all": lambda i: True}[tier]
    chosen = set(one_slice([(unit(i), i) for i in items if is_slow(i)], *cut)) if cut else None
    kept, dropped = [], []
    for item in items:
        wanted = keep(item) and (chosen is None or not is_slow(item) or item in chosen)
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def declared(item, name: str) -> str:
    """Where the test's `name` marker is declared: on its case (`pytest.param`), its function,
    its class or its module (`pytestmark`); "elsewhere" when none holds it (a hook added it)."""
    def holds(marks) -> bool:
        return any(m.name == name for m in (marks if isinstance(marks, list) else [marks]))
    callspec = getattr(item, "callspec", None)
    for where, marks in (("case", callspec.marks if callspec else []),
                         ("function", getattr(item.function, "pytestmark", [])),
                         ("class", getattr(item.cls, "pytestmark", []) if item.cls else []),
                         ("module", getattr(item.module, "pytestmark", []))):
        if holds(marks):
            return where
    return "elsewhere"


def is_slow(item) -> bool:
    return item.get_closest_marker("slow") is not None


def unit(item) -> str:
    """What a slice keeps together: the tests of one xdist group (they share fixtures that
    are paid once per run; each test of a group in SPLIT_GROUPS alone), else of one module."""
    group = item.get_closest_marker("xdist_group")
    if group and group.args[0] in SPLIT_GROUPS:
        return f"group:{group.args[0]}:{item.nodeid}"
    return f"group:{group.args[0]}" if group else item.module.__name__


def slices(tests: list[tuple[str, object]], n: int) -> list[list]:
    """The slow tests in n slices of about equal cost: each unit whole, the costliest first,
    into the slice that costs least so far (ties by index). Deterministic: a function of the
    units alone."""
    by_unit: dict[str, list] = {}
    for name, test in tests:
        by_unit.setdefault(name, []).append(test)
    heap = [(0.0, k) for k in range(n)]
    out: list[list] = [[] for _ in range(n)]
    for name in sorted(by_unit, key=lambda u: (-unit_cost(u, len(by_unit[u])), u)):
        cost, k = heapq.heappop(heap)
        out[k] += by_unit[name]
        heapq.heappush(heap, (cost + unit_cost(name, len(by_unit[name])), k))
    return out


def one_slice(tests: list[tuple[str, object]], k: int, n: int) -> list:
    """Slice k of `slices(tests, n)`, in memory and time that do not grow with n
    (`--slow-slice 0/100000000`): while a unit is left to place, one of the first U slices
    (U units) is still empty, and a tie of costs goes to the lower index, so no unit goes
    past them; the first U are those of `slices(tests, U)`, the rest empty. For every n,
    the same tests as `slices`."""
    parts = slices(tests, min(n, len({name for name, _ in tests})))
    return parts[k] if k < len(parts) else []


# Seconds of test time each unit of the slow tier takes on this machine (2 cores, two workers
# sharing them), to balance the slices; a unit not listed is guessed at 20 s a test. Rough is
# enough. The shares are the slow tier's durations alone on 2026-12-07 (`--durations=0`), taken
# while another run loaded the machine (4,761 s of wall time, 9,406 s of test time), scaled to
# the 2,930 s of the unloaded 2026-12-06 run; against those, the slices of 4 had been 28%, 28%,
# 18% and 26% of the tier.
UNIT_SECONDS = {
    "group:pipeline": 405, "group:layouts": 355, "group:mtp": 220, "test_mtp": 180, "test_deepseek": 170,
    "group:generate": 135, "group:multihost": 130, "group:balance-stages": 125, "group:composition": 125,
    "group:hf": 115, "group:moe": 115, "group:presets": 115, "group:deepseek": 95, "test_packing": 80,
    "group:balance": 75, "test_checkpoint": 55, "test_notebooks": 45, "test_faults": 20, "test_model": 20,
    "test_hlo": 15, "test_preemption": 15, "test_targets": 15, "test_finetune": 10, "test_objective": 10,
    "test_observe": 5, "test_fp8": 66,  # (measured alone, a cold cache, 2026-12-08)
}
# Groups whose tests share nothing costly (the README's commands share one driver's imports,
# seconds): a slice takes their tests one by one, at these seconds a test (262 s for 33
# commands), so that the group's minutes spread over the slices.
SPLIT_GROUPS = {"readme": 8}


def unit_cost(name: str, tests: int) -> float:
    kind, _, rest = name.partition(":")
    group, _, test = rest.partition(":")
    if kind == "group" and test and group in SPLIT_GROUPS:
        return SPLIT_GROUPS[group] * tests
    return UNIT_SECONDS.get(name, 20.0 * tests)


def _slice(text: str) -> tuple[int, int]:
    shown = repr(text if len(text) <= 40 else text[:40] + "...")  # (a number of 5,000 digits is not echoed whole)
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:  # (also a number past Python's 4,300 digits)
        raise argparse.ArgumentTypeError(f"takes K/N, two whole numbers, not {shown}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{shown}: K must be 0 to N-1")
    return k, n
