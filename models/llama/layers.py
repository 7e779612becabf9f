"""The small parts every block of the Llama family is made of: parameters as the model
makes them (named, unsharded until the trainer places them), RMSNorm, rotary embeddings,
and where a decoding step writes into the key/value cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.annotate import weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoding:
    """Where new tokens go in a key/value cache: the same slots for every row, from `slot`
    on; `valid` (batch, cache length) marks the slots that hold a row's tokens (a row's
    left padding does not)."""

    slot: jax.Array  # int32 scalar
    valid: jax.Array  # bool (batch, cache length)

    def slots(self, n: int) -> jax.Array:
        return self.slot + jnp.arange(n)


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    # Sharding is applied by whoever builds the model (jit out_shardings), not here.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _ones(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32), out_sharding=names, eager_sharding=False)


def zeros_param(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """`dim`: the normed size, or a shape whose elements are normed together (the last
    len(shape) axes: OLMo 2's q and k norms over whole projections, (heads, head_dim));
    `offset`: scaled by 1 + its weight, which starts at 0 (Gemma's form)."""

    def __init__(self, dim: int | tuple[int, ...], eps: float, names: tuple[str, ...] = ("embed",),
                 offset: bool = False):
        shape = (dim,) if isinstance(dim, int) else tuple(dim)
        self.scale = zeros_param(shape, names) if offset else _ones(shape, names)
        self.eps, self.offset = eps, offset
        self.axes = -1 if len(shape) == 1 else tuple(range(-len(shape), 0))

    def __call__(self, x: jax.Array, copies: int = 1) -> jax.Array:
        """`copies`: how many times x holds each row of a scale of several axes (the key
        heads' copies when tp splits them more finely, models.annotate.copies): the mean
        over the copies is the mean over the rows, and the scale is repeated to match."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=self.axes, keepdims=True) + self.eps)
        scale = weight(self.scale, jnp.float32)
        scale = jnp.repeat(scale, copies, axis=0) if copies > 1 else scale
        return (normed * (1.0 + scale if self.offset else scale)).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """Rotate pairs (i, i + d/2) of the last dimension by position x frequency. `positions`:
    (seq,) for every row, or (batch, seq)."""
    angles = positions[..., None].astype(jnp.float32) * freqs  # (seq, half) or (batch, seq, half)
    angles = angles if angles.ndim == 3 else angles[None]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
