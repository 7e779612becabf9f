"""The embedding lookup, written so that the table stays where it is stored.

Gathered for the lookup as other weights are for their matmuls, the table's gradient is
the gather's transpose: the whole table, summed over every axis that splits the tokens,
before each device keeps its slice. XLA:GPU ran that as an all-reduce of the whole float32
table (2.2 GiB a step on Qwen3-30B-A3B's fsdp+ep preset). A device's rows are far fewer
than the table's (a few thousand tokens against a vocabulary of 10^5), so here the rows
travel instead, where the trainer stores the table split along embed over token axes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd

from models.annotate import Storage, axes_of, spec_of, stored_where, weight


def looked_up(param, tokens: jax.Array, dtype=jnp.float32, scale: float | None = None) -> jax.Array:
    """The rows of the table `param` (vocab, embed) that `tokens` (batch, seq) name, read
    in float32 (a lookup has no FLOPs to save), times `scale` if given, in `dtype`.

    Where the table is stored split along embed over axes that split the tokens too (fsdp,
    sp), the table stays where it is and the rows move: each device is sent the token ids
    of the others on those axes (an all-gather), looks up its columns of all their rows,
    and sends each its rows back (an all-to-all, in `dtype`); the gradient takes the way
    back, each device adding every row's columns into its own shard, then summing that
    shard over the other token axes (ep, dp). Elsewhere the table is gathered."""
    route = _rows_route(param, tokens)

    def read(table, ids):
        rows = _take(table, ids)
        return (rows if scale is None else rows * jnp.float32(scale)).astype(dtype)

    if route is None:
        return read(weight(param, jnp.float32), tokens)
    return _rows(weight(param, jnp.float32, lay_out=False), tokens, (*route, read))


def _rows_route(param, tokens: jax.Array):
    """`rows_route` where `param` is used, with the table's gradient spec; None inside a
    manual map, for another table than a (vocab, embed) one, or tokens its axes do not
    divide."""
    storage, mesh = stored_where(), jax.sharding.get_abstract_mesh()
    names = tuple(param.get_metadata().get("out_sharding") or ())
    if storage is None or mesh.empty or mesh.manual_axes or tokens.ndim != 2 or names != ("vocab", "embed"):
        return None
    route = rows_route(storage, dict(flax_spmd.get_logical_axis_rules()), dict(mesh.shape))
    if route is None or any(n % math.prod(mesh.shape[a] for a in axes) for n, axes in zip(tokens.shape, route[0])):
        return None  # (one new token a step, say, where sp splits the sequence)
    return (*route, spec_of(names, storage.grads))


def rows_route(storage: Storage, rules: Mapping[str, object], mesh_shape: Mapping[str, int]):
    """How `looked_up` moves a lookup's rows: (the mesh axes splitting the tokens' batch
    and sequence dimensions, the axes the table's embed dimension is stored split over,
    which the rows move along), or None where the table is gathered instead: the
    vocabulary split (tp), the table's value and gradient stored apart (ZeRO-2), or
    stored split over an axis that does not split the tokens."""
    def live(table, name) -> tuple[str, ...] | None:  # None: left to XLA
        entry = table.get(name)
        return None if entry is jax.P.UNCONSTRAINED else tuple(a for a in axes_of(entry) if mesh_shape.get(a, 1) > 1)

    stored = live(storage.params, "embed")
    if not storage.moves_rows or not stored or stored != live(storage.grads, "embed") \
            or live(rules, "vocab") or live(storage.params, "vocab") or live(storage.grads, "vocab"):
        return None
    dims = (live(rules, "batch"), live(rules, "residual_seq"))
    if None in dims or not set(stored) <= {a for d in dims for a in d}:
        return None
    return dims, stored


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rows(table: jax.Array, tokens: jax.Array, route) -> jax.Array:
    return _rows_forward(table, tokens, route)[0]


def _rows_forward(table, tokens, route):
    dims, moved, _, read = route
    cut, computed = _cut(tokens.shape, dims)
    steps = _moves(computed, moved)
    here = _through(tokens.reshape(cut), jax.P(*computed), *(jax.P(*s) for s, _ in steps))  # the moved axes' ids
    rows, back = jax.vjp(lambda table: read(table, here), table)
    rows = _through(rows, *(jax.P(*s, e) for s, e in reversed(steps)), jax.P(*computed, None))
    return rows.reshape(*tokens.shape, table.shape[-1]), back


def _rows_backward(route, back, cotangent):
    dims, moved, grad_spec, _ = route
    cut, computed = _cut(cotangent.shape[:-1], dims)
    steps = _moves(computed, moved)
    rows = _through(cotangent.reshape(*cut, cotangent.shape[-1]), jax.P(*computed, None),
                    *(jax.P(*s, e) for s, e in steps))
    return jax.lax.with_sharding_constraint(back(rows)[0], grad_spec), None


def _cut(shape: tuple[int, ...], dims) -> tuple[list[int], list]:
    """Each token dimension cut into one per mesh axis that splits it, major first, then
    the rest: the shape, and its split as computed (so that moving an axis to the embed
    dimension or back is an all-to-all, not a reshuffle)."""
    sizes = jax.sharding.get_abstract_mesh().shape
    cut, computed = [], []
    for n, axes in zip(shape, dims):
        ways = [sizes[a] for a in axes]
        cut += [*ways, n // math.prod(ways)]
        computed += [*axes, None]
    return cut, computed


def _moves(computed: list, moved: tuple[str, ...]) -> list[tuple[list, tuple[str, ...]]]:
    """The token dimensions' and the embed dimension's axes after moving each of `moved`
    in turn: one all-to-all over one axis a step (moved at once from two dimensions, XLA
    gathered the rows instead)."""
    return [([None if a in moved[:i + 1] else a for a in computed], moved[:i + 1]) for i in range(len(moved))]


def _through(x: jax.Array, *specs: jax.P) -> jax.Array:
    for spec in specs:
        x = jax.lax.with_sharding_constraint(x, spec)
    return x


_rows.defvjp(_rows_forward, _rows_backward)


def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`jnp.take(table, ids, axis=0)`, whose gradient's zeros are made only once the rows'
    gradient exists: as autodiff writes them they are a constant, which XLA:CPU computes
    at the step's start and holds through the step (the table's size: 3.45 GiB in float32
    on DeepSeek-V3, beside the pipeline's whole heap)."""
    return _take_rows(table, ids, (table.shape, table.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_rows(table, ids, like):
    return jnp.take(table, ids, axis=0)


def _take_forward(table, ids, like):
    return jnp.take(table, ids, axis=0), ids


def _take_backward(like, ids, cotangent):
    shape, dtype = like
    # The rows' gradient is read from the barrier too: XLA drops a barrier's unused outputs,
    # and with them the order.
    zero, cotangent = jax.lax.optimization_barrier((jnp.zeros((), dtype), cotangent))
    return jnp.full(shape, zero).at[ids].add(cotangent.astype(dtype)), None


_take_rows.defvjp(_take_forward, _take_backward)
