"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import math

import jax
import optax

from models import model_class


def learning_rate(cfg) -> float:
    """Peak learning rate; with `scale_lr`, the linear scaling rule (Goyal et al., 2017)."""
    if cfg.scale_lr:
        return cfg.lr * cfg.batch / cfg.ref_batch
    return cfg.lr


def schedule(cfg) -> optax.Schedule:
    peak = learning_rate(cfg)
    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else peak,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1),
        end_value=peak * cfg.min_lr_ratio,
    )


def make_optimizer(cfg, model_cfg, clip: bool = True) -> optax.GradientTransformation:
    """`clip` False: the caller clips (with a norm of its own); the chain keeps its shape,
    so its state is the same either way."""
    decays = model_class(model_cfg).decays  # the model says which parameters weight decay applies to

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: decays(tuple(str(getattr(k, "key", k)) for k in path)), params)

    return optax.chain(
        optax.clip_by_global_norm(cfg.clip if clip else math.inf),
        optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=1e-8, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
