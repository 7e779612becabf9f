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
  compute. The backward pass is the ring's own (`custom_vjp`): the K/V blocks go around
  again with their float32 gradients, so no hop's blocks or partial results are kept and
  a device's memory is 1/sp of one device's.
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
from models.attention import Mask, causal_attention
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
                             axis_names=still_automatic({AXIS, *BATCH_AXES, *batch_axes}), check_vma=False
                             )(q, k, v, segments)

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
                             out_specs=split, axis_names=still_automatic({AXIS, *BATCH_AXES, *batch_axes}),
                             check_vma=False)(expert)

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
    return kernel(q, k_all, v_all, Mask(q_positions, k_positions, segments, k_segments, window))


# ----------------------------------------------------------------------------- ring

def _halves(x, chunk: int):
    """A rank's two chunks of (batch, 2 chunk, ...), or two Nones."""
    return (None, None) if x is None else (x[:, :chunk], x[:, chunk:])


def _ring(q, k, v, segments, *, n: int, window):
    return _ring_attention(q, k, v, segments, n, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring_attention(q, k, v, segments, n: int, window):
    out, _ = _ring_forward_pass(q, k, v, segments, n, window)
    return out.astype(q.dtype)


class _Ring:
    """One rank's view of the ring: its two query chunks, which K/V chunk pairs the mask
    hides, and the blocks' travel (rank j sends to j + 1, so after `step` hops a rank
    holds the block of rank - step)."""

    def __init__(self, q, segments, n: int, window):
        self.n, self.window, self.chunk = n, window, q.shape[1] // 2
        self.rank = jax.lax.axis_index(AXIS)
        self.q_index = (self.rank, 2 * n - 1 - self.rank)
        self.q_segments = _halves(segments, self.chunk)
        self.pairs = [(j, (j + 1) % n) for j in range(n)]

    def send(self, *blocks):
        return tuple(None if b is None else jax.lax.ppermute(b, AXIS, self.pairs) for b in blocks)

    def chunk_pairs(self, source):
        """(query half, key half, query chunk index, key chunk index) of the local queries
        against the block that `source` holds."""
        k_index = (source, 2 * self.n - 1 - source)
        return [(i, j, self.q_index[i], k_index[j]) for j in range(2) for i in range(2)]

    def seen(self, qi, ki):
        """Whether any key of chunk ki is visible to a query of chunk qi: not after it, and
        (under a window) its last key less than a window before the chunk's first query."""
        causal = qi >= ki
        c = self.chunk
        return causal if self.window is None else causal & (qi * c - (ki * c + c - 1) < self.window)

    def positions(self, index):
        return _positions(index, self.chunk)

    def mask(self, qi, ki, q_segments, k_segments) -> Mask:
        """The mask of query chunk qi against key chunk ki (with their segment ids, or Nones)."""
        return Mask(self.positions(qi), self.positions(ki), q_segments, k_segments, self.window)


def _ring_forward_pass(q, k, v, segments, n: int, window):
    """(output in float32, log-sum-exp) of the local queries over the whole sequence: the
    K/V blocks travel n - 1 hops, each chunk pair merged by its log-sum-exp; a chunk pair
    that the mask hides entirely is skipped (`lax.cond`)."""
    ring = _Ring(q, segments, n, window)
    q_halves = _halves(q, ring.chunk)

    def visit(states, k, v, k_segments, source):
        k_halves, v_halves, ks_halves = _halves(k, ring.chunk), _halves(v, ring.chunk), _halves(k_segments, ring.chunk)
        states = list(states)
        for i, j, qi, ki in ring.chunk_pairs(source):
            # (The mask's window stays static: Mask's own.)
            part = jax.lax.cond(ring.seen(qi, ki), flash.attention_lse, lambda qc, *_: flash.nothing(qc),
                                q_halves[i], k_halves[j], v_halves[j], ring.mask(qi, ki, ring.q_segments[i], ks_halves[j]))
            states[i] = flash.merge(states[i], part)
        return tuple(states)

    def hop(carry, step):
        k, v, k_segments, states = carry
        k, v, k_segments = ring.send(k, v, k_segments)
        return (k, v, k_segments, visit(states, k, v, k_segments, (ring.rank - step) % n)), None

    states = visit(tuple(flash.nothing(qc) for qc in q_halves), k, v, segments, ring.rank)
    (_, _, _, states), _ = jax.lax.scan(hop, (k, v, segments, states), jnp.arange(1, n))
    return jnp.concatenate([out for out, _ in states], axis=1), jnp.concatenate([lse for _, lse in states], axis=-1)


def _ring_forward(q, k, v, segments, n: int, window):
    out, lse = _ring_forward_pass(q, k, v, segments, n, window)
    # What the backward pass needs is the local blocks, the output and its log-sum-exp:
    # no hop's blocks or partial results are kept, so memory is 1/sp of one device's.
    # Named as activations, like the chunked kernel's: a policy that keeps those keeps these.
    out, lse = checkpoint_name(out, ACTIVATION), checkpoint_name(lse, ACTIVATION)
    return out.astype(q.dtype), (q, k, v, segments, out, lse)


def _ring_backward(n: int, window, residuals, d_out):
    """The K/V blocks go around the ring again, each with its float32 dK and dV, to which
    every rank adds its queries' share; one last hop brings the gradients home."""
    q, k, v, segments, out, lse = residuals
    ring = _Ring(q, segments, n, window)
    c = ring.chunk
    q_halves, out_halves, d_out_halves = _halves(q, c), _halves(out, c), _halves(d_out, c)
    lse_halves = (lse[..., :c], lse[..., c:])

    def nothing(q, k, v, *_):
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    def visit(d_q, d_k, d_v, k, v, k_segments, source):
        k_halves, v_halves, ks_halves = _halves(k, c), _halves(v, c), _halves(k_segments, c)
        d_q, d_k, d_v = list(d_q), list(_halves(d_k, c)), list(_halves(d_v, c))
        for i, j, qi, ki in ring.chunk_pairs(source):
            g_q, g_k, g_v = jax.lax.cond(
                ring.seen(qi, ki), flash.attention_gradients, nothing, q_halves[i], k_halves[j], v_halves[j],
                ring.mask(qi, ki, ring.q_segments[i], ks_halves[j]), out_halves[i], lse_halves[i], d_out_halves[i])
            d_q[i], d_k[j], d_v[j] = d_q[i] + g_q, d_k[j] + g_k, d_v[j] + g_v
        return tuple(d_q), jnp.concatenate(d_k, axis=1), jnp.concatenate(d_v, axis=1)

    def hop(carry, step):
        k, v, k_segments, d_k, d_v, d_q = carry
        k, v, k_segments, d_k, d_v = ring.send(k, v, k_segments, d_k, d_v)
        d_q, d_k, d_v = visit(d_q, d_k, d_v, k, v, k_segments, (ring.rank - step) % n)
        return (k, v, k_segments, d_k, d_v, d_q), None

    zeros = jnp.zeros(k.shape, jnp.float32)
    d_q, d_k, d_v = visit((jnp.zeros(q_halves[0].shape, jnp.float32),) * 2, zeros, zeros, k, v, segments, ring.rank)
    (_, _, _, d_k, d_v, d_q), _ = jax.lax.scan(hop, (k, v, segments, d_k, d_v, d_q), jnp.arange(1, n))
    # After n - 1 hops a rank holds rank + 1's block: one more hop home, in K's and V's
    # dtype (the sum is complete; XLA:GPU moves the cast before the send anyway).
    d_k, d_v = ring.send(d_k.astype(k.dtype), d_v.astype(v.dtype))
    return jnp.concatenate(d_q, axis=1).astype(q.dtype), d_k, d_v, None


_ring_attention.defvjp(_ring_forward, _ring_backward)
