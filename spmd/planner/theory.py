"""What a layout should cost in collective bytes, from shapes, dtypes and shardings alone
(DESIGN.md section 8; what each device holds is spmd.planner.footprint's, from the same walk over
the parameters).

Nothing here compiles: `spmd.plan` sets these numbers next to what XLA compiled, and
`--auto` ranks layouts by them before compiling the best few.

Collective bytes are per device and per step, with the ring algorithms' factors: an
all-reduce over N devices moves 2(N-1)/N of its buffer, an all-gather or reduce-scatter
(N-1)/N of the full buffer. The step's collectives, for the Llama family:

- weights stored split over a batch axis (fsdp, ZeRO-3's dp) are all-gathered in the
  compute dtype where they are used: once per step, and once more in the backward pass
  for the stacked layers, in every microbatch (their gathered copies are not kept; see
  models.llama);
- weight gradients are partial sums over the axes that split the tokens (dp, fsdp, ep,
  sp): reduce-scattered over the axes the gradient is stored split over, all-reduced
  over the rest;
- with ZeRO-1/2 the optimizer updates its shard, and parameters replicated over dp are
  all-gathered back after the update;
- Megatron tensor parallelism all-reduces the (tokens x embed) activations after each
  attention and MLP block forward, and their input gradients backward (once more per
  layer under full remat, which recomputes the forward up to the MLP; an MoE layer's
  experts' outputs again under "dots" too, and Megatron-SP's gathered projection inputs
  under "dots" and "full", attention's only where a norm before it makes them, not where
  it reads the block's kept input (the config's NORMS.before: OLMo 2):
  spmd.planner.activations.tensor_parallel); a vocab split over tp adds one
  all-reduce for the embedding lookup, one for the output head's input gradient and
  three small ones for the softmax statistics (max, sum, target logit); a norm over
  elements the heads' split divides (OLMo 2's q/k norms over the whole projections, the
  config's `block_norms`) sums each token's mean of squares over tp three times a layer
  (spmd.planner.activations.norm_statistics);
- expert parallelism exchanges tokens by all-to-all over ep in each MoE layer (spmd.
  experts): there and back forward, their gradients backward (and there and back again
  under remat other than "none", which recomputes the forward). Each exchange sends the
  (ep-1)/ep of its buffer that leaves the device: capacity mode its per-sequence
  buffers, dropless its padded blocks and their expert indices (int32). An expert's
  gradient is summed only over the batch axes that do not split the experts.

Pipeline stages (spmd.parallel.pipeline; p stages, m microbatches, v chunks per stage): each
device holds and runs 1/p of the stacked layers (never gathered over pp), on the rows of
its whole pp group; outside the pipeline pp is one more data axis, so the embedding, the
head and their gradients see tokens split over pp too. Every stage runs every one of the
v*m + p - 1 ticks, so per-layer work (Megatron's all-reduces, fsdp's gathers and
reduce-scatters, kept activations) is (v*m + p - 1)/(v*m) times the useful work. dp is
manual in the map: the stage's gradients are summed per dp shard over the ticks in
float32 and reduced over dp once. pp itself moves the stage output (one microbatch) by
collective-permute each tick forward and its gradient each tick backward; entering and
leaving, the device's rows are all-gathered and reduce-scattered over pp (and their
gradients reduce-scattered and all-gathered). 1f1b has GPipe's counts, interleaved-1f1b
circular's.

zb-v splits each chunk's backward pass into B (input gradients, and the vectors' weight
gradients) and W (the matrices' weight gradients): B runs with the forwards, bubble
included; W exactly once per chunk and microbatch, so the matrices' gradients are
reduced over the automatic axes m times per round, not (m + p - 1) times. (A matrix
whose input the backward pass recomputes from what B reads, a model's
`RECOMPUTED_INPUT_WEIGHTS` (DeepSeek-V3's latent up-projections), has its gradient in B.)
Under a remat policy zb-v does not split (B computes every gradient, with the bubble).

Multi-token prediction (models.deepseek3's modules) runs where the head does: each depth
is one more MoE layer on the head's rows, its weights gathered again in the backward pass
like a prefix's, and the head and the table are used once more per depth (in pipeline
stages manual over ep the lookups are each device's own, from its copy of the table).

Expert copies (spmd.parallel.balance.tie) add one all-reduce over ep, per MoE layer a
device holds, of 2R expert rows of gradients (the R copy slots' and their homes'): in
the number of copies R, not of experts.
"""

from __future__ import annotations

import jax.numpy as jnp

from models import model_class
from spmd.parallel import pipeline
from spmd.parallel.layout import Layout
from spmd.parallel.skeleton import DTYPES
from spmd.planner.activations import (expert_parallel, norm_statistics, pipeline_stages, sequence_parallel,
                                      stage_statistics, tensor_parallel)
from spmd.planner.counting import (Expected, Param, compute_table, head_in_stages, in_head, is_vector, live, params,
                                   picks_again, rows_moved, spec_axes, stage_overhead, table_scatter_axes, tokens_per_device,
                                   uses, ways)


def _backward_gathers(cfg, layout: Layout, stage_runs: float) -> float:
    """How often the backward pass gathers the stacked weights again (once per forward).
    With one layer-scan step and accumulation: once (below). In GPipe stages XLA hoists that gather out of the backward tick loop (the weights are
    the same every tick), under every remat policy: once. A circular schedule under remat
    "full" runs each tick's forward once more in the backward pass (spmd.parallel.pipeline.
    kit.run_chunk): twice per forward."""
    model_cfg = layout.skeleton.model_cfg
    scan_steps = model_cfg.layers // (model_cfg.moe.every if model_cfg.moe else 1)
    if layout.schedule is None and cfg.training.grad_accum > 1 and scan_steps == 1:
        # One scan step: the layer loop is gone, the weights are the same in every
        # microbatch, and XLA hoists the backward's gather out of the accumulation loop.
        return 1
    if layout.schedule is None or layout.schedule.writes_backward:
        return stage_runs
    if picks_again(layout):
        return stage_runs * (2 if cfg.model.remat == "full" else 1)
    return 1


def collectives(cfg, layout: Layout) -> list[Expected]:
    shape, rules = layout.shape, layout.rules
    compute_bytes = jnp.dtype(DTYPES[cfg.model.dtype]).itemsize
    model_cfg = layout.skeleton.model_cfg
    used_table = compute_table(layout)
    # Weight gradients are summed over every axis that splits the tokens.
    plain_tokens = live((*layout.data_axes, "sp"), shape)
    # Under Megatron-SP the residual stream is split over tp too, and with it the tokens
    # that the vectors used on it (norm scales) see.
    residual_tokens = live((*layout.data_axes, "sp", "tp"), shape) if cfg.parallelism.megatron_sp else plain_tokens
    # How often a device runs its share of the stacked layers forward: once per
    # microbatch; in pipeline stages a 1/v chunk of them each tick.
    stage_runs = (cfg.training.grad_accum * (layout.schedule.microbatches if layout.schedule else 1)
                  * stage_overhead(layout))
    out: list[Expected] = []
    for p in params(layout, cfg):
        compute = spec_axes(p.names, used_table)
        summed = residual_tokens if is_vector(p) else plain_tokens
        if is_vector(p) and "head_dim" in p.names:  # a per-head norm (Qwen3's q/k): every head's share adds up
            summed = live({*summed, *spec_axes(("heads",), used_table)}, shape)
        # An axis that splits the parameter as used (ep for experts, pp for stages) does not sum it.
        token_axes = tuple(a for a in summed if a not in compute)
        at_rest = spec_axes(p.names, rules.params)
        slice_numel = grad_numel = p.numel / ways(compute, shape)  # one device's slice, as used
        if layout.kv_copies > 1 and "kv_heads" in p.names:  # a device uses the one kv head it shares
            slice_numel /= layout.skeleton.model_cfg.kv_heads
            # ... and reduces that head's gradient, unless microbatches' are summed first (whole).
            grad_numel = grad_numel if _accumulated(cfg, layout) else slice_numel
        widths = uses(p, model_cfg, compute_bytes)
        # The lookups' rows move to the table where it is stored (and their gradients
        # back): the table is gathered for a tied head's use alone, and the lookups'
        # gradient summed into each device's shard over the other token axes only.
        moved = rows_moved(cfg, layout) if p.path == model_class(model_cfg).LOOKUP_TABLE else ()
        if moved:
            out += _moved_rows(cfg, layout, p, moved, widths.count(4), compute_bytes)
        gathered = live(set(at_rest) - set(compute), shape)
        out += _gathers(cfg, layout, p, gathered, slice_numel, widths[widths.count(4):] if moved else widths,
                        stage_runs)  # (a table's lookups come first in its uses)
        fused, after = table_scatter_axes(cfg, layout) if p.path == model_class(model_cfg).LOOKUP_TABLE else ((), ())
        if fused:  # reduced with tp's (activations.tensor_parallel); the rest reduces that shard
            token_axes = tuple(a for a in token_axes if a not in fused and a not in after)
            grad_numel = grad_numel / ways(fused, shape)
        # A tied table's two uses (the lookup, the head) are reduced each on its own, as
        # computed (models.annotate.weight reduces each use's gradient where it is taken).
        if not p.trained:  # a frozen weight is only read
            continue
        # (Multi-token prediction's lookups in the stages' head are summed over the ticks and
        # added to the lookup's gradient outside them: one reduction.)
        merged = (p.path == model_class(model_cfg).LOOKUP_TABLE and head_in_stages(layout)
                  and not model_cfg.tie_embeddings)
        apart = len(widths) > 1 and not _accumulated(cfg, layout) and not merged
        per_use = [(w,) for w in widths] if apart else [widths]
        if moved:  # each lookup's shard reduced on its own (multi-token prediction's too); a tied head's use apart
            lookups = widths.count(4)
            for _ in range(lookups if apart else 1):
                out += _gradients(cfg, layout, p, tuple(a for a in token_axes if a not in moved),
                                  grad_numel / ways(moved, shape), (4,), stage_runs)
            per_use = [(w,) for w in widths[lookups:]]
        for i, use in enumerate(per_use):
            out += _gradients(cfg, layout, p, token_axes, grad_numel, use, stage_runs, tick_sum=i <= 1)
        out += _shared_kv_heads(cfg, layout, p, max(widths), stage_runs)
        regather = live(set(spec_axes(p.names, rules.opt_state)) - set(at_rest), shape)
        if regather:
            n = ways(regather, shape)
            stored = p.numel * p.itemsize / ways(at_rest, shape)
            out.append(Expected("all-gather", "+".join(regather), (n - 1) / n * stored,
                                "parameters after the sharded optimizer update (ZeRO-1/2)"))
    out += tensor_parallel(cfg, layout, compute_bytes)
    out += norm_statistics(cfg, layout)
    out += sequence_parallel(cfg, layout, compute_bytes)
    out += expert_parallel(cfg, layout, compute_bytes)
    out += [e for e in pipeline_stages(cfg, layout, compute_bytes) if e.bytes_per_device]
    out += stage_statistics(cfg, layout)
    return out


def _gathers(cfg, layout: Layout, p: Param, gathered: tuple[str, ...], slice_numel: float,
             widths: tuple[int, ...], stage_runs: float) -> list[Expected]:
    """A parameter gathered where used, over `gathered`, for its uses of `widths` bytes
    per element."""
    out, shape = [], layout.shape
    entering = tuple(a for a in gathered if a in pipeline.batch_axes(pipeline.manual_axes(shape)))
    if entering and layout.schedule and p.stacked:
        # Stored split over dp (ZeRO-3), the stages' weights enter the map (manual over
        # dp and ep) gathered over it, once per step; over the rest (fsdp) as below.
        n = ways(entering, shape)
        gathered = tuple(a for a in gathered if a not in entering)
        out.append(Expected("all-gather", "+".join(entering), (n - 1) / n * slice_numel * p.itemsize / ways(
            gathered, shape), "stage weights entering the pipeline"))
    if gathered and widths:
        n = ways(gathered, shape)
        # Stacked weights are gathered in the layer scans of every microbatch (every
        # tick of a pipeline), and again in backward; a prefix's in its scan, outside
        # the stages, and again in backward, as are multi-token prediction's (in the stages'
        # head, in every tick that runs it); the others once.
        times = ((stage_runs + _backward_gathers(cfg, layout, stage_runs)) if p.stacked
                 else 2 * _head_ticks(cfg, layout) if p.predicts and head_in_stages(layout)
                 else 2 * cfg.training.grad_accum if p.prefix or p.predicts else 1)
        out.append(Expected("all-gather", "+".join(gathered), times * (n - 1) / n * slice_numel * sum(widths),
                            "weights gathered where used" + (", again in backward" if p.stacked else "")))
    return out


def _moved_rows(cfg, layout: Layout, p: Param, moved: tuple[str, ...], lookups: int, compute_bytes: int
                ) -> list[Expected]:
    """Each lookup that moves its rows to the table (models.lookup.looked_up), one axis
    of `moved` after the other: its token ids gathered (int32, those of the axes before
    as well), its rows sent back from there in the compute dtype (an all-to-all), and
    where the table trains their gradients sent there again."""
    tokens, out = tokens_per_device(cfg, layout.shape), []
    rows = tokens * layout.skeleton.model_cfg.embed * compute_bytes
    for i, axis in enumerate(moved):
        n, before = layout.shape[axis], ways(moved[:i], layout.shape)
        out += [Expected("all-gather", axis, lookups * (n - 1) * before * tokens * 4, "the lookups' token ids, to the table"),
                Expected("all-to-all", axis, lookups * (1 + p.trained) * (n - 1) / n * rows,
                         "the looked-up rows, from the table (and their gradients to it)")]
    return out


def _gradients(cfg, layout: Layout, p: Param, token_axes: tuple[str, ...], slice_numel: float,
               widths: tuple[int, ...], stage_runs: float, tick_sum: bool = True) -> list[Expected]:
    """A parameter's gradient, summed over `token_axes`: reduce-scattered over the axes it
    is stored split over, all-reduced over the rest. It is summed in the widest dtype of
    its uses, or in float32 (the accumulators' dtype) when summed over microbatches (or
    pipeline ticks) before the one reduction."""
    # With pipeline stages, accumulation runs whole pipeline passes (rounds), each
    # reducing its gradients as it ends (spmd.parallel.step's _pipeline_rounds).
    rounds = cfg.training.grad_accum if layout.schedule else 1
    stored_split = live(spec_axes(p.names, layout.rules.grads), layout.shape)
    scatterable = stored_split
    if layout.schedule and (p.stacked or (head_in_stages(layout) and in_head(layout, p))):
        # In the stages: over the automatic axes (fsdp, sp; ep where fsdp splits the
        # weights) each tick, as computed; over the manual ones (dp, and ep where fsdp is 1:
        # pipeline.manual_axes; pp for the head, which 1f1b, zb-v and DualPipe run in a
        # branch of every tick) once per round, after its ticks are summed.
        if p.stacked:
            manual = tuple(a for a in token_axes if a in pipeline.batch_axes(pipeline.manual_axes(layout.shape)))
            runs = _stage_gradient_runs(cfg, layout, p, stage_runs)
        else:
            manual = tuple(a for a in token_axes if a in pipeline.manual_axes(layout.shape))
            runs = _head_ticks(cfg, layout)
        automatic = tuple(a for a in token_axes if a not in manual)
        # (The head's uses are each reduced where taken over the automatic axes; over the
        # manual ones, the model's use has its sum over the ticks and multi-token
        # prediction's depths share one: `tick_sum` is false for the depths after the first.)
        phases = [(automatic, runs, max(widths))] + ([(manual, rounds, p.itemsize)] if tick_sum else [])
        # Where the map ends with a manual sum, XLA slices the stored gradient after it:
        # each tick's gradient is reduce-scattered only over the axes the weights are
        # gathered over (the gather's transpose; fsdp) and all-reduced over the other
        # automatic ones (ep beside fsdp, which ZeRO splits the stored gradient over), and the manual
        # sum is an all-reduce too. (Without one the ticks' sums are reduce-scattered as stored.)
        gathered = live(spec_axes(p.names, layout.rules.params), layout.shape)
        if manual and any(a in automatic and a not in gathered for a in stored_split):
            scatterable = tuple(a for a in stored_split if a in gathered)
    elif _accumulated(cfg, layout):
        # Accumulated (spmd.parallel.step): over the axes inside the per-shard vmap (sp, and ep with
        # split experts) in every microbatch, as computed; over the accumulation axes once,
        # the float32 sums.
        once = tuple(a for a in token_axes if a in layout.accumulation_axes)
        phases = [(tuple(a for a in token_axes if a not in once), cfg.training.grad_accum, max(widths)),
                  (once, 1, p.itemsize)]
    else:
        # 1f1b sums the head's gradients (a tied table's head use too) over microbatches
        # before reducing them (and pipeline rounds theirs over rounds). A prefix of layers
        # (models.deepseek3's dense ones) runs outside the stages, once per round on all of
        # a device's rows: its gradients are reduced as computed, in the compute dtype.
        summed_first = _accumulated(cfg, layout) or (head_in_stages(layout) and not p.stacked and not p.prefix)
        phases = [(token_axes, rounds, p.itemsize if summed_first else max(widths))]
    out, numel = [], slice_numel
    for axes, times, width in phases:
        scatter = tuple(a for a in scatterable if a in axes)
        summed = tuple(a for a in axes if a not in scatter)
        k = ways(scatter, layout.shape)
        if scatter:
            out.append(Expected("reduce-scatter", "+".join(scatter), times * (k - 1) / k * numel * width, "gradients"))
        if summed:
            n = ways(summed, layout.shape)
            out.append(Expected("all-reduce", "+".join(summed), times * 2 * (n - 1) / n * numel / k * width,
                                "gradients"))
        numel /= k
    return out


def _head_ticks(cfg, layout: Layout) -> float:
    """How often the compiled step runs the head in the stages (1f1b, zb-v, DualPipe): in
    a branch of every tick, in every accumulated round."""
    schedule = layout.schedule
    return cfg.training.grad_accum * schedule.repeats * schedule.microbatches * stage_overhead(layout)


def _stage_gradient_runs(cfg, layout: Layout, p: Param, stage_runs: float) -> float:
    """How often a stacked weight's gradient is computed (and reduced over the automatic
    axes) in the stages, in whole passes over the stage's layers: with each forward's
    backward (stage_runs), but zb-v's weight-gradient pass W (the matrices') runs exactly
    once per chunk and microbatch, without the bubble (spmd.parallel.pipeline.zero_bubble): m
    passes; its input-gradient pass B, which also computes the vectors' (norm scales')
    and those of the matrices whose input it recomputes, runs with the forwards (and
    under a remat policy computes every gradient: Schedule.defers_weights)."""
    if layout.schedule.defers_weights and not is_vector(p) and not computed_in_b(layout, p):
        return cfg.training.grad_accum * layout.schedule.microbatches
    return stage_runs


def computed_in_b(layout: Layout, p: Param) -> bool:
    """Whether zb-v's input-gradient pass B computes the stacked matrix `p`'s gradient:
    under remat "none" (where zb-v splits) the backward pass keeps the matmuls' outputs and
    the named activations (models.annotate.constrain) and recomputes the rest, and W gets
    the kept values only W reads. A matrix whose input is recomputed from what B reads
    anyway (the model's RECOMPUTED_INPUT_WEIGHTS) has all its gradient needs in B, which
    the split leaves it to; it is then reduced with the bubble, as the vectors'."""
    stacked_weights = model_class(layout.skeleton.model_cfg).RECOMPUTED_INPUT_WEIGHTS
    return p.stacked and p.path.split(".", 1)[-1] in stacked_weights


def _accumulated(cfg, layout: Layout) -> bool:
    """Whether gradients are summed per shard over microbatches (spmd.parallel.step's vmap)."""
    return cfg.training.grad_accum > 1 and not layout.schedule


def _shared_kv_heads(cfg, layout: Layout, p: Param, width: int, stage_runs: float) -> list[Expected]:
    """tp beyond the key/value heads (rules.SHARED_KV_HEADS): in each layer's backward pass
    the gradient of a kv head's projection (reduced to its stored split over the batch
    axes first) is summed over the c tp devices that share it (neighbours: tp:inner{c}),
    then gathered over the kv heads (tp:outer{kv}), as the projection is stored whole on
    every tp device."""
    c = layout.kv_copies
    if c == 1 or "kv_heads" not in p.names:
        return []
    kv = layout.skeleton.model_cfg.kv_heads
    times = stage_runs if p.stacked else 1
    # The gradient as stored; with accumulation, as each shard keeps it (whole over those axes).
    split = spec_axes(p.names, layout.rules.grads)
    if _accumulated(cfg, layout):
        split = [a for a in split if a not in layout.accumulation_axes]
    numel = p.numel / ways(split, layout.shape)
    return [Expected("all-reduce", f"tp:inner{c}", times * 2 * (c - 1) / c * numel / kv * width,
                     "kv heads: gradient summed over the devices sharing one"),
            Expected("all-gather", f"tp:outer{kv}", times * (kv - 1) / kv * numel * width,
                     "kv heads: gradients of all heads, for the whole stored projection")]
