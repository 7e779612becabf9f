"""Checksums of arrays that do not depend on how the arrays are sharded.

Each element's bits, read as an unsigned integer, are mixed with a hash of the element's
position in the whole array (row-major) by a bijective hash (murmur3's finalizer), and
the results summed, all in wrapping uint32 arithmetic. Integer sums are exact and do not
depend on the order of the additions, so any mesh, any sharding, any number of devices
gives the same value. The hash is a bijection for each position, so a change to any one
element (one flipped bit) always changes the sum; two elements swapped, or several
changed, leave it equal only by a 1-in-2^32 chance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection of uint32 that spreads every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's flat (row-major) index in the whole array, as uint32 (wrapping)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def array_checksum(x: jax.Array) -> jax.Array:
    """A uint32 scalar: the wrapping sum over elements of mix(bits ^ mix(position))."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize in _UNSIGNED:
        bits = lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
    else:  # 64-bit elements become two uint32 words (a trailing dimension of 2)
        bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.sum(_mix(bits ^ _mix(_positions(bits.shape))), dtype=jnp.uint32)


@jax.jit
def _checksums(leaves: list) -> list:
    return [array_checksum(x) for x in leaves]


def key_path(path) -> str:
    """A pytree key path as `a/b/0/mu/...`."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def checksums(items: dict) -> dict[str, dict[str, int]]:
    """{item: {key path: checksum}} of every array of each item (e.g. params, opt_state),
    computed on the arrays' devices in one program, fetched with one transfer."""
    flat = {name: jax.tree_util.tree_flatten_with_path(tree)[0] for name, tree in items.items()}
    leaves = [leaf for pairs in flat.values() for _, leaf in pairs]
    values = iter(jax.device_get(_checksums(leaves)))
    return {name: {key_path(path): int(next(values)) for path, _ in pairs} for name, pairs in flat.items()}
