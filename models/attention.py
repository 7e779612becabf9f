"""Causal attention for one device, its kernels, and the hook through which a trainer
swaps in a kernel or a sequence-parallel implementation (spmd.parallel.context) without the model
knowing.

Masks compare positions, not indices, so the sequence may arrive in any order (a
load-balanced layout reorders it): a query sees the keys at positions up to its own.
Packed rows (several examples in one row, `Packing`) add segment ids: a query sees only
the keys of its own example. A sliding window of w (Mistral, Gemma 3's local layers)
hides the keys w or more positions before the query: it sees w keys, itself included
(transformers' `sliding_window`). Windows and segments combine.

Kernels (`KERNELS`), each `kernel(q, k, v, mask)`, the keys each query sees described by
a `Mask` (positions; segments: (batch, s) and (batch, t) example ids, or None for one
example per row; window: an int, or None for none):
- xla: the scores materialized, softmax, values: the reference. seq x seq per head; with
  a window and positions in order, a band of 2 windows per query block, so that memory
  and FLOPs grow with seq x window.
- chunked: flash-style in plain JAX (models.flash): memory linear in the sequence; the
  blocks a window hides are skipped.
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_positions", "k_positions", "q_segments",
                                                                 "k_segments"], meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class Mask:
    """Which keys each query of a kernel's call sees: those at positions up to its own
    (`q_positions` (s,), `k_positions` (t,)), of its own example where rows are packed
    (`q_segments` (batch, s), `k_segments` (batch, t), or None), and fewer than `window`
    positions back (an int, static while tracing; None for no window). The arrays are
    leaves of a pytree, so a mask passes through `lax.cond` and `custom_vjp` as its
    arrays do; positions known while tracing stay numpy (`in_order` reads them)."""

    q_positions: object
    k_positions: object
    q_segments: object = None
    k_segments: object = None
    window: int | None = None


def same_segment(q_segments, k_segments) -> jax.Array | None:
    """(batch, s, t): whether query and key belong to one example; None without segments."""
    if q_segments is None:
        return None
    return q_segments[:, :, None] == k_segments[:, None, :]


def visible(q_positions, k_positions, window: int | None = None) -> jax.Array:
    """(s, t): whether each key is visible to each query: at or before it, and inside the window."""
    # jnp, not numpy: positions may be numpy constants, and the mask is s x t.
    behind = jnp.asarray(q_positions)[..., :, None] - jnp.asarray(k_positions)[..., None, :]
    return (behind >= 0) if window is None else (behind >= 0) & (behind < window)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> jax.Array:
    """q (batch, s, kv_heads, groups, head_dim); k, v (batch, t, kv_heads, head_dim);
    `mask`: which keys each query sees. Query head (kv, g) reads key/value head kv
    (grouped-query)."""
    window = mask.window
    if window is not None and window < k.shape[1] and in_order(mask.q_positions, mask.k_positions):
        return _banded_attention(q, k, v, mask.q_segments, window)
    shown = visible(mask.q_positions, mask.k_positions, window)
    same = same_segment(mask.q_segments, mask.k_segments)
    shown = shown if same is None else (shown[None] & same)[:, None, None]
    return _softmax_values(q, k, v, shown)


def _softmax_values(q, k, v, mask) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v over the keys `mask` shows (broadcast to (b, kv, g, s, t))."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v)


def _banded_attention(q, k, v, segments, window: int) -> jax.Array:
    """`causal_attention` of a sequence in order under a window: queries in blocks of one
    window, each against the keys of its block and the one before (all it can see), so
    the scores are (seq x 2 window) per head, not (seq x seq)."""
    b, s = q.shape[:2]
    n = -(-s // window)
    pad = n * window - s  # padding at the end: after every real query, so never visible to one

    def blocks(x, before: bool):
        """(b, s, ...) -> (b * n, window, ...) blocks; `before`: each block's predecessor
        (zeros before the first) and itself, (b * n, 2 window, ...)."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(b, n, window, *x.shape[2:])
        if before:
            previous = jnp.pad(x[:, :-1], [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
            x = jnp.concatenate([previous, x], axis=2)
        return x.reshape(b * n, -1, *x.shape[3:])

    q_at = np.arange(window)  # positions relative to the block's start
    k_at = np.arange(-window, window)
    mask = visible(q_at, k_at, window) & (np.arange(n)[:, None, None] * window + k_at >= 0)  # (n, w, 2w)
    if segments is not None:  # the first block's missing keys and the end's padding are hidden by position
        same = same_segment(blocks(segments, False), blocks(segments, True)).reshape(b, n, window, 2 * window)
        mask = mask[None] & same
    mask = jnp.broadcast_to(mask, (b, n, window, 2 * window)).reshape(b * n, 1, 1, window, 2 * window)
    out = _softmax_values(blocks(q, False), blocks(k, True), blocks(v, True), mask)
    return out.reshape(b, n * window, *q.shape[2:])[:, :s]


DECODE_CHUNK = 128  # cache slots a decoding query reads at a time


def cached_attention(q: jax.Array, read, length: int, q_slots: jax.Array, valid: jax.Array,
                     window=None) -> jax.Array:
    """Queries at consecutive cache slots `q_slots` (s,) against a key/value cache of
    `length` slots, which `read(start, size)` returns a piece of ((batch, kv_heads, size,
    head_dim) keys and values): a query sees the slots up to its own that `valid` (batch,
    length) marks, and inside the window (a row's tokens take consecutive slots, so slots
    count positions; `window` may be traced, None for none).

    Only the chunks of DECODE_CHUNK slots from the window's start to the last query's
    slot are read, merged by an online softmax, so a new token costs what its context
    holds, not what the cache could hold."""
    b, s, kv, g, d = q.shape
    chunk = min(DECODE_CHUNK, length)
    first = 0 if window is None else jnp.maximum(q_slots[0] - window + 1, 0)
    few = s * g <= 8  # a token's queries (not a prompt's): products as multiply-and-sum, see _scores

    def visit(n, state):
        out, top, total = state
        # The last chunk ends at the cache's end; it may overlap the one before, whose
        # slots it skips (`fresh`).
        start = jnp.minimum(n * chunk, length - chunk)
        k, v = read(start, chunk)
        slots = start + jnp.arange(chunk)
        fresh = slots >= n * chunk
        filled = jax.lax.dynamic_slice_in_dim(valid, start, chunk, 1)  # (b, chunk)
        shown = ((visible(q_slots, slots, window) & fresh)[None] & filled[:, None])[:, None, None]  # (b, 1, 1, s, chunk)
        scores = _scores(q, k, few) / math.sqrt(d)
        new_top = jnp.maximum(top, jnp.max(jnp.where(shown, scores, flash.HIDDEN), axis=-1))
        weights = jnp.where(shown, jnp.exp(scores - new_top[..., None]), 0.0)
        rescale = jnp.exp(top - new_top)
        values = _values(weights.astype(v.dtype), v, few)
        out = out * jnp.moveaxis(rescale, -1, 1)[..., None] + values
        return out, new_top, total * rescale + jnp.sum(weights, axis=-1)

    start = (jnp.zeros(q.shape, jnp.float32), jnp.full((b, kv, g, s), flash.HIDDEN, jnp.float32),
             jnp.zeros((b, kv, g, s), jnp.float32))
    out, _, total = jax.lax.fori_loop(first // chunk, q_slots[-1] // chunk + 1, visit, start)
    # A query that sees no slot (a row's left padding in the prompt) gets zeros, not NaN.
    total = jnp.where(total > 0, total, 1.0)
    return (out / jnp.moveaxis(total, -1, 1)[..., None]).astype(q.dtype)


def _scores(q, k, few: bool) -> jax.Array:
    """float32 q k^T: (b, s, kv, g, d) x (b, kv, t, d) -> (b, kv, g, s, t). With `few`
    queries this is a matrix-vector product, which XLA:CPU's dot runs at a small fraction
    of its speed (the values' product over a chunk of 128 slots took 100 us, a third of a
    decoding step's attention): as a multiply and a sum instead (the time per token at 512
    tokens of context fell by a third). So is `_values`."""
    if not few:
        return jnp.einsum("bskgd,bktd->bkgst", q, k, preferred_element_type=jnp.float32)
    q = q.astype(jnp.float32).transpose(0, 2, 3, 1, 4)[:, :, :, :, None]  # (b, kv, g, s, 1, d)
    return jnp.sum(q * k.astype(jnp.float32)[:, :, None, None], axis=-1)


def _values(weights, v, few: bool) -> jax.Array:
    """float32 weights v: (b, kv, g, s, t) x (b, kv, t, d) -> (b, s, kv, g, d)."""
    if not few:
        return jnp.einsum("bkgst,bktd->bskgd", weights, v, preferred_element_type=jnp.float32)
    out = jnp.sum(weights.astype(jnp.float32)[..., None] * v.astype(jnp.float32)[:, :, None, None], axis=-2)
    return out.transpose(0, 3, 1, 2, 4)


def cudnn_attention(q, k, v, mask: Mask):
    b, s, kv, g, d = q.shape
    window = mask.window
    why = (f"it takes bfloat16 or float16, not {q.dtype}" if q.dtype not in (jnp.bfloat16, jnp.float16)
           else "the positions are not 0, 1, 2, ... (its causal mask reads indices)"
           if not in_order(mask.q_positions, mask.k_positions)
           else "its path in JAX takes no segment ids (packed rows)" if mask.q_segments is not None else None)
    if why:
        return fallback("cudnn", why)(q, k, v, mask)
    # Query head (kv, g) is head kv * groups + g: the one jax maps to key/value head kv.
    # A window of w: w - 1 keys before the query, none after.
    try:
        out = jax.nn.dot_product_attention(q.reshape(b, s, kv * g, d), k, v, is_causal=True, implementation="cudnn",
                                           local_window_size=None if window is None else (window - 1, 0))
    except NotImplementedError as exc:  # a shape JAX's cuDNN path refuses while tracing: Gemma 3's head dim 256
        why = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else "JAX's cuDNN path refused it"
        return fallback("cudnn", why)(q, k, v, mask)
    return out.reshape(q.shape)


SPLASH_BLOCKS = (512, 256, 128)  # block sizes splash attention tiles the sequence with, largest first


def splash_attention(q, k, v, mask: Mask, interpret: bool = False):
    """`interpret`: run the Pallas kernel in its interpreter (any backend; for tests).
    Packed rows: splash's own segment ids."""
    # Imported here: the TPU kernels' modules are not needed, and not imported, elsewhere.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, s, kv, g, d = q.shape
    window, q_segments, k_segments = mask.window, mask.q_segments, mask.k_segments
    block = next((n for n in SPLASH_BLOCKS if s % n == 0), None)
    if block is None or not in_order(mask.q_positions, mask.k_positions):
        why = (f"the sequence ({s}) is no multiple of {SPLASH_BLOCKS[-1]}" if block is None
               else "the positions are not 0, 1, 2, ... (its causal mask reads indices)")
        return fallback("splash", why)(q, k, v, mask)
    sizes = kernels.BlockSizes(**{name: block for name in (
        "block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
        "block_q_dq", "block_kv_dq")})
    # One kernel per key/value head: its query heads share it (multi-query form).
    # Causal, or a window of w: w - 1 keys before the query, none after (splash skips the
    # blocks such a mask hides).
    hidden = masks.CausalMask((s, s)) if window is None else masks.LocalMask((s, s), (window - 1, 0), offset=0)
    kernel = kernels.make_splash_mqa_single_device(masks.MultiHeadMask([hidden] * g), block_sizes=sizes,
                                                   interpret=interpret)
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
    """attend(q, k, v, positions, segments, window) with `kernel` (a callable of KERNELS' form)."""
    return functools.partial(_self_attention, kernel)


def _self_attention(kernel, q, k, v, positions, segments=None, window=None):
    return kernel(q, k, v, Mask(positions, positions, segments, segments, window))


# Causal self-attention of a sequence with the given positions (and segment ids, for
# packed rows; a window, for local attention): attend(q, k, v, positions, segments=None,
# window=None) is what models call;
# `attention_implementation(f)` swaps in f (e.g. ring attention).
attend = Swappable("attention", kernel_attention(causal_attention))
attention_implementation = attend.use
