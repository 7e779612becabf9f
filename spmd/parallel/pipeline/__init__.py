"""Pipeline stages over the `pp` axis, with `jax.shard_map`.

The stacked layers are cut into p stages (rules table: `layers` -> pp); a step's rows are
cut into m microbatches that stream through them. The map is manual over pp, dp and, where
fsdp is 1, ep (`schedule.manual_axes`); fsdp, sp and tp stay automatic inside a stage, so a
stage is the model's own layer scan under the same rules as without a pipeline (the
experts' and ring attention's maps nest inside, manual over the axes this one leaves; the
experts enter split over ep, each device's own; MoE layers' statistics come out with the
outputs, and 1F1B feeds what they add to the loss into its backward pass). Being manual
over dp and ep lets each shard sum its own gradients over the ticks and reduce them once,
where the map ends (automatic, XLA reduces them every tick). Activations move to the next
stage by `ppermute` once per tick; every stage runs every tick (a bubble tick computes on
zeros and its result is dropped), so the compiled program executes (ticks / useful ticks)
times the useful work: the schedule's bubble, exactly.

Outside the map, pp is one more data axis: the embedding, the output head and the loss
run on rows split over (dp, fsdp, ep, pp). The microbatches enter as one copy per stage
(an all-gather over pp; stage 0 reads its copy) and leave as the sum of the stages'
results, zero but on stage 0 (a reduce-scatter: each pp rank gets m/p microbatches).
Both happen outside the map, where XLA keeps the rows split over fsdp and reduces
bfloat16 safely (XLA:CPU aborts on a bfloat16 reduction inside a partly manual map).

A microbatch may come with side inputs that every stage reads but no stage changes (the
segment ids and positions of packed rows): `side`, (m, mb, ...) arrays handed to every
stage whole (replicated over pp), of which a stage passes microbatch k's to `stage_fn`
when it runs microbatch k.

Schedules:
- gpipe: tick t, stage s runs microbatch t - s; m + p - 1 ticks forward, then autodiff
  runs them backward. Bubble (p-1)/(m+p-1); every microbatch's activations are kept.
- circular (`repeats` v): stage s holds v chunks of layers, s, s+p, ... (stored as a
  (v, layers/v) stack split over pp on its second axis, so each device holds its chunks
  and a row-major reshape gives the model's order). A microbatch goes around the ring v
  times; stage 0 keeps what comes back from the last stage in its input queue until the
  microbatch's next round. v*m + p - 1 ticks, bubble (p-1)/(v*m+p-1); needs m >= p.
- 1f1b: the backward pass is written out, so each tick runs one forward and one backward
  on every stage: microbatch k's forward at stage s in tick k + s, its backward in tick
  k + 2(p-1) - s. A stage keeps at most 2(p-1-s)+1 <= 2p-1 microbatches' residuals
  (a ring of 2p-1 slots), however large m is. The last stage computes the head and loss
  of each microbatch in its forward tick, so its backward starts at once. Warm-up (p-1
  ticks, forwards only), steady state (m ticks) and cool-down (p-1, backwards only) are
  three scans, so the executed work is GPipe's: bubble (p-1)/(m+p-1).
- interleaved-1f1b (`repeats` v): 1f1b on circular chunks (stored as circular's). Stage
  s's i-th forward runs in tick i + s on round i % (pv) // p of microbatch
  (i // (pv)) p + i % p: groups of p microbatches go around the ring v times, so what
  stage 0 receives from the last stage is its next input and needs no queue. Backwards
  run the rounds of a group in reverse, from tick vp - 1 (the last stage's first final
  round: its backward uses the head's gradient of the same tick). Warm-up vp - 1 ticks,
  steady v*m + p - 1 - (vp - 1), cool-down vp - 1: each stage runs v*m + p - 1 chunk
  forwards and as many backwards, bubble (p-1)/(v*m+p-1) as circular. A chunk's
  residuals live at most 2(vp-1) ticks: a ring of 2vp - 1 chunk residuals, (2vp-1)/v
  microbatches through the stage's layers (1f1b's 2p - 1 at v = 1).
- zb-v: two chunks per stage in a V, the backward split into input and weight gradients
  (spmd.parallel.pipeline.zero_bubble); dualpipe: the same machine with stages d and p-1-d
  on device d and the microbatches entering at both ends. Both keep the rows where they
  live and move them to where they enter (kit.Conveyor), not a copy on every stage.

The package: `schedule` (Schedule, the map's axes, and what a schedule is given: where it
runs, `PipelineRun`; what the stages run, `StageProgram`; the loss at the end, `Head`), `kit` (what every schedule's tick is
made of), `split` (a chunk's backward as B and W), and one module per family of schedules:
`forward` (gpipe, circular), `one_f_one_b` (1f1b, interleaved-1f1b), `zero_bubble` (zb-v,
dualpipe).
"""

from spmd.parallel.pipeline.forward import pipeline
from spmd.parallel.pipeline.kit import layer_statistics, micro
from spmd.parallel.pipeline.one_f_one_b import one_f_one_b
from spmd.parallel.pipeline.schedule import (AXIS, PP_SCHEDULES, REPEATED_SCHEDULES, SPLIT_BACKWARD, WRITTEN_OUT, Head,
                                             MapSpecs, PipelineRun, Schedule, StageProgram, batch_axes,
                                             from_microbatches, manual_axes, manual_spec, stacked_spec, stage_view,
                                             to_microbatches)
from spmd.parallel.pipeline.zero_bubble import zb_v

__all__ = ["AXIS", "PP_SCHEDULES", "REPEATED_SCHEDULES", "SPLIT_BACKWARD", "WRITTEN_OUT", "Head", "MapSpecs",
           "PipelineRun", "Schedule", "StageProgram", "batch_axes", "from_microbatches", "layer_statistics", "manual_axes", "manual_spec", "micro", "one_f_one_b",
           "pipeline", "stacked_spec", "stage_view", "to_microbatches", "zb_v"]
