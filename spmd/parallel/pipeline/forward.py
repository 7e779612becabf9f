"""GPipe and circular: the forward ticks written out, differentiated by autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmd.parallel.pipeline.kit import (add_statistics, from_stage_0, layer_statistics, micro, no_statistics,
                                        only_stage_0, ring_pairs, run_chunk, stage_copies, stage_statistics)
from spmd.parallel.pipeline.schedule import AXIS, PipelineRun, StageProgram, batch_axes, manual_axes, stage_view


def pipeline(run: PipelineRun, stages: StageProgram, x: jax.Array, policy=None):
    """Run microbatches x (m, mb, ...), split over pp along m, through the `stages`
    (`StageProgram`) as `run` says (`PipelineRun`: its specs say how the blocks and the
    fixed part enter the map); differentiable by `jax.grad`. `policy`: the model's remat
    policy. Returns the outputs, laid out like x, and the statistics of every layer, each a
    mean over the microbatches (`layer_statistics`)."""
    mesh, schedule, rows, specs = run
    stage_fn, blocks, side, fixed = stages
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats

    def on_device(blocks, x, side, fixed):
        stage, x = jax.lax.axis_index(AXIS), x[0]
        chunks, fixed_chunks = (jax.tree.map(lambda w: stage_view(w, v), tree) for tree in (blocks, fixed))

        def tick(carry, t):
            queue, arrived, totals = carry
            i = t - stage  # this stage's iteration: repeat i // m, microbatch i % m
            repeat = jnp.clip(i // m, 0, v - 1)
            inp = jnp.where(stage == 0, queue[t % m], arrived)
            out, stats = run_chunk(stage_fn, policy, chunks, repeat, inp, micro(side, jnp.clip(i, 0, v * m - 1) % m),
                                   fixed_chunks)
            totals = add_statistics(stats, (i >= 0) & (i < v * m), repeat, totals)
            arrived = jax.lax.ppermute(out, AXIS, ring_pairs(p, 1))
            # Stage 0 files what the last stage finished into its queue (that microbatch's
            # next round, or its final output).
            last = t - (p - 1)
            filed = (stage == 0) & (last >= 0) & (last < v * m)
            slot = jnp.clip(last, 0, v * m - 1) % m
            queue = queue.at[slot].set(jnp.where(filed, arrived, queue[slot]))
            return (queue, arrived, totals), None

        start = (x, jnp.zeros_like(x[0]), no_statistics(stage_fn, chunks, x[0], micro(side, 0), fixed_chunks))
        (queue, _, totals), _ = jax.lax.scan(tick, start, jnp.arange(schedule.ticks))
        return only_stage_0(queue, stage), stage_statistics(totals, m)

    manual = manual_axes(mesh.shape)
    copies = jax.P(AXIS, None, batch_axes(manual))
    out, stats = jax.shard_map(on_device, mesh=mesh,
                               in_specs=(specs.blocks, copies, jax.P(None, batch_axes(manual)), specs.fixed),
                               out_specs=(copies, jax.P(AXIS)), axis_names=frozenset(manual),
                               check_vma=False)(blocks, stage_copies(x, mesh, rows), side, fixed or {})
    return from_stage_0(out, mesh, rows), layer_statistics(stats)
