"""The runs the parity tests share: PARITY's config trained on a layout of the emulated
devices, cached per layout for the whole session (compiling for emulated meshes dominates
the suite's time), from the one-device initial state placed on the layout (compiling the
initializer costs more than the step; that the sharded initializer gives the same values
is tested once per kind of model, tests/test_sharding.py), and how their parameters are
held to one device's. JAX is set up for the tests by tests/conftest.py, which pytest loads
first.
"""

import collections
import dataclasses
import functools
import gc
from pathlib import Path

import jax
import numpy as np

from spmd.config import TrainConfig, validate
from spmd.data.feed import global_batch
from spmd.data.synthetic import MarkovSource
from spmd.parallel.balance import REBALANCE_EVERY
from spmd.layout import make_layout
from spmd.parallel.step import build_program

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
    cfg = validate(TrainConfig.of(mesh=mesh, **dict(PARITY, **dict(items))))
    layout = make_layout(cfg, jax.devices()[:devices])
    program = build_program(cfg.step, layout)
    shardings = jax.tree.map(lambda s: s.sharding, program.abstract_state)
    if cfg.moe.redundant_experts:  # expert copies need ep > 1: initialized on the layout, from the same draws
        with jax.set_mesh(layout.mesh):
            state = program.init(jax.random.key(cfg.training.seed))
    else:
        state = jax.device_put(layout.stored(initial_state(init_config(cfg))), shardings)
    compiled = program.compile_step()
    source = MarkovSource(layout.skeleton.model_cfg.vocab, cfg.training.seed)
    steps = []
    for step in range(cfg.training.steps):
        batch = global_batch(source, step, cfg.training.batch, cfg.training.seq + 1, layout.batch_sharding)
        state, metrics = compiled(state, batch)
        steps.append(jax.device_get(metrics))
        if (program.copies and (step + 1) % (cfg.moe.rebalance_every or REBALANCE_EVERY) == 0
                and step + 1 < cfg.training.steps):
            state = program.rebalance(state)  # as the training loop does
    metrics = {name: np.array([m[name] for m in steps]) for name in steps[0]}
    return Run(metrics["loss"], metrics, jax.device_get(state["params"]), compiled.as_text(), layout, program, cfg,
               compiled, jax.device_get(state.get("routing")), jax.device_get(state.get("frozen")))


def init_config(cfg: TrainConfig) -> TrainConfig:
    """What the initial values depend on (the model and the seed), on one device."""
    return cfg.replace(mesh="", zero=0, grad_accum=1, megatron_sp=False, dtype="float32", remat="none",
                               pp_schedule="gpipe", pp_repeats=1, microbatches=None)


@functools.lru_cache(maxsize=None)
def initial_state(cfg: TrainConfig) -> dict:
    """The initial train state of a one-device run, on the host."""
    program = build_program(cfg.step, make_layout(cfg, jax.devices()[:1]))
    with jax.set_mesh(program.layout.mesh):
        return jax.device_get(program.init(jax.random.key(cfg.training.seed)))


def train_run(mesh: str, devices: int, *, cached: bool = True, **overrides) -> Run:
    """Train PARITY's config for its steps on the first `devices` devices (cached, unless a
    run no other test shares: a cached run holds its compiled step until `_make_room`)."""
    defaults = TrainConfig().record() | PARITY
    changed = {k: v for k, v in overrides.items() if defaults.get(k) != v}  # one cache entry per config
    return (_cached_run if cached else _run)(mesh, devices, tuple(sorted(changed.items())))
