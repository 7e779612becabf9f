"""Tests run on the CPU with 8 emulated devices, set before JAX starts its backend.

Compiling for emulated meshes dominates the suite's time, so runs are cached per layout
for the whole session and shared between the tests that look at them. Runs start from
the one-device initial state, placed on their layout: compiling the initializer costs
more than the step (its random draws), and that the sharded initializer gives the same
values is tested once per kind of model (test_sharding).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import shutil  # noqa: E402
import tempfile  # noqa: E402

# Tests build many programs that XLA has compiled before in this session (another test's
# identical step, the same one-device initializer on each worker): one persistent
# compilation cache, shared by the workers of a run and their subprocesses, loads them.
# The process that starts the run makes it (the workers inherit its environment) and
# removes it at the end (pytest_unconfigure).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd-tests-jax-cache-")
# Shared by processes that run at once, the cache must lock: without a size limit JAX's file
# cache neither locks nor writes atomically, so one process could read an entry another is
# still writing and deserialize a truncated program. A limit switches on its file lock
# around every read and write; this one (64 GiB) is never reached.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 << 30))
# Every program, not only those that took a second to compile: the CLI's subprocesses each
# compile dozens of small ones (initializers, reshards, the checkpoint's), the same each time.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# The tests compile unoptimized CPU code, in this process and in the CLI's subprocesses:
# most of XLA:CPU's compile time is LLVM optimizing the code, while what the tests check
# (numbers against one device, the partitioned HLO's collectives, buffer sizes) is decided
# before LLVM runs. The 300-step default run (test_default_run) keeps the optimizer.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402
import tiers  # noqa: E402
from support.parity import Run, train_run  # noqa: E402


@pytest.fixture(scope="session")
def reference() -> Run:
    return train_run("", 1)


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # the run's own process, not an xdist worker
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    tiers.add_options(parser)


def pytest_configure(config):
    tiers.configure(config)


@pytest.hookimpl(tryfirst=True)  # before `-m` reads the markers it adds
def pytest_collection_modifyitems(config, items):
    """The tier asked for (tests/tiers.py), the README's commands first: the longest test
    (minutes of one-command processes) starts at once beside the rest, instead of running
    alone at the end."""
    tiers.select(config, items)
    items.sort(key=lambda item: item.module.__name__ != "test_readme")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """A group's tests share fixtures and must not run at once on two workers (two SLURM
    clusters, two copies of a driver): refuse a pytest and pytest-xdist that drop the
    groups (xdist marks a grouped test's id with @GROUP)."""
    # xdist's workers set option.loadgroup (-n 0 runs have no workers and no such option).
    if getattr(session.config.option, "loadgroup", False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"--dist loadgroup ignores the xdist_group of {lost[0]} and others with this "
                                    "pytest and pytest-xdist; install the versions pyproject.toml's test extra names")
