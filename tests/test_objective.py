"""What a step minimizes and how its optimizer moves, held to transformers' conventions: an
imported MoE model's balance loss as transformers defines it (golden values made by
tests/hf/make_goldens.py), the warmup kept as given, Adam's epsilon a flag; and an imported
MoE model trained with a selection bias is served as trained."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.parity import train_run
from test_parity import LOSS_RTOL

from spmd.base.errors import UserError
from spmd.config import TrainConfig, validate
from spmd.layout import make_layout
from spmd.parallel.optim import make_optimizer, schedule
from spmd.parallel.objective import AuxLosses, aux_losses, model_loss

MIXTRAL = Path(__file__).parent / "hf" / "mixtral"


def test_an_imported_moe_model_trains_with_its_own_balance_loss():
    """Mixtral's config.json brings transformers' pooled balance loss at its router_aux_loss_coef
    and no z-loss; flags override each. On the golden's tokens the cross-entropy and the
    balance loss equal transformers' (float32 sums in another order: 1e-5 relative)."""
    golden = json.loads((MIXTRAL / "router_losses.json").read_text())
    cfg = validate(TrainConfig.of(init_from=str(MIXTRAL), mesh=""))
    assert aux_losses(cfg.step) == AuxLosses("pooled", golden["router_aux_loss_coef"], 0.0)
    given = validate(cfg.replace(balance_loss="sequence", aux_loss_weight=0.01, z_loss_weight=0.001))
    assert aux_losses(given.step) == AuxLosses("sequence", 0.01, 0.001)
    preset = validate(TrainConfig.of(model="moe-tiny"))
    assert aux_losses(preset.step) == AuxLosses("sequence", 0.01, 0.001)

    from spmd.formats.hf import Directory, load_params

    layout = make_layout(cfg, jax.devices()[:1], for_training=False)
    params = load_params(Directory(str(MIXTRAL)), layout)
    rows = jnp.asarray(np.load(MIXTRAL / "tokens.npy"))
    objective, metrics = jax.jit(
        lambda p, r: model_loss(layout.skeleton.graphdef, p, r, None, aux_losses(cfg.step)))(params, rows)
    np.testing.assert_allclose(float(metrics["loss"]), golden["cross_entropy"], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["aux_loss"]), golden["aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(float(objective), golden["cross_entropy"] + golden["router_aux_loss_coef"]
                               * golden["aux_loss"], rtol=1e-5)


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_the_pooled_balance_loss_is_the_same_on_any_layout():
    """Pooled over the global batch and every layer, in GPipe stages (whose layers'
    statistics come back to the loss outside the stages) with experts over ep: one
    device's numbers."""
    pooled = dict(model="moe-tiny", layers=4, balance_loss="pooled", aux_loss_weight=0.1)
    one, run = train_run("", 1, cached=False, **pooled), train_run("pp=2,ep=2", 4, cached=False, **pooled)
    for name in ("loss", "aux_loss"):
        np.testing.assert_allclose(run.metrics[name], one.metrics[name], rtol=LOSS_RTOL)
    # top-k (2) when balanced, where the per-sequence form is 1: the pooled form was trained.
    assert np.all(one.metrics["aux_loss"] > 1.9)


def test_the_pooled_balance_loss_is_refused_where_a_stage_cannot_form_it():
    with pytest.raises(UserError, match="--pp-schedule 1f1b takes the per-sequence balance loss only"):
        validate(TrainConfig.of(model="moe-tiny", mesh="pp=2", pp_schedule="1f1b", balance_loss="pooled"))
    with pytest.raises(UserError, match="--aux-loss-weight applies to MoE models"):
        validate(TrainConfig.of(model="tiny", aux_loss_weight=0.1))


@pytest.mark.parametrize("steps, warmup", [(10, 20), (10, 10), (30, 10)])
@pytest.mark.floor  # what can differ between JAX versions: the schedule's numbers
def test_the_warmup_is_kept_as_given(steps, warmup):
    """transformers' cosine schedule with a minimum: lr * t / warmup during the warmup, then a
    cosine from lr to lr * min_lr_ratio at `steps`; a warmup longer than the run ends it
    before the peak (it was shortened to steps - 1)."""
    cfg = validate(TrainConfig.of(steps=steps, warmup=warmup, lr=1e-3, min_lr_ratio=0.1))
    lr_at = schedule(cfg.step)

    def want(t):
        if t < warmup:
            return 1e-3 * t / warmup
        cosine = 0.5 * (1 + math.cos(math.pi * (t - warmup) / (steps - warmup)))
        return 1e-3 * (0.1 + 0.9 * cosine)
    np.testing.assert_allclose([float(lr_at(t)) for t in range(steps)], [want(t) for t in range(steps)],
                               rtol=1e-6, atol=1e-12)
    assert (max(float(lr_at(t)) for t in range(steps)) == np.float32(1e-3)) == (warmup < steps)  # the peak, if reached


def test_adam_epsilon_is_a_flag():
    """Adam's first update is lr * g / (|g| + eps) (both moments bias-corrected): with eps
    1 instead of 1e-8 a gradient of 1 moves half as far."""
    cfg = validate(TrainConfig.of(eps=1.0, warmup=0, lr=0.1, weight_decay=0.0, clip=1e9))
    tx = make_optimizer(cfg.step, cfg.model_cfg)
    params = {"embedding": jnp.zeros(3)}
    updates, _ = tx.update({"embedding": jnp.ones(3)}, tx.init(params), params)
    np.testing.assert_allclose(updates["embedding"], -0.1 * 1 / (1 + 1.0), rtol=1e-6)
    with pytest.raises(UserError, match="--eps must be positive"):
        validate(TrainConfig.of(eps=0.0))


def test_an_imported_moe_model_trained_with_a_bias_is_served(tmp_path):
    """Imported Mixtral, trained with --router-bias-rate: its checkpoint serves (generate,
    eval and export read it; it failed on the imported model's saved architecture), and
    the Hugging Face export is refused in one line, leaving nothing."""
    import shutil

    from spmd.run.weights import checkpoint_config, restore_params
    from spmd.train import train

    source = shutil.copytree(MIXTRAL, tmp_path / "mixtral")
    cfg = validate(TrainConfig.of(init_from=str(source), mesh="", router_bias_rate=0.01, batch=4, seq=16, steps=2,
                               warmup=0, out=str(tmp_path / "run")))
    train(cfg, make_layout(cfg, jax.devices()[:1]), log=lambda _: None)
    served, checkpoint = checkpoint_config(str(tmp_path / "run"))
    assert served.moe.router_bias_weight and served.moe.router_bias_rate == 0
    params = restore_params(checkpoint, served, make_layout(served, jax.devices()[:1], for_training=False))
    assert np.abs(np.asarray(params["blocks"]["moe"]["mlp"]["bias"])).max() > 0
    done = subprocess.run([sys.executable, "-m", "spmd.export", "--checkpoint", str(tmp_path / "run"), "--format",
                           "hf", "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.count("\n")) == (2, 1), done.stderr
    assert "has no selection bias; the default format keeps it" in done.stderr
    assert not (tmp_path / "hf").exists()
    # The directory the run started from is an input of its export (its tokenizer files are copied).
    done = subprocess.run([sys.executable, "-m", "spmd.export", "--checkpoint", str(tmp_path / "run"), "--out",
                           str(source / "e")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "would write over the run's --init-from" in done.stderr, done.stderr
    assert not (source / "e").exists()
