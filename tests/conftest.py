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

import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tiers  # noqa: E402

from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.data.synthetic import MarkovSource, global_batch  # noqa: E402
from spmd.parallel.balance import REBALANCE_EVERY  # noqa: E402
from spmd.parallel.layout import make_layout  # noqa: E402
from spmd.parallel.step import build_program  # noqa: E402

# Small enough to compile in a few seconds, large enough for every layout of the matrix.
PARITY = dict(model="tiny", batch=32, seq=32, steps=4, lr=3e-3, warmup=1)


# Parameters after PARITY's steps, against one device. Adam moves an element by
# lr * m / (sqrt(v) + eps): where a gradient element is a sum that cancels to about eps
# (1e-8), the few-percent rounding of that sum in another order becomes a few percent of
# lr. Measured over 4 steps: one or two such elements of 131,392 sat 1.1e-5 and 3.3e-5
# away (0.4% and 1.1% of lr, two initializations), while 99.99% of the elements agreed
# within 1.4e-7 (float32 rounding). So: every element within a tenth of lr (a wrong
# update, off by ~lr, fails it 10x over), and all but a ten-thousandth within 1e-6 (a
# wrong tensor or shard moves far more elements than that).
PARAM_ATOL = 0.1 * PARITY["lr"]
BULK_ATOL, BULK_QUANTILE = 1e-6, 0.9999


def assert_params_match(got: dict, want: dict, bulk_quantile: float = BULK_QUANTILE) -> None:
    """`bulk_quantile`: the share of the elements held to BULK_ATOL (of fewer than 10,000
    elements, BULK_QUANTILE's leaves out at most one: tests/test_lora.py's adapters)."""
    diffs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=PARAM_ATOL)
        diffs.append(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).ravel())
    bulk = np.quantile(np.concatenate(diffs), bulk_quantile)
    assert bulk <= BULK_ATOL, f"{bulk_quantile:.2%} of the parameters are within {bulk:.2e}, not {BULK_ATOL:.0e}"


@dataclasses.dataclass
class Run:
    losses: np.ndarray
    metrics: dict  # name -> one value per step
    params: dict
    hlo: str
    layout: object
    program: object
    cfg: TrainConfig
    compiled: object  # the compiled train step
    router: dict | None = None  # the MoE layers' router state at the end (spmd.parallel.balance), if kept
    frozen: dict | None = None  # a LoRA run's base weights at the end


# A compiled CPU program keeps its code in memory maps (600-900 for one of these steps, with
# its initializer), and Linux caps the maps of a process (vm.max_map_count, 65,530 by
# default): a worker that kept every run crossed it late in the suite, and XLA crashed
# there (LLVM: "Cannot allocate memory", then an abort or a segfault). So once a worker's
# maps pass half the cap, it clears JAX's caches, then lets go of its least recently used runs.
_RUNS: collections.OrderedDict = collections.OrderedDict()
MAPS = Path("/proc/self/maps")
MAP_CAP = Path("/proc/sys/vm/max_map_count")


def _cached_run(*key) -> Run:
    if key in _RUNS:
        _RUNS.move_to_end(key)
        return _RUNS[key]
    _make_room()
    _RUNS[key] = run = _run(*key)
    return run


def _make_room() -> None:
    if not (MAPS.exists() and MAP_CAP.exists()):
        return  # not Linux: no such cap
    budget = int(MAP_CAP.read_text()) // 2
    if _count_maps() <= budget:
        return
    jax.clear_caches()  # first what finished tests left compiled in jitted functions' caches
    gc.collect()
    while _RUNS and _count_maps() > budget:
        _RUNS.popitem(last=False)
        gc.collect()  # the executables go with their last reference


def _count_maps() -> int:
    with MAPS.open() as maps:
        return sum(1 for _ in maps)


def _run(mesh: str, devices: int, items: tuple) -> Run:
    cfg = validate(TrainConfig(mesh=mesh, **dict(PARITY, **dict(items))))
    layout = make_layout(cfg, jax.devices()[:devices])
    program = build_program(cfg, layout)
    shardings = jax.tree.map(lambda s: s.sharding, program.abstract_state)
    if cfg.redundant_experts:  # expert copies need ep > 1: initialized on the layout, from the same draws
        with jax.set_mesh(layout.mesh):
            state = program.init(jax.random.key(cfg.seed))
    else:
        state = jax.device_put(layout.stored(initial_state(init_config(cfg))), shardings)
    compiled = program.compile_step()
    source = MarkovSource(layout.skeleton.model_cfg.vocab, cfg.seed)
    steps = []
    for step in range(cfg.steps):
        batch = global_batch(source, step, cfg.batch, cfg.seq + 1, layout.batch_sharding)
        state, metrics = compiled(state, batch)
        steps.append(jax.device_get(metrics))
        if program.copies and (step + 1) % (cfg.rebalance_every or REBALANCE_EVERY) == 0 and step + 1 < cfg.steps:
            state = program.rebalance(state)  # as the training loop does
    metrics = {name: np.array([m[name] for m in steps]) for name in steps[0]}
    return Run(metrics["loss"], metrics, jax.device_get(state["params"]), compiled.as_text(), layout, program, cfg,
               compiled, jax.device_get(state.get("routing")), jax.device_get(state.get("frozen")))


def init_config(cfg: TrainConfig) -> TrainConfig:
    """What the initial values depend on (the model and the seed), on one device."""
    return dataclasses.replace(cfg, mesh="", zero=0, grad_accum=1, megatron_sp=False, dtype="float32", remat="none",
                               pp_schedule="gpipe", pp_repeats=1, microbatches=None)


@functools.lru_cache(maxsize=None)
def initial_state(cfg: TrainConfig) -> dict:
    """The initial train state of a one-device run, on the host."""
    program = build_program(cfg, make_layout(cfg, jax.devices()[:1]))
    with jax.set_mesh(program.layout.mesh):
        return jax.device_get(program.init(jax.random.key(cfg.seed)))


def train_run(mesh: str, devices: int, *, cached: bool = True, **overrides) -> Run:
    """Train PARITY's config for its steps on the first `devices` devices (cached, unless a
    run no other test shares: a cached run holds its compiled step until `_make_room`)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | PARITY
    changed = {k: v for k, v in overrides.items() if defaults.get(k) != v}  # one cache entry per config
    return (_cached_run if cached else _run)(mesh, devices, tuple(sorted(changed.items())))


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
