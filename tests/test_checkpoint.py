"""Checkpoints: exact resume, resume on other meshes, export, non-finite losses."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import spmd.parallel.step
from spmd.config import TrainConfig, validate
from spmd.formats.checkpoint import Checkpoints
from spmd.layout import make_layout
from spmd.parallel.optim import schedule
from spmd.parallel.skeleton import model_skeleton
from spmd.train import prepare, train

BASE = dict(mesh="dp=2,fsdp=2,tp=2", batch=16, seq=32, steps=8, lr=3e-3, warmup=2, log_every=4)


def _train(devices=8, **overrides):
    cfg = validate(TrainConfig.of(**dict(BASE, **overrides)))
    return train(cfg, make_layout(cfg, jax.devices()[:devices]), log=lambda _: None)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps on dp=2,fsdp=2,tp=2, saving after steps 4 and 8."""
    out = tmp_path_factory.mktemp("run")
    records, state = _train(out=str(out), save_every=4)
    return out, [r["loss"] for r in records], jax.device_get(state["params"])


@pytest.mark.floor  # Orbax's checkpoints can differ between versions
def test_resume_on_the_same_mesh_is_bit_identical(uninterrupted):
    out, losses, params = uninterrupted
    assert Checkpoints(out).steps() == [4, 8]
    records, state = _train(resume=str(out / "4"))
    assert [r["step"] for r in records] == [4, 5, 6, 7]
    assert [r["loss"] for r in records] == losses[4:]
    for got, want in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mesh,devices,zero", [  # the gate keeps one, also on the floor (Orbax's versions)
    pytest.param("fsdp=8", 8, 0, marks=pytest.mark.slow),
    pytest.param("tp=4,dp=2", 8, 0, marks=pytest.mark.slow),
    pytest.param("dp=8", 8, 1, marks=pytest.mark.slow),
    pytest.param("fsdp=2,tp=2", 4, 0, marks=pytest.mark.floor),  # another device count
    pytest.param("ep=2,sp=2,tp=2", 8, 0, marks=pytest.mark.slow),
])
def test_resume_on_another_mesh_continues_the_run(uninterrupted, mesh, devices, zero):
    out, losses, _ = uninterrupted
    records, state = _train(devices, mesh=mesh, zero=zero, resume=str(out / "4"))
    # Restored straight into the new layout: e.g. wq's embed dimension split as the new mesh says.
    assert state["params"]["blocks"]["attn"]["wq"].sharding.mesh.devices.size == devices
    # The same data order, the same state: only float32 sums in another order differ (as in
    # the parity matrix, where 1e-5 relative is the spec).
    np.testing.assert_allclose([r["loss"] for r in records], losses[4:], rtol=1e-5, atol=0)


def test_export_writes_parameters_readable_without_the_optimizer(uninterrupted, tmp_path):
    out, _, params = uninterrupted
    exported = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "spmd.export", "--checkpoint", str(out), "--out", str(exported),
                           "--mesh", "tp=2,fsdp=4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in exported.iterdir()) == ["model.json", "params"]
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), model_skeleton("tiny").shapes)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(exported / "params", target)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.fixture
def poisoned_loss(monkeypatch):
    """Make the loss non-finite on the batches of steps 2 and 3 (whose data are fixed)."""
    real = spmd.parallel.step.model_loss
    from spmd.data.synthetic import MarkovSource

    source = MarkovSource(256, seed=0)
    marks = [int(source.rows(step, 0, 1, 33)[0, 0]) * 1000 + int(source.rows(step, 0, 1, 33)[0, 1])
             for step in (2, 3)]

    def loss(graphdef, params, rows, *args):
        value, metrics = real(graphdef, params, rows, *args)
        key = rows[0, 0] * 1000 + rows[0, 1]
        hit = jnp.any(jnp.asarray(marks) == key)
        poison = lambda x: jnp.where(hit, jnp.nan, x)  # noqa: E731
        return poison(value), metrics | {"loss": poison(metrics["loss"])}

    monkeypatch.setattr(spmd.parallel.step, "model_loss", loss)


def test_on_nan_skip_drops_the_update_and_goes_on(poisoned_loss):
    records, state = _train(mesh="", devices=1, on_nan="skip", grad_accum=1)
    assert [r["skipped"] for r in records] == [False, False, True, True, False, False, False, False]
    # The logged rate is the one applied: the schedule stays where the dropped updates left it.
    lr_at = schedule(validate(TrainConfig.of(**BASE)))
    assert [r["lr"] for r in records] == [float(lr_at(n)) for n in (0, 1, 2, 2, 2, 3, 4, 5)]
    assert all(np.isnan(r["loss"]) for r in records[2:4])
    assert all(np.isfinite(r["loss"]) for r in records[4:])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state["params"])))


def test_on_nan_stop_names_the_last_good_checkpoint(poisoned_loss, tmp_path, capsys):
    cfg = validate(TrainConfig.of(**dict(BASE, mesh="", on_nan="stop", out=str(tmp_path), save_every=1, log_every=1)))
    result = prepare(cfg, make_layout(cfg, jax.devices()[:1]), log=lambda _: None).loop()
    assert not result.ok
    assert len(result.records) == 3  # steps 0, 1 and the bad step 2
    err = capsys.readouterr().err
    assert "non-finite loss at step 2" in err
    assert f"last good checkpoint: {tmp_path / '2'}" in err
    assert Checkpoints(tmp_path).steps() == [1, 2]  # nothing saved once the bad loss was seen
