"""Causal attention for one device, and the hook through which a trainer swaps in a
sequence-parallel implementation (spmd.context) without the model knowing.

Masks compare positions, not indices, so the sequence may arrive in any order (a
load-balanced layout reorders it): a query sees the keys at positions up to its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.swap import Swappable


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     k_positions: jax.Array) -> jax.Array:
    """q (batch, s, kv_heads, groups, head_dim); k, v (batch, t, kv_heads, head_dim);
    positions (s,) and (t,). Query head (kv, g) reads key/value head kv (grouped-query)."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    visible = q_positions[:, None] >= k_positions[None, :]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_slots: jax.Array, valid: jax.Array) -> jax.Array:
    """Queries at cache slots `q_slots` (s,) against a whole key/value cache (batch, kv_heads,
    t, head_dim): a query sees the slots up to its own that `valid` (batch, t) marks."""
    scores = jnp.einsum("bskgd,bktd->bkgst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    visible = (jnp.arange(k.shape[2])[None, :] <= q_slots[:, None])[None] & valid[:, None, :]  # (b, s, t)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,bktd->bskgd", probs, v)


def _one_device(q, k, v, positions):
    return causal_attention(q, k, v, positions, positions)


# Causal self-attention of a sequence with the given positions: attend(q, k, v, positions)
# is what models call; `attention_implementation(f)` swaps in f (e.g. ring attention).
attend = Swappable("attention", _one_device)
attention_implementation = attend.use
