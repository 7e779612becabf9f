"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import math

import jax
import optax

from models import model_class


def learning_rate(cfg) -> float:
    """Peak learning rate; with `scale_lr`, the linear scaling rule (Goyal et al., 2017)."""
    if cfg.optimizer.scale_lr:
        return cfg.optimizer.lr * cfg.training.batch / cfg.optimizer.ref_batch
    return cfg.optimizer.lr


def schedule(cfg) -> optax.Schedule:
    """Linear warmup from 0 over `warmup` steps, then a cosine to `min_lr_ratio` of the peak
    at `steps`, as transformers' cosine schedule: a warmup as long as the run or longer is
    kept as given (the run ends before the peak), never shortened."""
    peak = learning_rate(cfg)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.optimizer.warmup else peak,
        peak_value=peak,
        warmup_steps=cfg.optimizer.warmup,
        decay_steps=max(cfg.training.steps, cfg.optimizer.warmup + 1),
        end_value=peak * cfg.optimizer.min_lr_ratio,
    )


def applied_updates(opt_state) -> jax.Array:
    """How many updates the optimizer has applied: the step its schedule is at. A dropped
    (non-finite) update leaves it behind the run's step count, as transformers' Trainer
    does not step its scheduler when the optimizer step was skipped."""
    found = [count for path, count in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
             if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"]
    assert len(found) == 1, found
    return found[0]


def make_optimizer(cfg, model_cfg, clip: bool = True) -> optax.GradientTransformation:
    """`clip` False: the caller clips (with a norm of its own); the chain keeps its shape,
    so its state is the same either way."""
    decays = model_class(model_cfg).decays  # the model says which parameters weight decay applies to

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: decays(tuple(str(getattr(k, "key", k)) for k in path)), params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.optimizer.clip if clip else math.inf),
        optax.adamw(schedule(cfg), b1=cfg.optimizer.b1, b2=cfg.optimizer.b2, eps=cfg.optimizer.eps,
                    weight_decay=cfg.optimizer.weight_decay, mask=decay_mask),
    )
