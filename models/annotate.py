"""Logical-axis annotations for activations.

Models name activation dimensions with logical names only. Whoever runs the model
(spmd.parallel.step) decides what those names mean by setting flax's logical axis rules and a
mesh; without them this is the identity, so a model runs unchanged on one device.
"""

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

ACTIVATION = "activation"  # checkpoint name of `constrain`'s result, for remat policies
# The top-level parameter holding a model's multi-token prediction modules (models.deepseek3's `mtp`).
PREDICTIONS = "mtp"
UP_PROJECTED = "up_projected"  # MLA's per-head queries, keys and values (models.deepseek3), which remat "mla" recomputes
# The logical names of stacked layers' leading axis: the layers pipeline stages split, and
# a prefix of layers run before them (models.deepseek3's dense ones), each run by a scan.
LAYERS, PREFIX_LAYERS = "layers", "prefix_layers"
# A conditional branch's name scope saying how many of its loop's trips take it (runs, trips);
# the compiled program keeps it in its metadata and spmd.planner.hlo weighs the branch by it.
RUNS_SCOPE = "runs_{}_of_{}"
_STORAGE: contextvars.ContextVar = contextvars.ContextVar("storage", default=None)
# Whether a layout constraint leaves its operand split as it is: on jax 0.10.2 (the floor)
# the operand was gathered whole (in float32) to it; jax 0.12 keeps the split.
_LAYOUT_KEEPS_SHARDING = jax.__version_info__ >= (0, 12)
_COPIES: contextvars.ContextVar = contextvars.ContextVar("copies", default={})


def constrain(x: jax.Array, *names: str | None, saved_as: str = ACTIVATION) -> jax.Array:
    """Ask XLA to lay `x` out as the active rules map `names` (one per dimension); the
    result is named as an activation (or `saved_as`), which remat policies may keep."""
    return checkpoint_name(_lay_out(x, names, dict(flax_spmd.get_logical_axis_rules())), saved_as)


def weight(param, dtype, lay_out: bool = True) -> jax.Array:
    """A parameter's value as computed with: cast to `dtype` where it is stored (so a bf16
    run gathers bf16), then laid out by its logical names under the activation rules
    (e.g. gathered over the axes it is stored split over). Its gradient is reduced to
    where gradients are stored, inside the backward pass. Not named: remat policies do
    not keep it, so the backward pass fetches it again rather than holding every layer's
    copy. `lay_out=False`: as stored, for a part of an `assembled` matrix, which is laid
    out whole."""
    names = param.get_metadata().get("out_sharding") or ()
    value = param[...]
    storage = _STORAGE.get()
    activations = dict(flax_spmd.get_logical_axis_rules()) if lay_out else {}
    if len(names) != value.ndim or storage is None or jax.sharding.get_abstract_mesh().empty:
        return _lay_out(value.astype(dtype), names, activations)
    stored = _cast_in_place(value, jnp.dtype(dtype), _spec(names, storage.params), _spec(names, storage.grads))
    return _lay_out(stored, names, activations)


def assembled(x: jax.Array, *names: str | None) -> jax.Array:
    """A matrix put together from weights (e.g. two concatenated), laid out by `names` to
    compute with; its gradient is laid out as stored gradients of those names are, before
    it is taken apart again, so that XLA reduces it to its stored split as it would each
    weight's (rather than reducing the whole)."""
    storage = _STORAGE.get()
    activations = dict(flax_spmd.get_logical_axis_rules())
    if storage is None or jax.sharding.get_abstract_mesh().empty:
        return _lay_out(x, names, activations)
    return _assembled(x, _spec(names, activations), _spec(names, storage.grads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _assembled(x: jax.Array, value_spec: jax.P, grad_spec: jax.P) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, value_spec)


def _assembled_fwd(x, value_spec, grad_spec):
    return _assembled(x, value_spec, grad_spec), None


def _assembled_bwd(value_spec, grad_spec, _, cotangent):
    # Reduced where computed (in the compute dtype, as a weight's gradient is), then split
    # as stored: XLA forms one reduce-scatter of it.
    reduced = jax.lax.with_sharding_constraint(cotangent, value_spec)
    return (jax.lax.with_sharding_constraint(reduced, grad_spec),)


_assembled.defvjp(_assembled_fwd, _assembled_bwd)


def copies(name: str) -> int:
    """How many copies of each entry of the dimension `name` a model computes with (1
    unless the trainer asks for more, `computed_copies`): a finer split than the
    dimension has, with the same result (e.g. key/value heads shared by the devices that
    split the query heads)."""
    return _COPIES.get().get(name, 1)


@contextlib.contextmanager
def computed_copies(table: Mapping[str, int]):
    token = _COPIES.set(dict(table))
    try:
        yield
    finally:
        _COPIES.reset(token)


@dataclasses.dataclass(frozen=True)
class Storage:
    """Where parameters and their gradients live: logical name -> mesh axes."""

    params: Mapping[str, object]
    grads: Mapping[str, object]
    moves_rows: bool = True  # lookups move their rows to the table (models.lookup); else gather it


def stored_where() -> Storage | None:
    """Where the trainer stores parameters and gradients (`storage`), if it said."""
    return _STORAGE.get()


@contextlib.contextmanager
def storage(where: Storage):
    """Tell `weight` where parameters and gradients are stored (set by spmd.parallel.step)."""
    token = _STORAGE.set(where)
    try:
        yield
    finally:
        _STORAGE.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_in_place(x: jax.Array, dtype, value_spec: jax.P, grad_spec: jax.P) -> jax.Array:
    # Read as stored (row-major): else XLA:GPU lays the whole stack of a layer scan out
    # again, split dimension first, for the gathers, and keeps that float32 copy through
    # the step (6.7 GiB on Qwen3-30B-A3B's preset); this way each layer's slice is laid
    # out as it is cast. Not on jax 0.10, whose constraint gathers its operand whole.
    if _LAYOUT_KEEPS_SHARDING:
        x = with_layout_constraint(x, Layout(tuple(range(x.ndim))))
    return jax.lax.with_sharding_constraint(x.astype(dtype), value_spec)


def _cast_in_place_fwd(x, dtype, value_spec, grad_spec):
    return _cast_in_place(x, dtype, value_spec, grad_spec), jnp.zeros((), x.dtype)


def _cast_in_place_bwd(dtype, value_spec, grad_spec, like, cotangent):
    return (jax.lax.with_sharding_constraint(cotangent, grad_spec).astype(like.dtype),)


_cast_in_place.defvjp(_cast_in_place_fwd, _cast_in_place_bwd)


def _spec(names, rules: Mapping[str, object]) -> jax.P:
    return spec_of(names, rules)


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one rules-table entry (an axis, a tuple of them, None, unconstrained)."""
    if entry is None or entry is jax.P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_of(names, rules: Mapping[str, object]) -> jax.P:
    """The PartitionSpec of an array from its dimensions' names. A mesh axis splits an
    array once: where two dimensions name it (ZeRO's axes follow `embed`, and an expert's
    weight names ep on its `experts` dimension too), it stays with the dimension that
    names it earliest in its entry."""
    entries = [rules.get(n) if n is not None else None for n in names]
    listed = [axes_of(e) for e in entries]
    first = {}
    for dim, axes in enumerate(listed):
        for place, axis in enumerate(axes):
            if axis not in first or place < first[axis][0]:
                first[axis] = (place, dim)
    out = []
    for dim, (entry, axes) in enumerate(zip(entries, listed)):
        kept = tuple(a for a in axes if first[a][1] == dim)
        out.append(entry if kept == axes else kept[0] if len(kept) == 1 else kept or None)
    return jax.P(*out)


def _lay_out(x: jax.Array, names, rules: Mapping[str, object]) -> jax.Array:
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, _spec(names, rules))
