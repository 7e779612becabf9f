"""Expert parallelism: tokens travel to the devices that hold their experts, with `jax.shard_map`.

Experts are split over `ep` (rules table: `experts` -> ep); the batch is split over the
batch axes (dp, fsdp, ep), the sequence over sp. The map is manual over the batch axes and
sp, so each device routes its own tokens (its rows, its chunk of each sequence), and
automatic over tp, so an expert's hidden width keeps its tp split. Inside gradient
accumulation's vmap over batch shards, or pipeline stages manual over some batch axes,
it is manual over the axes left.
With ep = 1 nothing moves: each device runs its tokens through all experts locally (a
global sort of every token would otherwise gather the batch).

- capacity: each device fills per-sequence buffers (sequences, experts, capacity, embed)
  as on one device (`models.moe.to_buffers`); one all-to-all over ep hands each expert's
  slice to its owner, which runs its experts on every source's tokens at once; a second
  all-to-all brings the outputs back. Bytes per all-to-all: capacity x experts x embed
  per local sequence, the (ep-1)/ep of it that leaves the device.
- dropless: a device's choices are packed per destination into (ep, P, embed), P =
  local tokens x min(k, experts per device), the most one device can ever send another,
  since a token picks an expert at most once. All-to-all, a grouped matmul over the
  received rows (sorted by expert, `jax.lax.ragged_dot`), all-to-all back. XLA:CPU has no
  ragged all-to-all, so the padding travels too: that is the price of never dropping a
  token on this backend.
- dropless on GPUs and TPUs: `jax.lax.ragged_all_to_all` sends only the rows there are.
  A device sorts its choices by destination; the per-destination counts are all-gathered
  over ep (ep x ep int32), from which every device computes where its rows start in each
  receiver's buffer, and where each source's rows land in its own. Receiving buffers keep
  the worst case's size (a static shape); the wire carries the tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.annotate import ACTIVATION
from models.moe import Choice, from_buffers, grouped_experts, single_device_experts, swiglu_experts, to_buffers
from models.ragged import inverse_permutation, permute_rows
from spmd.parallel.mesh import BATCH_AXES, inside_map, still_automatic
from spmd.parallel.rules import EXPERT_AXIS, SEQUENCE_AXIS

AXIS = EXPERT_AXIS  # the rules table splits the experts over it


RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # backends whose XLA has a ragged all-to-all


def ragged_exchange(mesh: jax.sharding.Mesh):
    """The dropless exchange `mesh`'s devices run: `jax.lax.ragged_all_to_all` where the
    backend has one, else None (padded blocks)."""
    return jax.lax.ragged_all_to_all if mesh.devices.flat[0].platform in RAGGED_PLATFORMS else None


def make_experts(mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...] = BATCH_AXES, ragged="auto"):
    """experts_ffn(x, choice, gate_up, down, capacity) for tokens split over `batch_axes`
    (those a surrounding vmap over batch shards has taken are left out: vmap adds them)
    and along the sequence over sp. `ragged`: the dropless exchange, a function with
    `jax.lax.ragged_all_to_all`'s signature, None for padded blocks, or "auto" (the backend's:
    `ragged_exchange`)."""
    ep = mesh.shape[AXIS]
    ragged = ragged_exchange(mesh) if ragged == "auto" else ragged
    # The experts are replicated over the other token axes. They enter the map as one copy
    # per shard (a broadcast, split over those axes), so their gradients are summed outside
    # it by XLA like any other weight's: a replicated input's gradient summed inside a
    # partly manual map crashed XLA:CPU's bf16 all-reduce promotion.
    replicas = tuple(a for a in batch_axes if a != AXIS) + (SEQUENCE_AXIS,)
    copies = math.prod(mesh.shape[a] for a in replicas)
    # ep taken by a surrounding vmap (accumulation takes it where it does not split the
    # experts: ep is 1) is the vmap's to name, not this map's. Outside pipeline stages the
    # rows are split over pp too (multi-token prediction after GPipe's): manual here.
    tokens, experts = jax.P(batch_axes or None, SEQUENCE_AXIS), jax.P(replicas, AXIS if AXIS in batch_axes else None)

    def implementation(x, choice: Choice, gate_up, down, capacity: int | None):
        if capacity is not None:
            body = functools.partial(_capacity, ep=ep, capacity=capacity)
        elif ragged is not None and ep > 1:
            body = functools.partial(_dropless_ragged, ep=ep, ragged=ragged)
        else:
            body = functools.partial(_dropless, ep=ep, capacity=capacity)
        per_copy = lambda w: jnp.broadcast_to(w, (copies, *w.shape))  # noqa: E731
        return jax.shard_map(lambda x, e, s, g, gu, d: body(x, e, s, g, gu[0], d[0]), mesh=inside_map(mesh),
                             in_specs=(tokens, tokens, tokens, tokens, experts, experts), out_specs=tokens,
                             axis_names=still_automatic((*BATCH_AXES, *batch_axes, SEQUENCE_AXIS)), check_vma=False
                             )(x, choice.expert, choice.slot, choice.gate, per_copy(gate_up), per_copy(down))

    return implementation


def _exchange(x: jax.Array, axis: int) -> jax.Array:
    """Block j of `axis` (size ep) goes to ep rank j; block i of the result came from rank i.
    Named as an activation: remat policies that keep those keep what arrived, so the
    backward pass does not exchange it again."""
    return checkpoint_name(jax.lax.all_to_all(x, AXIS, axis, axis, tiled=True), ACTIVATION)


def _in_chunk(expert, slot, capacity: int, experts: int) -> tuple[jax.Array, int]:
    """Slots in this device's buffers for the kept choices of its chunk of each sequence
    (slot < capacity: the sequence-wide rank decided what is kept), and the buffers' size:
    a chunk of c tokens sends an expert at most min(capacity, c) of them. With the whole
    sequence at hand these are the slots themselves."""
    b, c, k = expert.shape
    kept = slot < capacity
    flat = jnp.where(kept, expert, experts).reshape(b, c * k)  # dropped choices: a dummy expert
    one_hot = jax.nn.one_hot(flat, experts + 1, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(one_hot, axis=1) - one_hot) * one_hot, axis=-1).reshape(b, c, k)
    size = min(capacity, c)
    return jnp.where(kept, rank, size), size


def _capacity(x, expert, slot, gate, gate_up, down, *, ep: int, capacity: int):
    slot, capacity = _in_chunk(expert, slot, capacity, gate_up.shape[0] * ep)
    choice = Choice(expert, slot, gate)
    if ep == 1:
        return single_device_experts(x, choice, gate_up, down, capacity)
    local, (b, e) = gate_up.shape[0], (x.shape[0], x.shape[-1])
    buffers = to_buffers(x, choice, local * ep, capacity).reshape(b, ep, local, capacity, e)
    received = _exchange(buffers, 1)  # (b, source rank, local expert, slot, e)
    tokens = received.transpose(2, 1, 0, 3, 4).reshape(local, ep * b * capacity, e)
    out = swiglu_experts(tokens, gate_up, down).reshape(local, ep, b, capacity, e).transpose(2, 1, 0, 3, 4)
    returned = _exchange(out, 1)  # (b, expert's rank, local expert, slot, e)
    return from_buffers(returned.reshape(b, ep * local, capacity, e), choice)


def _dropless(x, expert, slot, gate, gate_up, down, *, ep: int, capacity: None):
    del slot, capacity
    if ep == 1:
        return single_device_experts(x, Choice(expert, None, gate), gate_up, down, None)
    local = gate_up.shape[0]
    b, s, k = expert.shape
    rows = jnp.repeat(x.reshape(b * s, -1), k, axis=0)  # one row per choice
    ids = expert.reshape(-1)
    rank, local_id = ids // local, ids % local
    # A choice's place in its destination's block: how many earlier choices go there too.
    to_rank = jax.nn.one_hot(rank, ep, dtype=jnp.int32)
    place = jnp.sum((jnp.cumsum(to_rank, axis=0) - to_rank) * to_rank, axis=-1)
    per_rank = b * s * min(k, local)
    send = jnp.zeros((ep, per_rank, rows.shape[-1]), rows.dtype).at[rank, place].set(rows)
    send_ids = jnp.full((ep, per_rank), local, jnp.int32).at[rank, place].set(local_id)  # `local`: padding
    received, received_ids = _exchange(send, 0), _exchange(send_ids, 0)
    out = grouped_experts(received.reshape(ep * per_rank, -1), received_ids.reshape(-1), gate_up, down)
    back = _exchange(out.reshape(ep, per_rank, -1), 0)
    mine = back[rank, place].reshape(b, s, k, -1)
    return jnp.einsum("bske,bsk->bse", mine, gate.astype(mine.dtype))


def _dropless_ragged(x, expert, slot, gate, gate_up, down, *, ep: int, ragged):
    """`_dropless` with exchanges of the rows there are (`ragged`: jax.lax.ragged_all_to_all's form)."""
    del slot
    local = gate_up.shape[0]
    b, s, k = expert.shape
    rows = jnp.repeat(x.reshape(b * s, -1), k, axis=0)  # one row per choice
    ids = expert.reshape(-1)
    rank, local_id = ids // local, ids % local
    order = jnp.argsort(rank, stable=True)  # the choices grouped by destination, in order
    inverse = inverse_permutation(order)
    plan = _RaggedPlan.of(jnp.bincount(rank, length=ep).astype(jnp.int32))
    size = ep * b * s * min(k, local)  # the most a device can receive: every source's worst case
    sent = permute_rows(rows, order, inverse)
    received = ragged(sent, jnp.zeros((size, rows.shape[-1]), rows.dtype), *plan.there, axis_name=AXIS)
    received_ids = ragged(local_id[order], jnp.full((size,), local, jnp.int32), *plan.there, axis_name=AXIS)
    received = checkpoint_name(received, ACTIVATION)  # kept like the padded path's blocks
    # `local` (padding): zero rows. A device receives b * s * k rows under even routing.
    out = grouped_experts(received, received_ids, gate_up, down, rows=-(-b * s * k // local))
    back = ragged(out, jnp.zeros(rows.shape, out.dtype), *plan.back, axis_name=AXIS)
    mine = permute_rows(back, inverse, order).reshape(b, s, k, -1)
    return jnp.einsum("bske,bsk->bse", mine, gate.astype(mine.dtype))


class _RaggedPlan:
    """Offsets and sizes of both exchanges of `_dropless_ragged`, from every device's count of
    rows per destination (`counts[i, j]`: rows rank i sends rank j). A sender's rows sit in
    destination order; a receiver's arrive in source order."""

    def __init__(self, counts: jax.Array, me: jax.Array):
        sent = counts[me]  # this device's rows per destination
        from_earlier_sources = jnp.cumsum(counts, axis=0) - counts  # [i, j]: rows j gets before i's
        to_earlier_destinations = jnp.cumsum(counts, axis=1) - counts  # [i, j]: rows i sends before j's
        # ragged_all_to_all's (input_offsets, send_sizes, output_offsets, recv_sizes):
        # there, this device's rows to each destination, landing after the earlier sources';
        self.there = (to_earlier_destinations[me], sent, from_earlier_sources[me], counts[:, me])
        # back, each source's results, from where they arrived to where they left.
        self.back = (from_earlier_sources[:, me], counts[:, me], to_earlier_destinations[:, me], sent)

    @classmethod
    def of(cls, sent: jax.Array) -> "_RaggedPlan":
        return cls(jax.lax.all_gather(sent, AXIS), jax.lax.axis_index(AXIS))


def ragged_all_to_all_model(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                            axis_name: str):
    """`jax.lax.ragged_all_to_all` as its documentation defines it (one slice per device),
    from an all-to-all of padded blocks: for backends without the op (XLA:CPU), so that
    the bookkeeping of offsets and sizes is tested where the op cannot run."""
    width = operand.shape[0]
    slot = jnp.arange(width)
    sends = slot[None] < send_sizes[:, None]  # (ep, width)
    blocks = operand[jnp.clip(input_offsets[:, None] + slot[None], 0, width - 1)]  # (ep, width, ...)
    blocks = jnp.where(sends.reshape(*sends.shape, *[1] * (operand.ndim - 1)), blocks, 0)
    arrived = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block i: source i's
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where source i wrote here
    target = jnp.where(slot[None] < recv_sizes[:, None], at[:, None] + slot[None], output.shape[0])
    return output.at[target.reshape(-1)].set(arrived.reshape(-1, *operand.shape[1:]), mode="drop")
