"""1F1B and interleaved 1F1B: each tick a forward and a backward on every stage, the
backward pass written out (the head's loss on the last stage, in its forward tick)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from spmd.parallel.pipeline.kit import (add_statistics, from_stage_0, head_vjp, layer_statistics, micro, no_statistics,
                                        only_stage_0, ring_pairs, split_vjp, stage_copies, stage_statistics,
                                        weighted_statistics)
from spmd.parallel.pipeline.schedule import AXIS, BATCH_AXIS, MANUAL_AXES, Schedule, stacked_spec, stage_view


def interleaved_order(i, p: int, v: int):
    """A stage's i-th forward (or backward) iteration -> (round, microbatch, its forward
    iteration): microbatches go around the ring in groups of p, each group v times
    before the next group starts, so what stage 0 receives from the last stage is what
    it runs next (no queue). Backward runs the rounds of a group in reverse."""
    group, rest = i // (p * v), i % (p * v)
    return rest // p, group * p + rest % p, group * p * v


def one_f_one_b(mesh, schedule: Schedule, stage_fn, head_fn, blocks, head, x: jax.Array, targets,
                rows: jax.P, statistics_weights=None, side=None, fixed=None):
    """Loss and gradients with the 1F1B schedule, or interleaved 1F1B (`repeats` v > 1:
    stage s holds chunks s, s+p, ... stored as for circular), with no `jax.grad` around
    it: the backward pass is interleaved with the forward here.

    `stage_fn(chunk, x, side) -> (y, statistics)` runs a chunk of the stage's layers on one
    microbatch (statistics and side inputs as for `pipeline`); `head_fn(head, y, targets) ->
    loss` is the loss of one microbatch from the last stage's output (its mean, or its
    share of the step's: the schedule averages them), `head` the parameters it uses
    (replicated over pp). `statistics_weights(statistics) -> weights`: how much
    each statistic adds to what is minimized, per microbatch of the whole batch (e.g. an
    MoE balance loss's weight over the number of MoE layers); None: nothing.
    x: (m, mb, ...) embedded microbatches, split over pp along m; targets (m, mb, ...), or
    a tree of such arrays; `rows`: one microbatch's spec; `side`: the microbatches' side inputs;
    `fixed`: stacked weights stored as `blocks` are, which the stages read but which are not
    differentiated (a frozen base), passed to `stage_fn(chunk, x, side, fixed_chunk)`.
    Returns (loss, d_blocks, d_head, dx, statistics): the mean loss, the gradients of the
    stacked layers (split over pp) and of `head`, dx, the gradient of x (laid out like x),
    from which the embedding's follows, and the layers' statistics (`layer_statistics`)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    slots = schedule.residual_slots
    # The last stage's backward of a microbatch's last round runs in the tick of its
    # forward (the head's gradient at hand): stage p-1's first forward of round v-1.
    first_backward = v * p - 1

    def run(blocks, head_params, x, targets, side, fixed):
        stage, x = jax.lax.axis_index(AXIS), x[0]
        last = stage == p - 1
        chunks, fixed_chunks = (jax.tree.map(lambda w: stage_view(w, v), tree) for tree in (blocks, fixed))
        if v == 1:  # the same weights every tick: nothing picked
            def pick(r, chunks=chunks):
                return jax.tree.map(lambda w: w[0], chunks)
        else:
            def pick(r, chunks=chunks):
                return jax.tree.map(lambda w: w[r], chunks)
        dp = jax.lax.psum(1, BATCH_AXIS)
        seed = 1.0 / (m * dp)  # each dp shard's microbatch loss is a mean over its own rows
        forward, backward, shapes = split_vjp(stage_fn, pick(0), x[0], micro(side, 0), pick(0, fixed_chunks))
        no_stats = no_statistics(stage_fn, chunks, x[0], micro(side, 0), fixed_chunks)
        stats_weights = weighted_statistics(no_stats, statistics_weights, seed)
        head = head_vjp(head_fn, head_params, targets, seed)

        def tick(carry, t, *, forwards: bool, backwards: bool):
            arrived, returned, ring, d_chunks, d_head, loss, dx, totals = carry
            if forwards:
                i = t - stage
                r, k, _ = interleaved_order(i, p, v)
                valid = (i >= 0) & (i < v * m)
                k = jnp.clip(k, 0, m - 1)
                # Stage 0 starts a microbatch's first round from x; later rounds continue
                # from what the last stage sent it in the previous tick.
                inp = jnp.where((stage == 0) & (r == 0), x[k], arrived)
                (y, stats), residuals = forward(pick(r), inp, micro(side, k), pick(r, fixed_chunks))
                totals = add_statistics(stats, valid, r, totals)
                ring = [buf.at[i % slots].set(res) for buf, res in zip(ring, residuals)]
                final = last & (r == v - 1)
                head_loss, head_grads, dy = head(y, k, final)
                keep = valid & final
                loss = loss + jnp.where(keep, head_loss, 0.0)
                d_head = jax.tree.map(lambda acc, g: acc + jnp.where(keep, g, 0), d_head, head_grads)
                arrived = jax.lax.ppermute(y, AXIS, ring_pairs(p, 1))
            if backwards:
                j = t - first_backward - (p - 1 - stage)
                rest, k, group_start = interleaved_order(j, p, v)
                r = v - 1 - rest
                valid = (j >= 0) & (j < v * m)
                # Its forward's iteration, whose residuals the ring holds (a forward's
                # residuals live at most 2(vp-1) ticks: 2vp-1 slots).
                i = group_start + r * p + j % p
                cotangent = jnp.where(last & (r == v - 1), dy, returned) if forwards else returned
                d_chunk, d_inp = backward(pick(r), [buf[i % slots] for buf in ring], (cotangent, stats_weights),
                                          pick(r, fixed_chunks))
                d_chunks = jax.tree.map(lambda acc, g: acc.at[r].add(jnp.where(valid, g, 0)), d_chunks, d_chunk)
                slot = jnp.clip(k, 0, m - 1)
                dx = dx.at[slot].set(jnp.where(valid & (stage == 0) & (r == 0), d_inp, dx[slot]))
                returned = jax.lax.ppermute(d_inp, AXIS, ring_pairs(p, -1))
            return (arrived, returned, ring, d_chunks, d_head, loss, dx, totals), None

        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        ring = [jnp.zeros((slots, *s.shape), s.dtype) for s in shapes]
        carry = (jnp.zeros_like(x[0]), jnp.zeros_like(x[0]), ring, zeros(chunks), zeros(head_params), jnp.zeros(()),
                 jnp.zeros_like(x), no_stats)
        # Warm-up (forwards only), steady state (both), cool-down (backwards only).
        both = v * m + p - 1
        phases = ((0, first_backward, True, False), (first_backward, both - first_backward, True, True),
                  (both, first_backward, False, True))
        for start, length, forwards, backwards in phases:
            body = functools.partial(tick, forwards=forwards, backwards=backwards)
            carry, _ = jax.lax.scan(body, carry, start + jnp.arange(length))
        _, _, _, d_chunks, d_head, loss, dx, totals = carry
        d_blocks = jax.tree.map(lambda g, w: g.reshape(w.shape), d_chunks, blocks)
        loss = jax.lax.psum(loss, AXIS) / m
        return (jax.lax.pmean(loss, BATCH_AXIS), jax.lax.psum(d_blocks, BATCH_AXIS),
                jax.lax.psum(d_head, MANUAL_AXES), only_stage_0(dx, stage), stage_statistics(totals, m))

    copies = jax.P(AXIS, None, BATCH_AXIS)
    per_microbatch = jax.P(None, BATCH_AXIS)
    loss, d_blocks, d_head, dx, stats = jax.shard_map(
        run, mesh=mesh, in_specs=(stacked_spec(v), jax.P(), copies, per_microbatch, per_microbatch, stacked_spec(v)),
        out_specs=(jax.P(), stacked_spec(v), jax.P(), copies, jax.P(AXIS)), axis_names=frozenset(MANUAL_AXES),
        check_vma=False,
    )(blocks, head, stage_copies(x, mesh, rows), targets, side, fixed or {})
    return loss, d_blocks, d_head, from_stage_0(dx, mesh, rows), layer_statistics(stats)
