"""1F1B and interleaved 1F1B: each tick a forward and a backward on every stage, the
backward pass written out (the head's loss on the last stage, in its forward tick)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmd.parallel.pipeline.kit import (add_metrics, add_statistics, from_stage_0, head_vjp, mean_metrics, layer_statistics, micro, no_statistics,
                                        only_stage_0, ring_pairs, split_vjp, stage_copies, stage_statistics,
                                        weighted_statistics)
from spmd.parallel.pipeline.schedule import (AXIS, Head, PipelineRun, Schedule, StageProgram, batch_axes, manual_axes,
                                             map_batch_axes, stage_view, summed_over_shards)


def interleaved_order(i, p: int, v: int):
    """A stage's i-th forward (or backward) iteration -> (round, microbatch, its forward
    iteration): microbatches go around the ring in groups of p, each group v times
    before the next group starts, so what stage 0 receives from the last stage is what
    it runs next (no queue). Backward runs the rounds of a group in reverse."""
    group, rest = i // (p * v), i % (p * v)
    return rest // p, group * p + rest % p, group * p * v


def one_f_one_b(run: PipelineRun, stages: StageProgram, head: Head, x: jax.Array, targets):
    """Loss and gradients with the 1F1B schedule, or interleaved 1F1B (`repeats` v > 1:
    stage s holds chunks s, s+p, ... stored as for circular), with no `jax.grad` around
    it: the backward pass is interleaved with the forward here.

    `stages` (`StageProgram`) run the chunks of each stage's layers on one microbatch;
    `head` (`Head`) is each microbatch's loss on the last stage, and how much the layers'
    statistics add to it; `run` (`PipelineRun`): its specs say how the blocks, the head's
    parameters and the fixed part enter the map.
    x: (m, mb, ...) embedded microbatches, split over pp along m; targets (m, mb, ...), or
    a tree of such arrays.
    Returns (metrics, d_blocks, d_head, dx, statistics): the head's mean metrics, the gradients of the
    stacked layers (split over pp) and of the head's parameters, dx, the gradient of x (laid out like x),
    from which the embedding's follows, and the layers' statistics (`layer_statistics`)."""
    mesh, schedule, rows, specs = run
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats

    def on_device(blocks, head_params, x, targets, side, fixed):
        stage = _Stage.of(schedule, stages._replace(blocks=blocks, side=side, fixed=fixed),
                          head._replace(params=head_params), x[0], targets)
        carry = stage.start(head_params)
        # Warm-up (forwards only), steady state (both), cool-down (backwards only).
        first, both = stage.first_backward, v * m + p - 1
        for start, length, forwards, backwards in ((0, first, True, False), (first, both - first, True, True),
                                                    (both, first, False, True)):
            body = functools.partial(stage.tick, forwards=forwards, backwards=backwards)
            carry, _ = jax.lax.scan(body, carry, start + jnp.arange(length))
        d_blocks = jax.tree.map(lambda g, w: g.reshape(w.shape), carry.d_chunks, blocks)
        return (mean_metrics(carry.metrics, m), summed_over_shards(d_blocks, specs.blocks),
                summed_over_shards(carry.d_head, specs.head, also=(AXIS,)), only_stage_0(carry.dx, stage.stage),
                stage_statistics(carry.totals, m))

    manual = manual_axes(mesh.shape)
    copies = jax.P(AXIS, None, batch_axes(manual))
    per_microbatch = jax.P(None, batch_axes(manual))
    metrics, d_blocks, d_head, dx, stats = jax.shard_map(
        on_device, mesh=mesh, in_specs=(specs.blocks, specs.head, copies, per_microbatch, per_microbatch, specs.fixed),
        out_specs=(jax.P(), specs.blocks, specs.head, copies, jax.P(AXIS)), axis_names=frozenset(manual),
        check_vma=False,
    )(stages.blocks, head.params, stage_copies(x, mesh, rows), targets, stages.side, stages.fixed or {})
    return metrics, d_blocks, d_head, from_stage_0(dx, mesh, rows), layer_statistics(stats)


class _Carry(NamedTuple):
    """What a stage's ticks carry."""
    arrived: jax.Array  # the activation the previous stage sent forward
    returned: jax.Array  # the gradient the next stage sent back
    ring: list  # the residuals of forwards whose backward has not run (residual_slots of them)
    d_chunks: dict  # the gradients of the stage's chunks, summed over ticks
    d_head: dict  # the head's, summed over the last stage's final rounds
    metrics: dict  # the head's, summed likewise
    dx: jax.Array  # the gradient of each microbatch's input (stage 0's)
    totals: dict  # the chunks' statistics, summed over ticks


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One stage inside the map: the schedule's sizes, its index, its microbatches and
    chunks, its forward and backward passes as two functions (kit.split_vjp) and the
    head's loss and gradient (kit.head_vjp). Its tick runs a forward half, a backward
    half, or both."""
    p: int
    m: int
    v: int
    slots: int
    first_backward: int  # the last stage's first backward: in the tick of its final round's forward
    stage: jax.Array
    x: jax.Array
    side: object
    chunks: dict
    fixed_chunks: dict
    forward: object
    backward: object
    shapes: list
    no_stats: dict
    stats_weights: dict
    head: object
    no_metrics: dict

    @classmethod
    def of(cls, schedule: Schedule, stages: StageProgram, head: Head, x, targets) -> _Stage:
        """The stage inside the map, from its own views of the `stages` and of the `head`."""
        stage_fn, blocks, side, fixed = stages
        p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
        chunks, fixed_chunks = (jax.tree.map(lambda w: stage_view(w, v), tree) for tree in (blocks, fixed))
        first = lambda tree: jax.tree.map(lambda w: w[0], tree)  # noqa: E731
        # Each batch shard's microbatch loss is a mean over its own rows.
        seed = 1.0 / (m * jax.lax.psum(1, map_batch_axes()))
        forward, backward, shapes = split_vjp(stage_fn, first(chunks), x[0], micro(side, 0), first(fixed_chunks))
        no_stats = no_statistics(stage_fn, chunks, x[0], micro(side, 0), fixed_chunks)
        return cls(p, m, v, schedule.residual_slots, v * p - 1, jax.lax.axis_index(AXIS), x, side, chunks,
                   fixed_chunks, forward, backward, shapes, no_stats,
                   weighted_statistics(no_stats, head.statistics_weights, seed),
                   *head_vjp(head.fn, head.params, targets, seed, x[0]))

    def pick(self, r, tree):
        """Chunk `r` of the stage's `tree` (with one chunk, the same weights every tick)."""
        return jax.tree.map(lambda w: w[0] if self.v == 1 else w[r], tree)

    def start(self, head_params) -> _Carry:
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        return _Carry(jnp.zeros_like(self.x[0]), jnp.zeros_like(self.x[0]),
                      [jnp.zeros((self.slots, *s.shape), s.dtype) for s in self.shapes], zeros(self.chunks),
                      zeros(head_params), self.no_metrics, jnp.zeros_like(self.x), self.no_stats)

    def tick(self, carry: _Carry, t, *, forwards: bool, backwards: bool):
        dy = None
        if forwards:
            carry, dy = self._forward(carry, t)
        if backwards:
            carry = self._backward(carry, t, dy)
        return carry, None

    def _forward(self, c: _Carry, t) -> tuple[_Carry, jax.Array]:
        """This tick's forward: the stage's i-th, of microbatch k's round r; on the last
        stage, a final round's head (its loss, and dy for the backward of the same tick)."""
        p, v, last = self.p, self.v, self.stage == self.p - 1
        i = t - self.stage
        r, k, _ = interleaved_order(i, p, v)
        valid = (i >= 0) & (i < v * self.m)
        k = jnp.clip(k, 0, self.m - 1)
        # Stage 0 starts a microbatch's first round from x; later rounds continue
        # from what the last stage sent it in the previous tick.
        inp = jnp.where((self.stage == 0) & (r == 0), self.x[k], c.arrived)
        (y, stats), residuals = self.forward(self.pick(r, self.chunks), inp, micro(self.side, k),
                                             self.pick(r, self.fixed_chunks))
        final = last & (r == v - 1)
        keep = valid & final
        head_metrics, d_head, dy = self.head(y, k, final, c.d_head, keep)
        return c._replace(
            arrived=jax.lax.ppermute(y, AXIS, ring_pairs(p, 1)),
            ring=[buf.at[i % self.slots].set(res) for buf, res in zip(c.ring, residuals)],
            d_head=d_head,
            metrics=add_metrics(c.metrics, head_metrics, keep),
            totals=add_statistics(stats, valid, r, c.totals)), dy

    def _backward(self, c: _Carry, t, dy) -> _Carry:
        """This tick's backward: the stage's j-th, rounds of a group in reverse; from the
        head's dy on a final round of the last stage, else from what the next stage returned."""
        p, v = self.p, self.v
        j = t - self.first_backward - (p - 1 - self.stage)
        rest, k, group_start = interleaved_order(j, p, v)
        r = v - 1 - rest
        valid = (j >= 0) & (j < v * self.m)
        # Its forward's iteration, whose residuals the ring holds (a forward's residuals
        # live at most 2(vp-1) ticks: 2vp-1 slots).
        i = group_start + r * p + j % p
        cotangent = c.returned if dy is None else jnp.where((self.stage == p - 1) & (r == v - 1), dy, c.returned)
        d_chunk, d_inp = self.backward(self.pick(r, self.chunks), [buf[i % self.slots] for buf in c.ring],
                                       (cotangent, self.stats_weights), self.pick(r, self.fixed_chunks))
        slot = jnp.clip(k, 0, self.m - 1)
        return c._replace(
            returned=jax.lax.ppermute(d_inp, AXIS, ring_pairs(p, -1)),
            d_chunks=jax.tree.map(lambda acc, g: acc.at[r].add(jnp.where(valid, g, 0)), c.d_chunks, d_chunk),
            dx=c.dx.at[slot].set(jnp.where(valid & (self.stage == 0) & (r == 0), d_inp, c.dx[slot])))
