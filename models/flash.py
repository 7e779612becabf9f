"""Flash-style causal attention in plain JAX: the sequence in blocks, an online softmax,
and a backward pass that recomputes each block's scores instead of keeping them, so
memory grows linearly in the sequence (no seq x seq score matrix is ever whole).

Its pieces serve two callers: `attention` (one device, or one device's heads and rows)
and ring attention across sp (spmd.parallel.context), which merges per-chunk results with
`merge` by their log-sum-exp. The mask compares positions, as models.attention does.

Shapes: q (batch, s, kv_heads, groups, head_dim); k, v (batch, t, kv_heads, head_dim);
`mask` a models.attention.Mask: positions (s,) and (t,); segment ids of packed rows
(batch, s) and (batch, t), or None; a sliding window (an int, or None), whose hidden blocks
are skipped. The log-sum-exp is (batch, kv_heads, groups, s).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.annotate import ACTIVATION

BLOCK = 512  # tokens per query / key block on accelerators: large enough to keep matmuls efficient
# On XLA:CPU, small blocks are faster (benchmarks/mfu.py, small bf16 training step: sequence 256
# 0.50 -> 0.58 of a plain matmul's FLOP/s, 1024 0.35 -> 0.49): a block pair's float32 scores
# stay in cache, and the causal skip drops more of the hidden half. Below 64, the per-pair
# overhead wins (2048 tokens: 0.44 at 128, 0.40 at 64).
CPU_BLOCKS = (64, 128)
HIDDEN = -1e30  # score of a masked key: finite, so a row with no visible key stays finite
_NOWHERE = 2**31 - 1  # position of padding keys: after every query
_NO_SEGMENT = -1  # segment id of padding: no example's


def default_block(length: int) -> int:
    """Tokens per block when the caller gives none, for a sequence of `length` tokens on the
    backend JAX traces for: BLOCK on accelerators; on the CPU a quarter of the sequence,
    within CPU_BLOCKS."""
    if jax.default_backend() != "cpu":
        return BLOCK
    low, high = CPU_BLOCKS
    return min(high, max(low, length // 4))


def _block_sizes(s: int, t: int, block: int | None) -> tuple[int, int]:
    """Tokens per query block and per key block, for s queries and t keys."""
    block = block or default_block(max(s, t))
    return min(block, s), min(block, t)


def attention(q, k, v, mask, block: int | None = None) -> jax.Array:
    """Causal attention (softmax(q k^T / sqrt(d)) v, by positions, within segments and the
    window: `mask`), in q's dtype."""
    out, _ = attention_lse(q, k, v, mask, block)
    return out.astype(q.dtype)


def attention_lse(q, k, v, mask, block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(attention output in float32, log-sum-exp of each query's visible scores);
    `block`: tokens per block (default: `default_block`)."""
    s, t = q.shape[1], k.shape[1]
    bq, bk = _block_sizes(s, t, block)
    q_positions, k_positions = jnp.asarray(mask.q_positions, jnp.int32), jnp.asarray(mask.k_positions, jnp.int32)
    q, q_positions = _pad(q, q_positions, bq, 0)
    k, k_positions = _pad(k, k_positions, bk, _NOWHERE)
    v, _ = _pad(v, k_positions, bk, _NOWHERE)
    out, lse = _flash(q, k, v, _padded(mask, q_positions, k_positions, (bq, bk)), (bq, bk))
    return out[:, :s], lse[..., :s]


def attention_gradients(q, k, v, mask, out, lse, d_out, block: int | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 (dq, dk, dv) of the share of attention that the keys `k`, `v` hold, given the
    whole attention's float32 output `out` and log-sum-exp `lse` (over these keys and
    others) and the output's cotangent `d_out`: what ring attention's backward pass adds
    up one visiting K/V block at a time."""
    s, t = q.shape[1], k.shape[1]
    bq, bk = _block_sizes(s, t, block)
    q_positions, k_positions = jnp.asarray(mask.q_positions, jnp.int32), jnp.asarray(mask.k_positions, jnp.int32)
    q, padded_positions = _pad(q, q_positions, bq, 0)
    # Padded queries have no output gradient, so they add nothing.
    out, _ = _pad(out, q_positions, bq, 0)
    d_out, _ = _pad(d_out.astype(jnp.float32), q_positions, bq, 0)
    lse = jnp.pad(lse, [(0, 0)] * (lse.ndim - 1) + [(0, q.shape[1] - s)])
    k, k_positions = _pad(k, k_positions, bk, _NOWHERE)
    v, _ = _pad(v, k_positions, bk, _NOWHERE)
    residuals = (q, k, v, _padded(mask, padded_positions, k_positions, (bq, bk)), out, lse)
    d_q, d_k, d_v = _gradients((bq, bk), residuals, (d_out, jnp.zeros_like(lse)))
    return d_q[:, :s], d_k[:, :t], d_v[:, :t]


def _padded(mask, q_positions, k_positions, blocks: tuple[int, int]):
    """`mask` with the padded positions, and its segment ids padded to whole `blocks`."""
    segments = {}
    if mask.q_segments is not None:
        segments = {"q_segments": _pad_segments(mask.q_segments, blocks[0]),
                    "k_segments": _pad_segments(mask.k_segments, blocks[1])}
    return dataclasses.replace(mask, q_positions=q_positions, k_positions=k_positions, **segments)


def merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Attention over the union of two disjoint key sets, from each one's (out, lse)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    rows = lambda w: jnp.moveaxis(w, -1, 1)[..., None]  # (b, kv, g, s) -> (b, s, kv, g, 1)  # noqa: E731
    return out_a * rows(jnp.exp(lse_a - lse)) + out_b * rows(jnp.exp(lse_b - lse)), lse


def nothing(q) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of attention on no keys: merging it changes nothing."""
    b, s, kv, g, _ = q.shape
    return jnp.zeros(q.shape, jnp.float32), jnp.full((b, kv, g, s), HIDDEN, jnp.float32)


def _pad(x, positions, block: int, fill: int):
    extra = -x.shape[1] % block
    if not extra:
        return x, positions
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    return jnp.pad(x, widths), jnp.concatenate([positions, jnp.full((extra,), fill, positions.dtype)])


def _pad_segments(segments, block: int):
    segments = jnp.asarray(segments, jnp.int32)
    extra = -segments.shape[1] % block
    return jnp.pad(segments, ((0, 0), (0, extra)), constant_values=_NO_SEGMENT) if extra else segments


def _blocks(x, size: int):
    """(batch, n * size, ...) -> (n, batch, size, ...)."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, size, *x.shape[2:]), 1, 0)


def _unblock(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _scores(q, k, q_pos, k_pos, q_seg, k_seg, window):
    """Scaled, masked scores of a block pair, float32 (b, kv, g, bq, bk)."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    behind = q_pos[:, None] - k_pos[None, :]
    visible = behind >= 0 if window is None else (behind >= 0) & (behind < window)
    if q_seg is not None:
        visible = (visible[None] & (q_seg[:, :, None] == k_seg[:, None, :]))[:, None, None]
    return jnp.where(visible, scores, HIDDEN)


def _varying(q_pos, k_pos, segments, data):
    """The positions (and segment ids), tied to `data`. Inside a scan over layers they are
    the same in every layer, and JAX hoists what depends only on them out of that loop:
    every block pair's mask, computed at once (seq x seq). Tied to the layer's data, they stay."""
    q_pos, k_pos, segments, _ = jax.lax.optimization_barrier((q_pos, k_pos, segments, data))
    return q_pos, k_pos, segments


def _segment_blocks(segments, bq: int, bk: int):
    """Per-block segment ids (n, b, block) of queries and keys, or Nones."""
    if segments is None:
        return None, None
    return _blocks(segments[0], bq), _blocks(segments[1], bk)


def _visible(q_pos, k_pos, window):
    """Whether any key of the block is visible to any query of the block (padding keys sit
    at _NOWHERE, so the difference below stays within int32)."""
    seen = jnp.max(q_pos) >= jnp.min(k_pos)
    return seen if window is None else seen & (jnp.min(q_pos) - jnp.max(k_pos) < window)


def _unpacked(mask):
    """The mask's positions and segment ids ((queries', keys') or None), as the blocks read them."""
    segments = None if mask.q_segments is None else (mask.q_segments, mask.k_segments)
    return mask.q_positions, mask.k_positions, segments


# The mask's window rides in its static part (models.attention.Mask), and the tokens per
# query and key block in `blocks`: both static, as nondiff_argnums were.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, mask, blocks: tuple[int, int]):
    return _forward(q, k, v, mask, blocks)


def _forward(q, k, v, mask, blocks: tuple[int, int]):
    (bq, bk), window = blocks, mask.window
    q_pos, k_pos, segments = _varying(*_unpacked(mask), q)
    qs_blocks, ks_blocks = _segment_blocks(segments, bq, bk)
    k_blocks, v_blocks, kp_blocks = _blocks(k, bk), _blocks(v, bk), k_pos.reshape(-1, bk)

    def one_query_block(args):
        qb, qp, qs = args

        def visit(state, key_block):
            kb, vb, kp, ks = key_block

            def update(state):
                out, top, total = state
                scores = _scores(qb, kb, qp, kp, qs, ks, window)
                new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
                weights = jnp.exp(scores - new_top[..., None])
                rescale = jnp.exp(top - new_top)
                pv = jnp.einsum("bkgst,btkd->bskgd", weights.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
                out = out * jnp.moveaxis(rescale, -1, 1)[..., None] + pv
                return out, new_top, total * rescale + jnp.sum(weights, axis=-1)

            return jax.lax.cond(_visible(qp, kp, window), update, lambda state: state, state), None

        b, _, kv, g, _ = qb.shape
        start = (jnp.zeros(qb.shape, jnp.float32), jnp.full((b, kv, g, bq), HIDDEN, jnp.float32),
                 jnp.zeros((b, kv, g, bq), jnp.float32))
        (out, top, total), _ = jax.lax.scan(visit, start, (k_blocks, v_blocks, kp_blocks, ks_blocks))
        # A query that sees no key (only padding does) has total 0: keep it finite.
        total = jnp.where(total > 0, total, 1.0)
        return out / jnp.moveaxis(total, -1, 1)[..., None], top + jnp.log(total)

    out, lse = jax.lax.map(one_query_block, (_blocks(q, bq), q_pos.reshape(-1, bq), qs_blocks))
    return _unblock(out), jnp.moveaxis(lse, 0, -2).reshape(*lse.shape[1:-1], -1)


def _flash_forward(q, k, v, mask, blocks: tuple[int, int]):
    out, lse = _forward(q, k, v, mask, blocks)
    # Named as activations: a remat policy that keeps those (models.llama's "none") keeps
    # these. Otherwise, keeping matmul outputs, it would keep every block's scores so
    # as to recompute them without a matmul.
    out, lse = checkpoint_name(out, ACTIVATION), checkpoint_name(lse, ACTIVATION)
    return (out, lse), (q, k, v, mask, out, lse)


def _flash_backward(blocks, residuals, cotangents):
    q, k, v = residuals[:3]
    d_q, d_k, d_v = _gradients(blocks, residuals, cotangents)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


def _gradients(blocks: tuple[int, int], residuals, cotangents):
    """float32 (dq, dk, dv), the scores recomputed block pair by block pair: for each key
    block, a pass over the query blocks accumulates its dK and dV and each query block's
    share of dQ."""
    q, k, v, mask, out, lse = residuals
    (bq, bk), window = blocks, mask.window
    d_out, d_lse = cotangents
    q_pos, k_pos, segments = _varying(*_unpacked(mask), d_out)
    qs_blocks, ks_blocks = _segment_blocks(segments, bq, bk)
    # d(out)/d(scores) needs each row's sum of d_out * out; d(lse)/d(scores) is the softmax.
    row_term = jnp.moveaxis(jnp.sum(d_out * out, axis=-1), 1, -1) - d_lse  # (b, kv, g, s)
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_blocks, do_blocks = _blocks(q, bq), _blocks(d_out, bq)
    lse_blocks = jnp.moveaxis(lse.reshape(*lse.shape[:-1], -1, bq), -2, 0)
    row_blocks = jnp.moveaxis(row_term.reshape(*row_term.shape[:-1], -1, bq), -2, 0)
    qp_blocks = q_pos.reshape(-1, bq)

    def one_key_block(d_q, key_block):
        kb, vb, kp, ks = key_block

        def visit(grads, query_block):
            qb, dob, lseb, rowb, qp, qs = query_block

            def contribute(grads):
                d_k, d_v = grads
                probs = jnp.exp(_scores(qb, kb, qp, kp, qs, ks, window) - lseb[..., None])  # (b, kv, g, bq, bk)
                d_v = d_v + jnp.einsum("bkgst,bskgd->btkd", probs, dob, preferred_element_type=jnp.float32)
                d_probs = jnp.einsum("bskgd,btkd->bkgst", dob, vb, preferred_element_type=jnp.float32)
                d_scores = probs * (d_probs - rowb[..., None]) * scale
                d_k = d_k + jnp.einsum("bkgst,bskgd->btkd", d_scores, qb, preferred_element_type=jnp.float32)
                d_qb = jnp.einsum("bkgst,btkd->bskgd", d_scores, kb, preferred_element_type=jnp.float32)
                return (d_k, d_v), d_qb

            def skip(grads):
                return grads, jnp.zeros(qb.shape, jnp.float32)

            return jax.lax.cond(_visible(qp, kp, window), contribute, skip, grads)

        zeros = jnp.zeros(kb.shape, jnp.float32)
        (d_k, d_v), d_q_parts = jax.lax.scan(visit, (zeros, zeros),
                                             (q_blocks, do_blocks, lse_blocks, row_blocks, qp_blocks, qs_blocks))
        return d_q + _unblock(d_q_parts), (d_k, d_v)

    d_q, (d_k, d_v) = jax.lax.scan(one_key_block, jnp.zeros(q.shape, jnp.float32),
                                   (_blocks(k, bk), _blocks(v, bk), k_pos.reshape(-1, bk), ks_blocks))
    return d_q, _unblock(d_k), _unblock(d_v)


_flash.defvjp(_flash_forward, _flash_backward)
