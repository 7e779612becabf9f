"""Attention across the `sp` axis (sequence / context parallelism), with `jax.shard_map`.

The map is manual over `sp` and the batch axes (each device attends over its own rows)
and automatic over tp, so the heads keep their split. Every layer's activations are split along the
sequence; only attention needs the other ranks' keys and values.

Layout (zig-zag): the sequence is cut into 2n chunks for n = sp ranks and rank i holds
chunks i and 2n-1-i, one early and one late, so under the causal mask every rank has the
same work. The trainer reorders tokens, targets and positions this way before the model
(`zigzag_order`); masks compare positions, so the loss is that of the original order.

Packed rows: the segment ids of the keys travel (or are gathered) with them. A sliding
window hides more chunk pairs, which are skipped too.

- ring: K/V blocks travel the ring with `ppermute`, n-1 hops; each chunk pair is
  attended with the chunked kernel's pieces (models.flash), and the results merged by
  their log-sum-exp (the online softmax of flash attention). A chunk pair that the
  causal mask hides entirely is skipped (`lax.cond`): after the first hop each rank
  computes 2 of its 4 chunk pairs. XLA may overlap a hop with the previous hop's
  compute; autodiff sends the K/V gradients back around the ring.
- all-gather: K and V are all-gathered over sp, queries stay local and attend with the
  run's kernel; the backward pass reduce-scatters their gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from models import flash
from models.annotate import ACTIVATION
from models.attention import causal_attention
from spmd.parallel.mesh import BATCH_AXES, inside_map, still_automatic
from spmd.parallel.rules import SEQUENCE_AXIS

AXIS = SEQUENCE_AXIS  # the rules table splits the sequence over it


def zigzag_order(seq: int, n: int) -> np.ndarray:
    """Positions in the order the sp ranks hold them: rank i's chunks i and 2n-1-i."""
    chunks = np.arange(seq).reshape(2 * n, seq // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def make_attention(mesh: jax.sharding.Mesh, mode: str, batch_axes: tuple[str, ...] = BATCH_AXES,
                   kernel=causal_attention):
    """attention(q, k, v, positions, segments=None, window=None) for sequences laid out by `zigzag_order` over sp.
    `batch_axes`: the axes that split the rows here; those a surrounding vmap over batch
    shards has taken (gradient accumulation) are left out, and vmap adds them back.
    `kernel` (models.attention.KERNELS' form): what all-gather mode attends with."""
    n = mesh.shape[AXIS]
    body = functools.partial(_ring, n=n) if mode == "ring" else functools.partial(_gathered, n=n, kernel=kernel)
    # Manual over sp and the batch axes (each device's own rows), automatic over tp (heads).
    # (Manual over sp alone, XLA gathered the whole batch for the all-gather variant.)
    split = jax.P(batch_axes or None, AXIS)

    def attention(q, k, v, positions, segments=None, window=None):
        del positions  # each rank knows its own: they follow from the layout
        return jax.shard_map(functools.partial(body, window=window), mesh=inside_map(mesh),
                             in_specs=(split, split, split, split), out_specs=split,
                             axis_names=still_automatic({AXIS, *BATCH_AXES}), check_vma=False)(q, k, v, segments)

    return attention


def make_capacity_slots(mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...] = BATCH_AXES):
    """capacity_slots(expert, positions, experts) (models.moe) for sequences laid out by
    `zigzag_order` over sp: each rank counts its two chunks' choices per expert, the counts
    are all-gathered over sp (b x 2 x experts integers), and a choice's rank in its sequence
    is its rank in its chunk plus the choices of its expert in the chunks before it."""
    n = mesh.shape[AXIS]
    split = jax.P(batch_axes or None, AXIS)

    def ranks(expert, experts: int):
        b, s, k = expert.shape
        rank = jax.lax.axis_index(AXIS)
        halves = jax.nn.one_hot(expert.reshape(b, 2, s // 2 * k), experts, dtype=jnp.int32)  # (b, 2, c k, E)
        within = jnp.sum((jnp.cumsum(halves, axis=2) - halves) * halves, axis=-1)  # rank inside the chunk
        counts = jax.lax.all_gather(jnp.sum(halves, axis=2), AXIS)  # (n, b, 2, E): every rank's two chunks
        order = np.concatenate([np.arange(n), 2 * n - 1 - np.arange(n)])  # chunk of (half, rank), half-major
        per_chunk = jnp.zeros((2 * n, b, experts), jnp.int32).at[order].set(
            counts.transpose(2, 0, 1, 3).reshape(2 * n, b, experts))
        before = jnp.cumsum(per_chunk, axis=0) - per_chunk  # (2n, b, E): choices in earlier chunks
        mine = jnp.stack([before[rank], before[2 * n - 1 - rank]], axis=1)  # (b, 2, E)
        offset = jnp.take_along_axis(mine, expert.reshape(b, 2, s // 2 * k), axis=2)
        return (within + offset).reshape(b, s, k)

    def capacity_slots(expert, positions, experts: int):
        del positions  # each rank knows its chunks: they follow from the layout
        return jax.shard_map(functools.partial(ranks, experts=experts), mesh=inside_map(mesh), in_specs=(split,),
                             out_specs=split, axis_names=still_automatic({AXIS, *BATCH_AXES}), check_vma=False)(expert)

    return capacity_slots


def _positions(chunk_index, chunk: int) -> jax.Array:
    """Positions of the `chunk_index`-th chunk of `chunk` tokens."""
    return chunk_index * chunk + jnp.arange(chunk)


def _gathered(q, k, v, segments, *, n: int, kernel, window):
    rank = jax.lax.axis_index(AXIS)
    chunk = q.shape[1] // 2
    q_positions = jnp.concatenate([_positions(rank, chunk), _positions(2 * n - 1 - rank, chunk)])
    # Named as activations, like the ring's blocks: kept rather than gathered again.
    k_all = checkpoint_name(jax.lax.all_gather(k, AXIS, axis=1, tiled=True), ACTIVATION)
    v_all = checkpoint_name(jax.lax.all_gather(v, AXIS, axis=1, tiled=True), ACTIVATION)
    k_positions = jnp.asarray(zigzag_order(2 * n * chunk, n))
    k_segments = None if segments is None else jax.lax.all_gather(segments, AXIS, axis=1, tiled=True)
    return kernel(q, k_all, v_all, q_positions, k_positions, segments, k_segments, window)


# ----------------------------------------------------------------------------- ring

def _halves(x, chunk: int):
    """A rank's two chunks of (batch, 2 chunk, ...), or two Nones."""
    return (None, None) if x is None else (x[:, :chunk], x[:, chunk:])


def _ring(q, k, v, segments, *, n: int, window):
    rank = jax.lax.axis_index(AXIS)
    chunk = q.shape[1] // 2
    q_chunks = list(zip(_halves(q, chunk), (rank, 2 * n - 1 - rank), _halves(segments, chunk)))
    ring = [(j, (j + 1) % n) for j in range(n)]

    def attend_chunk(qc, kc, vc, qi, ki, qs, ks):
        return flash.attention_lse(qc, kc, vc, _positions(qi, chunk), _positions(ki, chunk), qs, ks, window)

    def seen(qi, ki):
        """Whether any key of chunk ki is visible to a query of chunk qi: not after it, and
        (under a window) its last key less than a window before the chunk's first query."""
        causal = qi >= ki
        return causal if window is None else causal & (qi * chunk - (ki * chunk + chunk - 1) < window)

    def visit(states, k, v, k_segments, source):
        """Merge the attention of the local queries on the K/V block that `source` holds."""
        k_chunks = zip(_halves(k, chunk), _halves(v, chunk), (source, 2 * n - 1 - source),
                       _halves(k_segments, chunk))
        states = list(states)
        for kc, vc, ki, ks in k_chunks:
            for i, (qc, qi, qs) in enumerate(q_chunks):
                # A key chunk after the query chunk (or out of its window) is hidden: skip it.
                part = jax.lax.cond(seen(qi, ki), attend_chunk, lambda qc, *_: flash.nothing(qc),
                                    qc, kc, vc, qi, ki, qs, ks)
                states[i] = flash.merge(states[i], part)
        return tuple(states)

    def hop(carry, step):
        k, v, k_segments, states = carry
        # Named as activations: remat policies that keep those keep the received blocks,
        # so the backward pass does not pass them around the ring again.
        k = checkpoint_name(jax.lax.ppermute(k, AXIS, ring), ACTIVATION)
        v = checkpoint_name(jax.lax.ppermute(v, AXIS, ring), ACTIVATION)
        if k_segments is not None:
            k_segments = jax.lax.ppermute(k_segments, AXIS, ring)
        return (k, v, k_segments, visit(states, k, v, k_segments, (rank - step) % n)), None

    states = visit(tuple(flash.nothing(qc) for qc, _, _ in q_chunks), k, v, segments, rank)
    (_, _, _, states), _ = jax.lax.scan(hop, (k, v, segments, states), jnp.arange(1, n))
    return jnp.concatenate([out for out, _ in states], axis=1).astype(q.dtype)
