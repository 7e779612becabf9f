"""Causal attention for one device, and the hook through which a trainer swaps in a
sequence-parallel implementation (spmd.context) without the model knowing.

Masks compare positions, not indices, so the sequence may arrive in any order (a
load-balanced layout reorders it): a query sees the keys at positions up to its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

_IMPLEMENTATION: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("attention", default=None)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     k_positions: jax.Array) -> jax.Array:
    """q (batch, s, kv_heads, groups, head_dim); k, v (batch, t, kv_heads, head_dim);
    positions (s,) and (t,). Query head (kv, g) reads key/value head kv (grouped-query)."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    visible = q_positions[:, None] >= k_positions[None, :]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal self-attention of a sequence with the given positions (what models call)."""
    implementation = _IMPLEMENTATION.get()
    if implementation is None:
        return causal_attention(q, k, v, positions, positions)
    return implementation(q, k, v, positions)


@contextlib.contextmanager
def attention_implementation(implementation: Callable | None):
    """Within this context `attend` calls `implementation(q, k, v, positions)`."""
    token = _IMPLEMENTATION.set(implementation)
    try:
        yield
    finally:
        _IMPLEMENTATION.reset(token)
