"""A grouped matmul (`jax.lax.ragged_dot_general`) that `jax.vmap` can batch, and that
XLA:GPU does not expand into a dense one.

JAX batches a ragged dot only when every operand is batched along its first axis ("ragged_dot
vmap over any dim but 0 - NYI", jax 0.10.2 and 0.12), so a vmap over token shards with the
expert weights shared (gradient accumulation's per-shard map) fails. Here the forward
and the backward product are each given a batching rule that broadcasts the shared
operands first, and the gradient is written with those two (`jax.custom_vjp`), so that
autodiff inside a vmap never batches a raw ragged dot with a shared operand. Outside a
vmap this is the plain ragged dot and its usual gradient.

XLA:GPU has no grouped matmul of its own for a ragged dot (its cuDNN one is an experimental
flag gated on the cuDNN version): it rewrites one into a dense matmul over every group, each
row masked to its own, which costs G times the rows' FLOPs and a (G, rows, k) buffer — 16 GiB
a matmul for Qwen3-30B-A3B's 16 local experts (its preset held 98.3 GiB per device, XLA's
peak). On GPUs the product runs `by_pieces` instead: a loop over pieces of at most `rows`
rows of one group, each a plain matmul with that group's weights; pieces past the rows there
skip their work. XLA:CPU's expansion is kept (tiny models, exact); libtpu has its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.annotate import RUNS_SCOPE


def _batchable(fn):
    """`fn` under vmap: operands that are not batched are broadcast along a new first axis,
    then every operand is batched there (the one case JAX's ragged dot batches)."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(args, in_batched)]
        out = jax.vmap(fn)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


MATMUL = jax.lax.RaggedDotDimensionNumbers(  # (t, k) x (groups, k, n) -> (t, n), rows grouped
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _product(dims, rows, lhs, rhs, sizes):
    def native(lhs, rhs, sizes):
        return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)

    if rows is None or dims != MATMUL:
        return native(lhs, rhs, sizes)
    pieces = functools.partial(by_pieces, rows=rows)
    return jax.lax.platform_dependent(lhs, rhs, sizes, default=native, cuda=pieces, rocm=pieces)


def _gradients(dims, rows, lhs, rhs, sizes, cotangent):
    _, vjp = jax.vjp(lambda lhs, rhs: _product(dims, rows, lhs, rhs, sizes), lhs, rhs)
    return vjp(cotangent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def ragged_dot(dims: jax.lax.RaggedDotDimensionNumbers, lhs, rhs, sizes, rows: int | None = None):
    """`jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)`, batchable by vmap with `rhs`
    (the weights) or `sizes` shared. `rows`: on GPUs, the most rows of a piece (`by_pieces`);
    about a group's rows under even routing. None: XLA's ragged dot everywhere."""
    return _batchable(functools.partial(_product, dims, rows))(lhs, rhs, sizes)


def _forward(dims, lhs, rhs, sizes, rows):
    return ragged_dot(dims, lhs, rhs, sizes, rows), (lhs, rhs, sizes)


def _backward(dims, rows, saved, cotangent):
    lhs, rhs, sizes = saved
    d_lhs, d_rhs = _batchable(functools.partial(_gradients, dims, rows))(lhs, rhs, sizes, cotangent)
    return d_lhs, d_rhs, None


ragged_dot.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def by_pieces(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, rows: int) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, sizes)` (lhs (t, k) grouped by rows, rhs (groups, k, n);
    rows past the groups give zeros) as a loop over pieces of at most `rows` rows, each
    within one group: one matmul of a piece's rows with its group's weights, written over
    those rows alone. A group of r rows takes ceil(r / rows) pieces, so t / rows + groups
    bound their number (the loop's length); the pieces past the rows there skip their work.
    The gradient keeps the operands alone (not every piece's rows) and runs two such loops."""
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)

    def piece(out, group, at, mine):
        y = jnp.dot(_window(lhs, at, mine.shape[0]), jax.lax.dynamic_index_in_dim(rhs, group, keepdims=False),
                    preferred_element_type=jnp.float32)
        window = _window(out, at, mine.shape[0])
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y.astype(dtype), window), at, 0)

    out = jnp.zeros((lhs.shape[0], rhs.shape[-1]), dtype)
    return _over_pieces(sizes, lhs.shape[0], rows, rhs.shape[0], piece, out)


def _by_pieces_forward(lhs, rhs, sizes, rows):
    return by_pieces(lhs, rhs, sizes, rows), (lhs, rhs, sizes)


def _by_pieces_backward(rows, saved, cotangent):
    lhs, rhs, sizes = saved
    d_lhs = by_pieces(cotangent, rhs.swapaxes(1, 2), sizes, rows).astype(lhs.dtype)

    def piece(d_rhs, group, at, mine):  # a piece's rows' products, summed into its group's
        x = jnp.where(mine[:, None], _window(lhs, at, mine.shape[0]), 0)
        part = jnp.dot(x.T, _window(cotangent, at, mine.shape[0]), preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(d_rhs, d_rhs[group] + part, group, 0)

    d_rhs = _over_pieces(sizes, lhs.shape[0], rows, rhs.shape[0], piece, jnp.zeros(rhs.shape, jnp.float32))
    return d_lhs, d_rhs.astype(rhs.dtype), None


by_pieces.defvjp(_by_pieces_forward, _by_pieces_backward)


def _window(x: jax.Array, at, rows: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, at, rows)


def _over_pieces(sizes, t: int, rows: int, groups: int, body, init):
    """`body(carry, group, at, mine)` over the pieces with rows: `at` the first row of a
    window of `rows` rows inside the t there are, `mine` (rows,) those of the piece."""
    rows = min(rows, t)
    count = -(-t // rows) + groups
    plan = _pieces(sizes.astype(jnp.int32), rows, count)

    def piece(carry, plan):
        group, start, length = plan

        # Under even routing (`rows` a group's rows then) one piece per group has rows:
        # the planner counts a piece's work, and its sum over a split k, that often.
        @jax.named_scope(RUNS_SCOPE.format(groups, count))
        def run(carry):
            at = jnp.minimum(start, t - rows)  # the window stays inside; rows outside the piece masked
            row = at + jnp.arange(rows)
            return body(carry, group, at, (row >= start) & (row < start + length))

        return jax.lax.cond(length > 0, run, lambda carry: carry, carry), None

    return jax.lax.scan(piece, init, plan)[0]


def _pieces(sizes: jax.Array, rows: int, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`count` pieces of the rows `sizes` groups, at most `rows` each and each within one
    group: every piece's group, first row and number of rows (0 for the pieces not needed)."""
    needed = (sizes + rows - 1) // rows
    ends = jnp.cumsum(needed)
    piece = jnp.arange(count)
    group = jnp.searchsorted(ends, piece, side="right")
    used = group < sizes.shape[0]
    group = jnp.minimum(group, sizes.shape[0] - 1)
    within = piece - (ends - needed)[group]  # the piece's place in its group
    start = (jnp.cumsum(sizes) - sizes)[group] + within * rows
    length = jnp.where(used, jnp.clip(sizes[group] - within * rows, 0, rows), 0)
    return group, start, length


@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """`x[order]` for a permutation `order` whose inverse is `inverse`, with the gradient
    `cotangent[inverse]`: a gather both ways. Autodiff would scatter-add the cotangent,
    which XLA:GPU runs on 32-bit words, a buffer twice the rows' in bfloat16."""
    return x[order]


def _permute_forward(x, order, inverse):
    return x[order], (order, inverse)


def _permute_backward(saved, cotangent):
    order, inverse = saved
    return cotangent[inverse], None, None


permute_rows.defvjp(_permute_forward, _permute_backward)


def inverse_permutation(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
