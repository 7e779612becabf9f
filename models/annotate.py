"""Logical-axis annotations for activations.

Models name activation dimensions with logical names only. Whoever runs the model
(spmd.step) decides what those names mean by setting flax's logical axis rules and a
mesh; without them this is the identity, so a model runs unchanged on one device.
"""

import jax
from flax.core import spmd as flax_spmd


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Ask XLA to lay `x` out as the active rules map `names` (one per dimension)."""
    rules = dict(flax_spmd.get_logical_axis_rules())
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    spec = jax.P(*(rules.get(n) if n is not None else None for n in names))
    return jax.lax.with_sharding_constraint(x, spec)


def weight(param, dtype) -> jax.Array:
    """A parameter's value as computed with: laid out by its logical names under the
    activation rules (e.g. gathered over the axes it is stored split over), cast to `dtype`."""
    names = param.get_metadata().get("out_sharding") or ()
    value = param[...]
    if len(names) == value.ndim:
        value = constrain(value, *names)
    return value.astype(dtype)
