"""Causal attention for one device, its kernels, and the hook through which a trainer
swaps in a kernel or a sequence-parallel implementation (spmd.parallel.context) without the model
knowing.

Masks compare positions, not indices, so the sequence may arrive in any order (a
load-balanced layout reorders it): a query sees the keys at positions up to its own.
Packed rows (several examples in one row, `Packing`) add segment ids: a query sees only
the keys of its own example.

Kernels (`KERNELS`), each `kernel(q, k, v, q_positions, k_positions, q_segments=None,
k_segments=None)` (segments: (batch, s) and (batch, t) example ids, or None for one
example per row):
- xla: the scores materialized (seq x seq per head), softmax, values: the reference.
- chunked: flash-style in plain JAX (models.flash): memory linear in the sequence.
- cudnn: cuDNN's fused flash attention (`jax.nn.dot_product_attention`), NVIDIA GPUs.
- splash: Pallas splash attention, TPUs.
The fused kernels read the causal mask from indices, so they take only positions known
while tracing to be 0, 1, 2, ...; other cases go to the chunked kernel, with a line
saying so (`fallback`), never silently wrong. cuDNN's path has no segment ids: packed
rows go to the chunked kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models import flash
from models.swap import Swappable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
    """Examples packed into rows: the example each token belongs to (`segments`: 1, 2, ...
    in a row, 0 for padding) and its position inside it (`positions`, from 0 at each
    example's start: what the rotary embedding reads). Both int32 (batch, seq)."""

    segments: jax.Array
    positions: jax.Array


def same_segment(q_segments, k_segments) -> jax.Array | None:
    """(batch, s, t): whether query and key belong to one example; None without segments."""
    if q_segments is None:
        return None
    return q_segments[:, :, None] == k_segments[:, None, :]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     k_positions: jax.Array, q_segments=None, k_segments=None) -> jax.Array:
    """q (batch, s, kv_heads, groups, head_dim); k, v (batch, t, kv_heads, head_dim);
    positions (s,) and (t,); segments (batch, s) and (batch, t) or None. Query head (kv, g)
    reads key/value head kv (grouped-query)."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    # jnp, not numpy: positions may be numpy constants, and the mask is seq x seq.
    visible = jnp.asarray(q_positions)[:, None] >= jnp.asarray(k_positions)[None, :]
    same = same_segment(q_segments, k_segments)
    visible = visible if same is None else (visible[None] & same)[:, None, None]
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


def cudnn_attention(q, k, v, q_positions, k_positions, q_segments=None, k_segments=None):
    b, s, kv, g, d = q.shape
    why = (f"it takes bfloat16 or float16, not {q.dtype}" if q.dtype not in (jnp.bfloat16, jnp.float16)
           else "the positions are not 0, 1, 2, ... (its causal mask reads indices)"
           if not in_order(q_positions, k_positions)
           else "its path in JAX takes no segment ids (packed rows)" if q_segments is not None else None)
    if why:
        return fallback("cudnn", why)(q, k, v, q_positions, k_positions, q_segments, k_segments)
    # Query head (kv, g) is head kv * groups + g: the one jax maps to key/value head kv.
    out = jax.nn.dot_product_attention(q.reshape(b, s, kv * g, d), k, v, is_causal=True, implementation="cudnn")
    return out.reshape(q.shape)


SPLASH_BLOCKS = (512, 256, 128)  # block sizes splash attention tiles the sequence with, largest first


def splash_attention(q, k, v, q_positions, k_positions, q_segments=None, k_segments=None, interpret: bool = False):
    """`interpret`: run the Pallas kernel in its interpreter (any backend; for tests).
    Packed rows: splash's own segment ids."""
    # Imported here: the TPU kernels' modules are not needed, and not imported, elsewhere.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, s, kv, g, d = q.shape
    block = next((n for n in SPLASH_BLOCKS if s % n == 0), None)
    if block is None or not in_order(q_positions, k_positions):
        why = (f"the sequence ({s}) is no multiple of {SPLASH_BLOCKS[-1]}" if block is None
               else "the positions are not 0, 1, 2, ... (its causal mask reads indices)")
        return fallback("splash", why)(q, k, v, q_positions, k_positions, q_segments, k_segments)
    sizes = kernels.BlockSizes(**{name: block for name in (
        "block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
        "block_q_dq", "block_kv_dq")})
    # One kernel per key/value head: its query heads share it (multi-query form).
    kernel = kernels.make_splash_mqa_single_device(
        masks.MultiHeadMask([masks.CausalMask((s, s))] * g), block_sizes=sizes, interpret=interpret)
    heads_first = (q / math.sqrt(d)).astype(q.dtype).transpose(0, 2, 3, 1, 4)  # (b, kv, g, s, d): splash does not scale
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if q_segments is None:
        out = jax.vmap(jax.vmap(kernel))(heads_first, keys, values)
    else:  # one row's segment ids for all its kv heads
        def row(q, k, v, q_segments, k_segments):
            ids = kernels.SegmentIds(q=q_segments, kv=k_segments)
            return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q, k, v)
        out = jax.vmap(row)(heads_first, keys, values, q_segments, k_segments)
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)


KERNELS = {"xla": causal_attention, "chunked": flash.attention, "cudnn": cudnn_attention, "splash": splash_attention}


def in_order(q_positions, k_positions) -> bool:
    """Whether both are known while tracing (not traced values) to be 0, 1, 2, ... of one length."""
    try:
        q_at, k_at = np.asarray(q_positions), np.asarray(k_positions)
    except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
    return q_at.shape == k_at.shape and q_at.ndim == 1 and np.array_equal(q_at, np.arange(q_at.size))


_told: set[tuple[str, str]] = set()


def fallback(kernel: str, why: str):
    """The chunked kernel, for a case `kernel` cannot take; says so once per case."""
    if (kernel, why) not in _told:
        _told.add((kernel, why))
        print(f"attention: the {kernel} kernel cannot take this call ({why}); using the chunked kernel", flush=True)
    return flash.attention


def kernel_attention(kernel):
    """attend(q, k, v, positions) with `kernel` (a callable of KERNELS' form)."""
    return functools.partial(_self_attention, kernel)


def _self_attention(kernel, q, k, v, positions, segments=None):
    return kernel(q, k, v, positions, positions, segments, segments)


# Causal self-attention of a sequence with the given positions (and segment ids, for
# packed rows): attend(q, k, v, positions, segments=None) is what models call;
# `attention_implementation(f)` swaps in f (e.g. ring attention).
attend = Swappable("attention", kernel_attention(causal_attention))
attention_implementation = attend.use
