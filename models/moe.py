"""Mixture-of-Experts feed-forward layer, written for one device.

A router scores each token against every expert (softmax, or sigmoid as in DeepSeek-V3),
keeps its top-k, and the token's output is the gate-weighted sum of those experts' SwiGLU
outputs, plus an optional shared expert that every token uses.

Two ways to reach the experts:

- capacity: each expert takes at most C tokens of each sequence, C = ceil(factor * seq *
  k / experts) (at most seq). A sequence's tokens claim slots in position order; what
  does not fit is dropped (its gate counts as zero) and counted. Expert inputs are fixed
  (experts, C) buffers, so the compute has a static shape.
- dropless: every choice is computed. Choices are sorted by expert and run as one grouped
  matmul (`jax.lax.ragged_dot`, made batchable by vmap in models.ragged).

Capacity is per sequence, so what is dropped does not depend on how the batch is split.
The load-balancing loss is also per sequence (DeepSeek-V3's sequence-wise form): for each
sequence, experts x sum_e f_e P_e, with f_e the share of its choices that went to e and
P_e the mean score of e; 1 when balanced. The layer also reports f and P over its whole
batch (`choices_per_token`, `router_prob`), from which a trainer forms transformers' pooled form. The router z-loss is the mean squared
log-sum-exp of the router logits.

Balancing (a training choice, `Routing.balanced`): a per-expert bias is added to the
scores to choose the top k, not to the gate values (DeepSeek-V3's auxiliary-loss-free
balancing; a trainer moves it against the measured load). With `slots` > experts, the
experts' weights live in that many slots, some experts in several (`placement`: the
expert of each slot); a token's choice of an expert goes to one of its copies, picked by
the token's position. As long as the copies are equal, neither changes the mathematics.
Bias, placement and the measured load are `RouterState` variables beside the weights; a
served model keeps only the bias, as a weight (`Routing.bias_weight`).

Moving tokens between devices is not written here: the expert computation goes through
`experts_ffn`, which a trainer may swap (`expert_implementation`, see spmd.parallel.experts) for
one that sends tokens to the devices holding their experts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.annotate import ACTIVATION, constrain, weight
from models.fp8 import linear
from models.ragged import MATMUL, inverse_permutation, permute_rows, ragged_dot
from models.swap import Swappable

SCORING = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    experts: int
    top_k: int
    expert_mlp: int  # hidden width of one expert
    shared_experts: int = 0  # a shared expert of width shared_experts x expert_mlp
    every: int = 1  # every n-th layer is an MoE layer; the others are dense
    scoring: str = "softmax"
    normalize_top_k: bool = True  # gates: the k chosen scores over their sum (else the scores themselves)
    # DeepSeek-V3's routing: experts in `groups` groups, of which a token chooses among the
    # `top_groups` whose two best scores sum highest; gates times `scale`; a selection bias
    # (e_score_correction_bias) that is part of the checkpoint.
    groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    selection_bias: bool = False
    # How the model is trained to balance its experts, as its authors define it (training
    # reads these; the forward pass does not): the load-balancing loss per sequence
    # ("sequence") or pooled over the batch and every MoE layer ("pooled", transformers'
    # Mixtral and Qwen-MoE), and the weights of it and of the router z-loss.
    balance_loss: str = "sequence"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001

    def params_per_layer(self, embed: int) -> int:
        """Router (with its selection bias), experts and shared expert of one MoE layer."""
        router = (embed + self.selection_bias) * self.experts
        return router + 3 * embed * self.expert_mlp * (self.experts + self.shared_experts)

    def active_per_layer(self, embed: int) -> int:
        """Of those, the ones one token multiplies with."""
        router = (embed + self.selection_bias) * self.experts
        return router + 3 * embed * self.expert_mlp * (self.top_k + self.shared_experts)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens reach experts (a training choice, not part of the checkpoint)."""

    dispatch: str = "dropless"
    capacity_factor: float = 1.25
    balanced: bool = False  # keep a RouterState: selection bias, measured load, placement
    slots: int | None = None  # expert slots (None: one per expert); needs `balanced`
    bias_weight: bool = False  # a served model's selection bias: a weight, no state kept

    def capacity(self, seq: int, moe: MoEConfig) -> int | None:
        """Slots per expert per sequence (None: dropless)."""
        if self.dispatch == "dropless":
            return None
        if self.capacity_factor * moe.top_k >= moe.experts:  # every token fits (and a huge factor stays a number)
            return seq
        return min(seq, math.ceil(self.capacity_factor * seq * moe.top_k / moe.experts))


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where each token's k choices go: arrays of shape (batch, seq, k)."""

    expert: jax.Array  # int32 expert index
    slot: jax.Array  # int32 rank among its sequence's tokens sent to that expert (capacity mode)
    gate: jax.Array  # float32 weight of that expert's output; zero where dropped


class RouterState(nnx.Variable):
    """Routing state that gradients do not train: `bias` (experts,) added to the scores
    that choose the top k; `load` (experts,), the measured share of choices per expert;
    `placement` (slots,), the expert each slot of weights holds."""


def _param(rngs, shape, names, std, slots=None):
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    if slots is not None:  # each slot starts as a copy of the expert it holds
        value = value[slots]
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def initial_placement(experts: int, slots: int) -> np.ndarray:
    """Slot j holds expert j % experts: every expert once, then the first ones again."""
    return np.arange(slots, dtype=np.int32) % experts


def slot_of(placement: jax.Array, expert: jax.Array, positions, experts: int) -> jax.Array:
    """The slot each choice (b, s, k) goes to: one of its expert's copies, taken in turn
    by the token's position."""
    holds = placement[None, :] == jnp.arange(experts)[:, None]  # (experts, slots)
    copies = jnp.sum(holds, axis=1)
    order = jnp.argsort(~holds, axis=1, stable=True)  # each expert's slots first
    turn = jnp.asarray(positions)[None, :, None] % jnp.maximum(copies[expert], 1)
    return jnp.take_along_axis(order[expert], turn[..., None], axis=-1)[..., 0].astype(jnp.int32)


class MoE(nnx.Module):
    def __init__(self, embed: int, moe: MoEConfig, routing: Routing, dtype, rngs: nnx.Rngs):
        e, n, m = embed, moe.experts, moe.expert_mlp
        # The router's expert dimension stays whole: every token scores every expert.
        self.router = _param(rngs, (e, n), ("embed", None), e**-0.5)
        placement = initial_placement(n, routing.slots or n) if routing.balanced else None
        self.gate_up = _param(rngs, (n, e, 2, m), ("experts", "embed", None, "mlp"), e**-0.5, placement)
        self.down = _param(rngs, (n, m, e), ("experts", "mlp", "embed"), m**-0.5, placement)
        if routing.balanced:
            state = functools.partial(RouterState, out_sharding=(None,), eager_sharding=False)
            self.bias, self.load = state(jnp.zeros(n)), state(jnp.full(n, 1.0 / n))
            self.placement = state(jnp.asarray(placement))
        elif routing.bias_weight or moe.selection_bias:
            self.bias = nnx.Param(jnp.zeros(n), out_sharding=(None,), eager_sharding=False)
        if moe.shared_experts:
            width = moe.shared_experts * m
            self.shared_gate_up = _param(rngs, (e, 2, width), ("embed", None, "mlp"), e**-0.5)
            self.shared_down = _param(rngs, (width, e), ("mlp", "embed"), width**-0.5)
        self.moe, self.routing, self.dtype = moe, routing, dtype

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict]:
        moe, dt = self.moe, self.dtype
        logits = jnp.einsum("bse,en->bsn", x.astype(jnp.float32), weight(self.router, jnp.float32))
        logits = constrain(logits, "batch", "seq", None)  # every device scores its own tokens
        if moe.scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        balanced = self.routing.balanced
        # The bias only chooses: the gates are the chosen experts' own scores.
        choosing = scores + self.bias[...] if hasattr(self, "bias") else scores
        expert = _top_k(_in_top_groups(choosing, moe) if moe.groups > 1 else choosing, moe.top_k)
        top = jnp.take_along_axis(scores, expert, axis=-1)
        gate = top / jnp.sum(top, axis=-1, keepdims=True) if moe.normalize_top_k else top
        gate = gate * moe.scale if moe.scale != 1.0 else gate
        capacity = self.routing.capacity(x.shape[1], moe)
        slot = capacity_slots(expert, positions, moe.experts) if capacity is not None else jnp.zeros_like(expert)
        kept = slot < capacity if capacity is not None else jnp.ones(slot.shape, bool)
        # Copies of an expert split its tokens; a slot's buffer positions stay those ranks,
        # which are distinct among the tokens of one expert, hence of one of its slots.
        held_in = slot_of(self.placement[...], expert, positions, moe.experts) if balanced else expert
        choice = Choice(held_in, slot, jnp.where(kept, gate, 0.0))
        # Whole along the sequence, as x: under Megatron-SP the residual stream's gradient
        # is then gathered before the gates weigh it (else XLA weighed it on each device's
        # part and gathered each choice's, top_k times the bytes). Named apart: no remat
        # policy keeps it by name (the backward pass does not read it).
        y = constrain(experts_ffn(x, choice, weight(self.gate_up, dt), weight(self.down, dt), capacity),
                      "batch", "seq", "embed", saved_as="experts_output")
        if moe.shared_experts:
            y = y + _swiglu(x, weight(self.shared_gate_up, dt), weight(self.shared_down, dt))
        stats = _statistics(logits, scores, expert, kept, moe)
        if balanced:
            stats["slot_load"] = _shares(held_in, self.placement.shape[0], moe.top_k)
        return y.astype(x.dtype), stats


def _top_k(scores: jax.Array, k: int) -> jax.Array:
    """The indices of the k largest scores of the last axis (ties: lower index first).
    A stable sort rather than `lax.top_k`, which XLA's partitioner runs on the whole
    batch (it gathered the batch over ep)."""
    return jnp.argsort(-scores, axis=-1, stable=True)[..., :k].astype(jnp.int32)


def _in_top_groups(scores: jax.Array, moe: MoEConfig) -> jax.Array:
    """`scores` (..., experts) with those outside each token's `top_groups` groups at -inf:
    a group ranks by the sum of its two best scores (DeepSeek-V3's group-limited routing)."""
    grouped = scores.reshape(*scores.shape[:-1], moe.groups, -1)
    group_score = jnp.sum(jnp.sort(grouped, axis=-1)[..., -2:], axis=-1)
    kept = jnp.sum(jax.nn.one_hot(_top_k(group_score, moe.top_groups), moe.groups, dtype=jnp.int32), axis=-2) > 0
    return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(scores.shape)


def _shares(index: jax.Array, n: int, k: int) -> jax.Array:
    """(n,) share of the choices (b, s, k) that went to each of n experts or slots."""
    return jnp.mean(jnp.sum(jax.nn.one_hot(index, n, dtype=jnp.float32), axis=2), axis=(0, 1)) / k


def _swiglu(x, gate_up, down):
    both = linear("bse,eim->bsim", x, gate_up, parts=("i", (1, 1)))
    hidden = constrain(jax.nn.silu(both[:, :, 0]) * both[:, :, 1], "batch", "seq", "mlp")
    return linear("bsm,me->bse", hidden, down)


def _slots(expert: jax.Array, positions: jax.Array, experts: int) -> jax.Array:
    """Each choice's rank among its sequence's choices of the same expert, earlier
    positions first (then lower k): the order in which tokens claim capacity."""
    order = jnp.argsort(positions)
    in_order = expert[:, order]  # (b, s, k), by position
    b, s, k = in_order.shape
    one_hot = jax.nn.one_hot(in_order.reshape(b, s * k), experts, dtype=jnp.int32)
    before = jnp.cumsum(one_hot, axis=1) - one_hot  # choices of that expert earlier in the sequence
    rank = jnp.sum(before * one_hot, axis=-1).reshape(b, s, k)
    return rank[:, jnp.argsort(order)]


def _statistics(logits, scores, expert, kept, moe: MoEConfig) -> dict:
    """Per-layer terms, each a mean over sequences (so averages of equal parts compose)."""
    share = jnp.sum(jax.nn.one_hot(expert, moe.experts, dtype=jnp.float32), axis=2)  # (b, s, n)
    f = jnp.mean(share, axis=1) / moe.top_k  # (b, n): share of each sequence's choices
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)  # (b, n)
    return {
        "balance_loss": jnp.mean(moe.experts * jnp.sum(f * p, axis=-1)),
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "dropped": 1.0 - jnp.mean(kept.astype(jnp.float32)),
        "expert_load": jnp.mean(f, axis=0),  # (n,) share of all choices per expert
        "router_prob": jnp.mean(p, axis=0),  # (n,) mean normalized score per expert
        "choices_per_token": jnp.mean(share, axis=(0, 1)),  # (n,) how often a token picks each expert
    }


# ------------------------------------------------------------------ expert computation

def swiglu_experts(tokens: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """Each expert on its own tokens: tokens (n, t, embed) -> (n, t, embed)."""
    both = linear("nte,neim->ntim", tokens, gate_up, parts=("i", (1, 1)))
    return linear("ntm,nme->nte", jax.nn.silu(both[:, :, 0]) * both[:, :, 1], down)


def grouped_experts(tokens: jax.Array, expert: jax.Array, gate_up: jax.Array, down: jax.Array,
                    rows: int | None = None) -> jax.Array:
    """Each row of `tokens` (t, embed) through the expert `expert` (t,) names; an index
    equal to the number of experts marks padding (output zero). Rows are sorted by expert
    and run as one grouped matmul, then put back in their order. `rows`: an expert's rows
    under even routing (default t / experts), the size of the pieces GPUs run it in
    (models.ragged.by_pieces)."""
    n = gate_up.shape[0]
    rows = rows or -(-tokens.shape[0] // n)
    order = jnp.argsort(expert, stable=True)
    inverse = inverse_permutation(order)
    sizes = jnp.bincount(expert, length=n + 1)[:n].astype(jnp.int32)  # padding sorts last, outside every group
    _, e, _, m = gate_up.shape
    # One contracting dimension each way, as libtpu's grouped matmul requires (the input's
    # gradient would contract gate/up and m): gate and up interleaved along the output, so
    # that m split over tp stays a split of the merged axis.
    interleaved = gate_up.swapaxes(2, 3).reshape(n, e, m * 2)
    both = ragged_dot(MATMUL, permute_rows(tokens, order, inverse), interleaved, sizes, rows).reshape(-1, m, 2)
    hidden = jax.nn.silu(both[..., 0]) * both[..., 1]
    out = ragged_dot(MATMUL, hidden, down, sizes, rows)
    return permute_rows(out, inverse, order)


def to_buffers(x: jax.Array, choice: Choice, experts: int, capacity: int) -> jax.Array:
    """Tokens (b, s, e) into per-sequence expert buffers (b, experts, capacity, e); choices
    past capacity fall off."""
    def one(x, expert, slot):
        rows = jnp.broadcast_to(x[:, None], (*expert.shape, x.shape[-1]))
        return jnp.zeros((experts, capacity, x.shape[-1]), x.dtype).at[expert, slot].set(rows, mode="drop")
    return jax.vmap(one)(x, choice.expert, choice.slot)


def from_buffers(buffers: jax.Array, choice: Choice) -> jax.Array:
    """Expert outputs (b, experts, capacity, e) back to tokens (b, s, e), gate-weighted."""
    def one(buffer, expert, slot, gate):
        rows = buffer.at[expert, slot].get(mode="fill", fill_value=0)  # (s, k, e)
        return jnp.einsum("ske,sk->se", rows, gate.astype(rows.dtype))
    return jax.vmap(one)(buffers, choice.expert, choice.slot, choice.gate)


def single_device_experts(x, choice: Choice, gate_up, down, capacity: int | None) -> jax.Array:
    """The expert computation when every expert is at hand."""
    experts = gate_up.shape[0]
    if capacity is not None:
        buffers = to_buffers(x, choice, experts, capacity)
        b = x.shape[0]
        flat = buffers.swapaxes(0, 1).reshape(experts, b * capacity, -1)  # each expert's tokens together
        out = swiglu_experts(flat, gate_up, down).reshape(experts, b, capacity, -1).swapaxes(0, 1)
        return from_buffers(out, choice)
    b, s, k = choice.expert.shape
    rows = jnp.repeat(x.reshape(b * s, -1), k, axis=0)  # one row per choice
    out = grouped_experts(rows, choice.expert.reshape(-1), gate_up, down).reshape(b, s, k, -1)
    # Kept for the gates' gradient, like the rows an exchange returns (spmd.parallel.experts):
    # remat policies that keep matmul outputs do not see a ragged one, and recomputing
    # it would sum it over tp again.
    out = checkpoint_name(out, ACTIVATION)
    return jnp.einsum("bske,bsk->bse", out, choice.gate.astype(out.dtype))


# Each choice's rank among its sequence's choices of its expert (capacity mode):
# capacity_slots(expert, positions, experts); a trainer that splits sequences swaps in a
# ranking across the pieces (`slots_implementation`, see spmd.parallel.context).
capacity_slots = Swappable("slots", _slots)
slots_implementation = capacity_slots.use

# Gate-weighted sum of each token's chosen experts: experts_ffn(x, choice, gate_up, down,
# capacity) is what the MoE layer calls; `expert_implementation(f)` swaps in f.
experts_ffn = Swappable("experts", single_device_experts)
expert_implementation = experts_ffn.use
