"""The loss of a batch: what the model reads of it, the next-token cross-entropy over the
targets that count, and what an MoE model adds to what is minimized.

A batch is token rows (batch, seq + 1), or packed rows (fine-tuning data): a dict of such
arrays, `tokens`, `segments` (1, 2, ... per example, 0 for padding) and `loss_mask` (a
token is trained as the prediction from the token before it). A target counts when the
mask says so and it belongs to the same example as its input; attention stays inside each
example (models.attention.Packing), whose positions restart at 0. The loss is the mean
over the target tokens of the whole step, not a mean of per-row or per-microbatch means:
each part of a step (a microbatch, an accumulation shard, a pipeline round) divides its
sum by its share of the step's count (`denominator`), so that the parts' means compose.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import Packing


class AuxLosses(NamedTuple):
    """What a model adds to the loss it minimizes: an MoE model's load-balancing loss, in
    its form (`models.moe.MoEConfig.balance_loss`), and its router z-loss, with their
    weights; multi-token prediction's loss (models.deepseek3), with its weight at this step
    (None: not computed)."""

    balance: str = "sequence"
    aux_weight: float = 0.0
    z_weight: float = 0.0
    mtp_weight: float | jax.Array | None = None


def prediction_depth(model_cfg) -> int:
    """How many tokens beyond the next the model predicts (models.deepseek3's mtp_depth)."""
    return getattr(model_cfg, "mtp_depth", 0)


def aux_losses(cfg, step: jax.Array | None = None) -> AuxLosses:
    """The run's: its flags where given, else the model's own definition and weights; at
    optimizer `step` (traced), multi-token prediction's weight too (--mtp-weight, then
    --mtp-weight-later from its step on)."""
    moe = cfg.model_cfg.moe
    mtp = None
    if step is not None and prediction_depth(cfg.model_cfg):
        mtp = jnp.float32(cfg.model.mtp_weight)
        if cfg.model.mtp_switch is not None:
            switch, later = cfg.model.mtp_switch
            mtp = jnp.where(step >= switch, jnp.float32(later), mtp)
    if moe is None:
        return AuxLosses(mtp_weight=mtp)
    pick = lambda given, own: own if given is None else given  # noqa: E731
    return AuxLosses(pick(cfg.moe.balance_loss, moe.balance_loss), pick(cfg.moe.aux_loss_weight, moe.aux_loss_weight),
                     pick(cfg.moe.z_loss_weight, moe.z_loss_weight), mtp)


class Later(NamedTuple):
    """What multi-token prediction reads of a batch, per column and depth k (last axis,
    [..., k - 1]): the input k columns on in the row, the target k columns on (the token
    it predicts), and whether that target counts (float32: past the row's end, or its
    example's, it does not)."""

    inputs: jax.Array  # (b, seq, depth)
    targets: jax.Array  # (b, seq, depth)
    weights: jax.Array  # (b, seq, depth)


class Columns(NamedTuple):
    """A batch as the model reads it, in the column order sp lays out."""

    inputs: jax.Array  # (b, seq)
    targets: jax.Array  # (b, seq)
    positions: np.ndarray  # (seq,) the columns' order: a constant, so that a kernel can see it is 0, 1, 2, ...
    packing: Packing | None  # packed rows' examples (models.attention.Packing), else None
    weights: jax.Array | None  # (b, seq) float32: 1 for the targets that count, else None (all count)
    later: Later | None = None  # multi-token prediction's columns, if the model predicts further


def target_weights(rows: dict) -> jax.Array:
    """(b, seq) float32: which next-token targets of packed rows count (module docstring)."""
    segments, mask = rows["segments"], rows["loss_mask"]
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    return (same & (mask[:, 1:] != 0)).astype(jnp.float32)


def target_count(rows) -> jax.Array:
    """The number of targets that count in a batch (at least 1: a batch of padding adds nothing)."""
    if not isinstance(rows, dict):
        return jnp.asarray(rows.shape[0] * (rows.shape[1] - 1), jnp.float32)
    return jnp.maximum(jnp.sum(target_weights(rows)), 1.0)


def target_counts(rows: dict, depth: int = 0) -> jax.Array:
    """(1 + depth,) the counts packed rows' losses are means over: the next token's
    targets, then each depth of multi-token prediction's (each at least 1)."""
    weights = target_weights(rows)
    later = [] if not depth else jnp.sum(_later(rows, weights, depth).weights, axis=(0, 1))
    return jnp.maximum(jnp.concatenate([jnp.sum(weights)[None], jnp.asarray(later, jnp.float32)]), 1.0)


def _later(rows, weights: jax.Array | None, depth: int) -> Later:
    """Multi-token prediction's columns (`Later`), in the rows' own order. Column i at
    depth k reads input i + k and predicts target i + k; the target counts if it exists,
    counts for the next-token loss, and belongs to column i's example."""
    tokens = rows["tokens"] if isinstance(rows, dict) else rows
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    shifted = lambda a, k: jnp.roll(a, -k, axis=1)  # noqa: E731  (the k wrapped columns never count)
    within = lambda k: jnp.arange(seq) < seq - k  # noqa: E731
    counted = []
    for k in range(1, depth + 1):
        if weights is None:
            counted.append(jnp.broadcast_to(within(k).astype(jnp.float32), inputs.shape))
        else:
            segments = rows["segments"][:, :-1]
            same = (shifted(segments, k) == segments) & within(k)
            counted.append(jnp.where(same, shifted(weights, k), 0.0))
    stack = lambda a: jnp.stack([shifted(a, k) for k in range(1, depth + 1)], axis=-1)  # noqa: E731
    return Later(stack(inputs), stack(targets), jnp.stack(counted, axis=-1))


def _example_positions(segments: jax.Array) -> jax.Array:
    """Each token's position inside its example: its index less that of the example's first token."""
    index = jnp.arange(segments.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def model_columns(rows, order: np.ndarray | None, depth: int = 0) -> Columns:
    """`rows` (token rows (b, seq + 1), or packed rows' dict) as the model reads them,
    in `order` (a permutation of the columns, or None); with multi-token prediction's
    columns to `depth` (0: none)."""
    tokens = rows["tokens"] if isinstance(rows, dict) else rows
    inputs, targets, positions = tokens[:, :-1], tokens[:, 1:], np.arange(tokens.shape[1] - 1)
    packing = weights = None
    if isinstance(rows, dict):
        segments = rows["segments"][:, :-1]
        packing, weights = Packing(segments, _example_positions(segments)), target_weights(rows)
    later = _later(rows, weights, depth) if depth else None
    if order is not None:
        inputs, targets, positions = inputs[:, order], targets[:, order], positions[order]
        if packing is not None:
            packing = Packing(packing.segments[:, order], packing.positions[:, order])
            weights = weights[:, order]
        later = None if later is None else jax.tree.map(lambda a: a[:, order], later)
    return Columns(inputs, targets, positions, packing, weights, later)


def model_loss(graphdef, params, rows, order: np.ndarray | None = None, aux: AuxLosses = AuxLosses(),
          router: dict | None = None, denominator=None) -> tuple[jax.Array, dict]:
    """The loss to minimize and the step's metrics, for token rows (b, seq + 1) or packed rows.

    `loss` is the mean next-token cross-entropy; an MoE model adds its load-balancing and
    router z-losses (`aux`) to what is minimized. Every metric is a mean
    over sequences, so means over equal microbatches compose; with packed rows the loss is
    the sum over the counted targets over `denominator` (the step's count, scaled to this
    part of it, so that the parts' means compose too). `order`: the columns' order
    for the model (a permutation of the positions); the mean is that of any order.
    `router`: the MoE layers' router state, if the model keeps one (spmd.parallel.balance)."""
    model = nnx.merge(graphdef, params, router) if router else nnx.merge(graphdef, params)
    columns = model_columns(rows, order, 0 if aux.mtp_weight is None else prediction_depth(model.cfg))
    hidden, moe_stats = model.hidden(columns.inputs, columns.positions, columns.packing)
    loss, metrics = objective(model.logits(hidden), columns.targets, moe_stats, aux, columns.weights, denominator)
    return predicted_further(model, hidden, columns, aux, loss, metrics, denominator)


def predicted_further(model, hidden, columns: Columns, aux: AuxLosses, loss, metrics: dict, denominator=None
                      ) -> tuple[jax.Array, dict]:
    """`loss` and `metrics` with multi-token prediction's (if `columns` has its columns):
    the mean over depths of each depth's mean cross-entropy over the targets that count
    (`mtp_loss`), added to what is minimized times its weight (DeepSeek-V3's λ/D Σ_k L_k)."""
    if columns.later is None:
        return loss, metrics
    later, per_depth = columns.later, []
    for k, logits in enumerate(model.predictions(hidden, later.inputs, columns.positions, columns.packing)):
        weights = later.weights[..., k]
        count = jnp.sum(weights) if denominator is None else denominator[1 + k]
        per_depth.append(jnp.sum(_cross_entropy(logits, later.targets[..., k]) * weights) / count)
    mtp = sum(per_depth) / len(per_depth)
    return loss + aux.mtp_weight * mtp, {**metrics, "mtp_loss": mtp}


def _cross_entropy(logits, targets) -> jax.Array:
    # One-hot rather than a gather: the vocab dimension may be split over tp.
    picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def objective(logits, targets, moe_stats: dict, aux: AuxLosses, weights=None, denominator=None
               ) -> tuple[jax.Array, dict]:
    """The next-token loss (and an MoE model's terms) to minimize, and the metrics.
    `denominator`: packed rows' counts (`target_counts`), scaled to this part of the step."""
    losses = _cross_entropy(logits, targets)
    if weights is None:
        loss = jnp.mean(losses)
    else:
        loss = jnp.sum(losses * weights) / (jnp.sum(weights) if denominator is None else denominator[0])
    if not moe_stats:
        return loss, {"loss": loss}
    metrics = {"loss": loss, **moe_metrics(moe_stats, aux.balance)}
    return loss + aux.aux_weight * metrics["aux_loss"] + aux.z_weight * metrics["z_loss"], metrics


def moe_metrics(moe_stats: dict, balance_loss: str) -> dict:
    """The MoE layers' statistics (each with a leading layer axis) as step metrics.

    The balance loss "sequence" is the mean over layers of each layer's per-sequence loss;
    "pooled" is transformers' (Mixtral, Qwen-MoE `load_balancing_loss_func`): experts x
    sum_e c_e P_e with c_e the choices of e per token and P_e its mean probability, both
    over every token of the batch in every MoE layer (no division by top-k: 1 x top-k when
    balanced)."""
    loads = {name: moe_stats[name] for name in ("expert_load", "slot_load") if name in moe_stats}
    if balance_loss == "pooled":
        choices, prob = (jnp.mean(moe_stats[name], axis=0) for name in ("choices_per_token", "router_prob"))
        balance = choices.shape[-1] * jnp.sum(choices * prob)
    else:
        balance = jnp.mean(moe_stats["balance_loss"])
    return {"aux_loss": balance, "z_loss": jnp.mean(moe_stats["z_loss"]), "dropped": jnp.mean(moe_stats["dropped"]),
            **loads}


def aux_weights_per_layer(aux: AuxLosses, moe_layers: int):
    """What each MoE layer's statistics add to what is minimized, per unit of the loss
    (`objective` takes their means over the model's `moe_layers`): the per-sequence form
    only, which is a sum of per-layer terms (spmd.run.config refuses the pooled form here)."""
    scale = {"balance_loss": aux.aux_weight, "z_loss": aux.z_weight}

    def weights(stats: dict) -> dict:
        return {name: jnp.full_like(x, scale.get(name, 0.0) / moe_layers) for name, x in stats.items()}
    return weights
