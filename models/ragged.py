"""A grouped matmul (`jax.lax.ragged_dot_general`) that `jax.vmap` can batch.

JAX batches a ragged dot only when every operand is batched along its first axis ("ragged_dot
vmap over any dim but 0 - NYI", jax 0.10.2 and 0.12), so a vmap over token shards with the
expert weights shared (gradient accumulation's per-shard map) fails. Here the forward
and the backward product are each given a batching rule that broadcasts the shared
operands first, and the gradient is written with those two (`jax.custom_vjp`), so that
autodiff inside a vmap never batches a raw ragged dot with a shared operand. Outside a
vmap this is the plain ragged dot and its usual gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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


def _product(dims, lhs, rhs, sizes):
    return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)


def _gradients(dims, lhs, rhs, sizes, cotangent):
    _, vjp = jax.vjp(lambda lhs, rhs: _product(dims, lhs, rhs, sizes), lhs, rhs)
    return vjp(cotangent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ragged_dot(dims: jax.lax.RaggedDotDimensionNumbers, lhs, rhs, sizes):
    """`jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)`, batchable by vmap with `rhs`
    (the weights) or `sizes` shared."""
    return _batchable(functools.partial(_product, dims))(lhs, rhs, sizes)


def _forward(dims, lhs, rhs, sizes):
    return ragged_dot(dims, lhs, rhs, sizes), (lhs, rhs, sizes)


def _backward(dims, saved, cotangent):
    lhs, rhs, sizes = saved
    d_lhs, d_rhs = _batchable(functools.partial(_gradients, dims))(lhs, rhs, sizes, cotangent)
    return d_lhs, d_rhs, None


ragged_dot.defvjp(_forward, _backward)

MATMUL = jax.lax.RaggedDotDimensionNumbers(  # (t, k) x (groups, k, n) -> (t, n), rows grouped
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
