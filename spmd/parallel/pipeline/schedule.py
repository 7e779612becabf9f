"""The schedules' shapes: what a pipeline's schedule is (stages, microbatches, chunks per
stage, ticks, what a stage keeps), the axes the pipeline's map is manual over, and the
microbatches' and stacked layers' layouts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmd.parallel.rules import EXPERT_AXIS, STAGE_AXIS

AXIS = STAGE_AXIS  # the rules table splits the stacked layers over it
PP_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-v", "dualpipe")
REPEATED_SCHEDULES = ("circular", "interleaved-1f1b")  # those with --pp-repeats chunks per stage
WRITTEN_OUT = ("1f1b", "interleaved-1f1b", "zb-v", "dualpipe")  # schedules that run their backward pass themselves
SPLIT_BACKWARD = ("zb-v", "dualpipe")  # two chunks per device, B and W apart (spmd.parallel.pipeline.zero_bubble)


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    microbatches: int  # m
    repeats: int = 1  # v (circular, interleaved-1f1b)
    remat: str = "none"  # the model's remat policy (zb-v defers its weight gradients only under "none")

    @classmethod
    def of(cls, cfg, stages: int) -> "Schedule":
        """The schedule a run's options ask for on `stages` pipeline stages."""
        # zb-v: two chunks per stage, stored as circular's (spmd.parallel.pipeline.zero_bubble)
        parallelism = cfg.parallelism
        repeats = 2 if parallelism.pp_schedule == "zb-v" else parallelism.pp_repeats
        return cls(parallelism.pp_schedule, stages, parallelism.microbatches or stages, repeats, cfg.model.remat)

    @property
    def defers_weights(self) -> bool:
        """Whether the backward pass is split into B and a deferred W (zb-v, DualPipe under
        remat "none"). Under a remat policy the matmuls' inputs are recomputed inside the
        backward pass, so they run each chunk's whole backward in B's tick: their
        activations are the policy's (spmd.parallel.pipeline.zero_bubble)."""
        return self.name in SPLIT_BACKWARD and self.remat == "none"

    @property
    def mirrored_share(self) -> float:
        """The share of a stage's weights each device receives from its mirror each step
        (and sends back as gradients): zb-v's second chunk, half a stage; DualPipe's
        second stage, a whole one; none for the other schedules."""
        return {"zb-v": 1 / 2, "dualpipe": 1.0}.get(self.name, 0.0)

    @property
    def ticks(self) -> int:
        """Ticks that run a chunk's forward (gpipe, circular, 1f1b, interleaved-1f1b:
        v*m + p - 1; zb-v: 2m + 2p - 2, half a stage each; DualPipe: m + p - 2, a stage each)."""
        if self.name == "zb-v":
            return 2 * (self.microbatches + self.stages - 1)
        if self.name == "dualpipe":
            return self.microbatches + self.stages - 2
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Share of the executed forward (and backward) stage work that is idle (computes
        on padding). zb-v: of its forwards and input gradients; its weight gradients
        have none (spmd.parallel.pipeline.zero_bubble.executed_over_useful)."""
        return 1 - self.repeats * self.microbatches / self.ticks  # (zb-v: 2 chunks, DualPipe: 1 stage)

    @property
    def compute_overhead(self) -> float:
        """Executed over useful stage compute: 1 / (1 - bubble); zb-v's and DualPipe's weight
        gradients have no bubble, so with a chunk's forward, B and W alike (its matmuls,
        each once per pass) 1 + 2(p-1)/(3m), DualPipe's 1 + 2(p-2)/(3m)
        (spmd.parallel.pipeline.zero_bubble.executed_over_useful)."""
        if self.defers_weights:
            idle = self.stages - (2 if self.name == "dualpipe" else 1)
            return 1 + 2 * idle / (3 * self.microbatches)
        return 1 / (1 - self.bubble)

    @property
    def writes_backward(self) -> bool:
        """Whether the schedule runs the backward pass itself (`one_f_one_b`), not autodiff."""
        return self.name in WRITTEN_OUT

    @property
    def residual_slots(self) -> int:
        """Chunk residuals a stage keeps at once (1f1b, interleaved-1f1b): a forward's
        live at most 2(vp - 1) ticks."""
        return 2 * self.repeats * self.stages - 1

    @property
    def kept_microbatches(self) -> float:
        """A stage's activations kept at once, in microbatches through all its layers:
        m + p - 1 ticks' (gpipe), v*m + p - 1 ticks of 1/v of them (circular), or the
        residual ring's (2vp - 1) / v."""
        if self.defers_weights:
            # The longest-kept part: the matmuls' inputs for W, zb-v's 5p - 2 half-stage
            # chunks (what B reads: 4p - 1; the matmul outputs' cotangents from B to W:
            # 2p - 1), DualPipe's (5p - 4)/2 stages (B: 2p - 1; B to W: p - 1).
            return (5 * self.stages - (4 if self.name == "dualpipe" else 2)) / 2
        # (W in B's tick: B's ring, zb-v's 4p - 1 chunks as interleaved-1f1b's at v = 2,
        # DualPipe's 2p - 1 stages)
        if self.name == "dualpipe":
            return 2 * self.stages - 1
        if self.writes_backward:
            return self.residual_slots / self.repeats
        return self.ticks / self.repeats


# ------------------------------------------------------------------ rows <-> microbatches

def to_microbatches(x: jax.Array, shards: int, schedule: Schedule) -> jax.Array:
    """Rows (b, ...) split over (batch axes, pp) -> (m, b/m, ...): pp rank i's rows are
    microbatches [i*m/p, (i+1)*m/p), each taking an equal share of every batch shard's
    rows, so the reshuffle moves nothing between devices."""
    p, m = schedule.stages, schedule.microbatches
    b = x.shape[0]
    x = x.reshape(shards, p, m // p, b // (shards * m), *x.shape[1:])
    return jnp.moveaxis(x, 0, 2).reshape(m, b // m, *x.shape[4:])


def from_microbatches(x: jax.Array, shards: int, schedule: Schedule) -> jax.Array:
    """The inverse of `to_microbatches`."""
    p, m = schedule.stages, schedule.microbatches
    b = x.shape[0] * x.shape[1]
    x = x.reshape(p, m // p, shards, b // (shards * m), *x.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(b, *x.shape[4:])


def stage_view(leaf: jax.Array, repeats: int) -> jax.Array:
    """A stage's local slice of a stacked parameter -> (repeats, layers per chunk, ...)."""
    return leaf.reshape(repeats, -1, *leaf.shape[(2 if repeats > 1 else 1):])


def stacked_spec(repeats: int) -> jax.P:
    """How the stacked layers are split over pp: (layers,) or (repeats, layers / repeats)."""
    return jax.P(None, AXIS) if repeats > 1 else jax.P(AXIS)


def manual_axes(shape: Mapping[str, int]) -> tuple[str, ...]:
    """The axes the stages' map is manual over, on a mesh of `shape`: pp, dp, and ep where
    fsdp is 1 (with fsdp, of size 1: the manual axes of the maps nested inside must come in
    the mesh's order). Over a manual batch axis each shard sums its gradients over the ticks,
    and they are reduced over it once, as the map ends; over an automatic one XLA reduces
    them in every tick (over ep: 3.2 TiB a step on DeepSeek-V3's 2,048-GPU layout before
    ep was manual). Where fsdp splits the weights, ep stays automatic with it."""
    return (AXIS, "dp", "fsdp", EXPERT_AXIS) if shape["fsdp"] == 1 else (AXIS, "dp")


def batch_axes(manual: tuple[str, ...]) -> tuple[str, ...]:
    """Of the map's `manual` axes, those that split the batch."""
    return tuple(a for a in manual if a != AXIS)


def map_batch_axes() -> tuple[str, ...]:
    """Inside the stages' map: the batch axes it is manual over."""
    return batch_axes(tuple(jax.sharding.get_abstract_mesh().manual_axes))


def manual_spec(names: tuple, stacked: bool, manual: tuple[str, ...]) -> jax.P:
    """A weight's split over the map's `manual` axes, from its logical `names`: its stacked
    layers over pp (`stacked`), its experts over ep where ep is manual (each device runs its
    own, as outside the stages); whole on every device of the manual batch axes otherwise,
    its gradient summed over them where the map ends (`summed_over_shards`)."""
    experts = EXPERT_AXIS if EXPERT_AXIS in manual else None
    return jax.P(*[AXIS if stacked and n == "layers" else experts if n == "experts" else None for n in names])


class MapSpecs(NamedTuple):
    """How the stacked layers (`blocks`), the head's weights and the stages' `fixed` part
    enter the map, leaf by leaf (`manual_spec`)."""
    blocks: object
    head: object = jax.P()
    fixed: object = jax.P()


class PipelineRun(NamedTuple):
    """Where and how a step's microbatches go through the stages: the `mesh`, the
    `schedule`, one microbatch's spec (`rows`) and how the weights enter the map (`specs`)."""
    mesh: jax.sharding.Mesh
    schedule: Schedule
    rows: jax.P
    specs: MapSpecs


class StageProgram(NamedTuple):
    """What every stage runs and reads. `fn(chunk, x, side, fixed) -> (y, statistics)` runs
    one chunk of stacked layers (leading axis: the chunk's layers) on one microbatch (with
    its `side` inputs, or None, and its part of `fixed`) and reports per-layer statistics
    (MoE layers'; a dict of arrays with a leading layer axis, empty for dense layers);
    `blocks`: the stacked layers, differentiated; `side`: the microbatches' side inputs
    (the package's docstring), or None; `fixed`: what the stages read but do not
    differentiate (a frozen base, the layers' structure), stored as `blocks` are, or None.
    Inside the map, a stage's own views of them."""
    fn: object
    blocks: object
    side: object = None
    fixed: object = None


class Head(NamedTuple):
    """The loss at the last stage's end, for the schedules that write their backward pass:
    `fn(params, y, targets) -> (loss, metrics)` is one microbatch's loss from the last
    stage's output (its mean, or its share of the step's: the schedule averages them) and
    its metrics; `params` the parameters it uses (replicated over pp);
    `statistics_weights(statistics) -> weights`: how much each statistic adds to what is
    minimized, per microbatch of the whole batch (e.g. an MoE balance loss's weight over
    the number of MoE layers), or None: nothing."""
    fn: object
    params: object
    statistics_weights: object = None


def summed_over_shards(grads, specs, also: tuple[str, ...] = ()):
    """Inside the map: each shard's gradients (summed over its ticks) summed over the batch
    axes the weight is whole on (`specs`: the map's, per leaf), and over `also`."""
    def summed(g, spec):
        split = {a for part in spec if part for a in ((part,) if isinstance(part, str) else part)}
        return jax.lax.psum(g, (*also, *(a for a in map_batch_axes() if a not in split)))
    return jax.tree.map(summed, grads, specs)
