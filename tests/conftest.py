"""Tests run on the CPU with 8 emulated devices, set before JAX starts its backend.

Compiling for emulated meshes dominates the suite's time, so runs are cached per layout
for the whole session and shared between the tests that look at them.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import dataclasses  # noqa: E402
import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.data import MarkovSource, global_batch  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.step import build_program  # noqa: E402

# Small enough to compile in a few seconds, large enough for every layout of the matrix.
PARITY = dict(model="tiny", batch=32, seq=32, steps=4, lr=3e-3, warmup=1)


@dataclasses.dataclass
class Run:
    losses: np.ndarray
    params: dict
    hlo: str
    layout: object
    program: object
    cfg: TrainConfig
    compiled: object  # the compiled train step


@functools.lru_cache(maxsize=None)
def _run(mesh: str, devices: int, items: tuple) -> Run:
    cfg = validate(TrainConfig(mesh=mesh, **dict(PARITY, **dict(items))))
    layout = make_layout(cfg, jax.devices()[:devices])
    program = build_program(cfg, layout)
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(cfg.seed))
    compiled = program.compile_step()
    source = MarkovSource(layout.skeleton.model_cfg.vocab, cfg.seed)
    losses = []
    for step in range(cfg.steps):
        batch = global_batch(source, step, cfg.batch, cfg.seq + 1, layout.batch_sharding)
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return Run(np.array(losses), jax.device_get(state["params"]), compiled.as_text(), layout, program, cfg, compiled)


def train_run(mesh: str, devices: int, **overrides) -> Run:
    """Train PARITY's config for its steps on the first `devices` devices (cached)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | PARITY
    changed = {k: v for k, v in overrides.items() if defaults.get(k) != v}  # one cache entry per config
    return _run(mesh, devices, tuple(sorted(changed.items())))


@pytest.fixture(scope="session")
def reference() -> Run:
    return train_run("", 1)
