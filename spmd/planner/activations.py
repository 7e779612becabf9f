"""The activations' collectives a layout should cost, per step and device, axis by axis:
Megatron's all-reduces over tp (and LoRA adapters' rank-wide ones), the keys and values
over sp, the routed tokens over ep, and the stage outputs over pp (spmd.planner.theory
says how; this module counts them)."""

from __future__ import annotations

import functools

from models.lora import MLP_TARGETS
from spmd.parallel.pipeline import SPLIT_BACKWARD, batch_axes, manual_axes, zero_bubble
from spmd.parallel.experts import ragged_exchange
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import BATCH_AXES
from spmd.parallel.rules import axes_of
from spmd.parallel.objective import prediction_depth
from spmd.planner.counting import (SMALL_BYTES, Expected, expert_rows, head_in_stages, head_runs, live, params,
                                   picks_again, prediction_layers, spec_axes, split_norms, stage_overhead,
                                   table_scatter_axes, tokens_per_device, ways)


def adapters_over_tp(cfg, layout: Layout, token_bytes: float, per_layer: float) -> list[Expected]:
    """LoRA adapters on projections whose heads or MLP width tp splits: the rank-wide
    product of each is summed over tp like the projection's: forward where the input is
    split (o_proj, down_proj: A's), backward where the output is (the others: the gradient
    of A x); under remat "full" the forward ones again. Keys' and values' where tp goes
    beyond the kv heads (c devices share one): the gradient of a head's output summed over
    the c (tp:inner{c}), then that of A x over the heads (tp:outer{kv})."""
    lora, model, t, c = layout.skeleton.lora, layout.skeleton.model_cfg, layout.shape["tp"], layout.kv_copies
    if lora is None:
        return []
    dense = model.layers - model.moe_layers

    def count(targets) -> int:
        return sum((dense if target in MLP_TARGETS else model.layers) for target in targets if target in lora.targets)

    forward = count(("o_proj", "down_proj")) * (2 if cfg.model.remat == "full" else 1)
    backward = count(("q_proj", "gate_proj", "up_proj") + (("k_proj", "v_proj") if c == 1 else ()))
    rank = token_bytes * lora.rank
    why = "LoRA: adapters' rank-wide products on split projections"
    # Under Megatron-SP the forward ones go to the residual stream's split, as the projection's output.
    scattered = forward if cfg.parallelism.megatron_sp else 0
    out = [Expected("reduce-scatter", "tp", per_layer * scattered * (t - 1) / t * rank, why),
           Expected("all-gather", "tp", per_layer * scattered * (t - 1) / t * rank, why)] if scattered else []
    out.append(Expected("all-reduce", "tp", per_layer * (forward - scattered + backward) * 2 * (t - 1) / t * rank, why))
    kv, shared = model.kv_heads, per_layer * count(("k_proj", "v_proj")) if c > 1 else 0
    if shared:
        out += [Expected("all-reduce", f"tp:inner{c}", shared * 2 * (c - 1) / c * token_bytes * model.head_dim,
                         "LoRA: a shared kv head's output gradient, over the devices sharing it"),
                Expected("all-reduce", f"tp:outer{kv}", shared * 2 * (kv - 1) / kv * rank,
                         "LoRA: keys' and values' rank-wide products over the kv heads")]
    return out


def _reduced(cfg, t: int, nbytes: float, times: float, why: str) -> list[Expected]:
    """`times` all-reduces of `nbytes` over tp; under Megatron-SP each is a reduce-scatter
    into the sequence-split residual stream and an all-gather out of it."""
    if cfg.parallelism.megatron_sp:
        return [Expected("reduce-scatter", "tp", times * (t - 1) / t * nbytes, why),
                Expected("all-gather", "tp", times * (t - 1) / t * nbytes, why)]
    return [Expected("all-reduce", "tp", times * 2 * (t - 1) / t * nbytes, why)]


def _whole(t: int, nbytes: float, times: float, why: str) -> list[Expected]:
    """Under Megatron-SP, `times` input gradients all-reduced whole rather than
    reduce-scattered into the residual stream (their output gradients still gathered):
    a part made whole meets the projection's partial sum, and XLA adds them before the
    residual stream's slice."""
    if not times:
        return []
    return [Expected("all-gather", "tp", times * (t - 1) / t * nbytes, why),
            Expected("all-reduce", "tp", times * 2 * (t - 1) / t * nbytes, why)]


def tensor_parallel(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    t = layout.shape["tp"]
    if t == 1:
        return []
    model = layout.skeleton.model_cfg
    tokens = tokens_per_device(cfg, layout.shape)
    activation = tokens * model.embed * compute_bytes  # outside pipeline stages: the head's input
    per_layer = stage_overhead(layout)  # the layers' activations, in pipeline stages, bubble ticks included
    reduced = functools.partial(_reduced, cfg, t)

    # Per layer: the attention and MLP outputs forward, their input gradients backward. An
    # MoE layer's experts reduce their rows instead (and its shared expert the tokens). A
    # prefix of layers before the stacked ones (models.deepseek3's dense layers) runs
    # outside pipeline stages, once; multi-token prediction's MoE blocks where the head runs.
    moe_layers, prefix, mtp = model.moe_layers_run, model.prefix_layers, prediction_layers(layout)
    shared = model.moe is not None and model.moe.shared_experts > 0  # a shared expert reduces as an MLP does
    layer_runs = per_layer * model.stacked_layers + prefix + mtp
    mlp_runs = per_layer * (model.stacked_layers - moe_layers + moe_layers * shared) + prefix + mtp * shared
    # Under Megatron-SP the input gradient is all-reduced whole (`_whole`) where a part of it
    # is whole already: an MoE layer's experts' rows (after their own all-reduce, below)
    # beside its shared expert; LoRA adapters on the projections that read the residual
    # stream's norm (their rank-wide product's, all-reduced in `adapters_over_tp`).
    sp, lora = cfg.parallelism.megatron_sp, layout.skeleton.lora
    moe_whole = per_layer * moe_layers + mtp if sp and shared else 0
    mlp_whole = per_layer * (model.stacked_layers - moe_layers) + prefix if sp and lora and {
        "gate_proj", "up_proj"} & set(lora.targets) else 0
    attention_whole = layer_runs if sp and lora and {"q_proj", "k_proj", "v_proj"} & set(lora.targets) else 0
    out = reduced(activation, layer_runs + 2 * mlp_runs - moe_whole - mlp_whole,
                  "Megatron: block outputs forward, the MLPs' input gradients backward")
    out += _whole(t, activation, moe_whole + mlp_whole, "Megatron-SP: MoE layers' and adapted MLPs' input gradients")
    # (Under Megatron-SP, the gathered input's, reduce-scattered back into the residual stream.)
    width = model.embed if cfg.parallelism.megatron_sp else model.attention_input_gradient()
    out += reduced(tokens * width * compute_bytes, layer_runs - attention_whole,
                   "Megatron: attention's input gradient backward")
    out += _whole(t, tokens * width * compute_bytes, attention_whole, "Megatron-SP: adapted attention's input gradient")
    if picks_again(layout) and cfg.model.remat == "full":
        out += reduced(activation, per_layer * 2 * model.stacked_layers, "circular stages: each tick's forward again")
    out += adapters_over_tp(cfg, layout, tokens * compute_bytes, per_layer)
    moe_runs = per_layer * moe_layers + mtp
    if moe_layers:
        # Forward and backward; under remat "dots" and "full" the forward's again: the
        # gates' gradient reads the experts' outputs, a grouped or batched matmul's, which
        # neither policy keeps.
        passes = 3 if cfg.model.remat in ("dots", "full") else 2
        rows = expert_rows(cfg, layout) * model.embed * compute_bytes
        out.append(Expected("all-reduce", "tp", moe_runs * passes * 2 * (t - 1) / t * rows,
                            "experts: their outputs forward, their input gradients backward"))
    # Under Megatron-SP a remat policy keeps no sublayer input gathered out of the residual
    # stream: each is gathered again in the backward pass, but attention's where no norm
    # comes before it (the config's NORMS.before false: OLMo 2). There attention reads the
    # block's input itself, which the checkpoint keeps, and XLA keeps it gathered over tp,
    # as attention reads it (OLMo 2's all-gathers over tp read 0.849 of a theory that
    # gathered it again, under "dots" and "full").
    kept_input = not model.NORMS.before
    if cfg.model.remat == "full":
        # The forward is recomputed up to the MLP (its output is not needed for gradients),
        # an MoE layer's shared expert included (XLA reduces it with the experts' output).
        # Where a norm follows each sublayer (the config's NORMS.after: Gemma 3, OLMo 2) its
        # backward pass reads its input, the MLP's output: every MLP's is made again.
        again = mlp_runs if model.NORMS.after else moe_runs if shared else 0
        if cfg.parallelism.megatron_sp:
            # The sublayers' inputs gathered again, attention's output (and the MLP's) scattered.
            gathered = (1 if kept_input else 2) * layer_runs
            out.append(Expected("all-gather", "tp", gathered * (t - 1) / t * activation, "remat"))
            out.append(Expected("reduce-scatter", "tp", (layer_runs + again) * (t - 1) / t * activation, "remat"))
        else:
            out += reduced(activation, layer_runs + again, "remat: the attention output (and a shared expert's) again")
    elif cfg.model.remat == "dots" and cfg.parallelism.megatron_sp:
        # "dots" keeps the projections' outputs, not their inputs gathered out of the
        # residual stream: the attention's and the MLP's gathered again for their weights'
        # gradients (under LoRA, where adapters read them).
        attention_again = 0 if kept_input else attention_whole if lora else layer_runs
        again = attention_again + (mlp_whole if lora else layer_runs)
        out.append(Expected("all-gather", "tp", again * (t - 1) / t * activation, "remat: gathered inputs again"))
    return out + _vocab_split(cfg, layout, compute_bytes)


def norm_statistics(cfg, layout: Layout) -> list[Expected]:
    """Norms over elements that devices split (counting.split_norms: OLMo 2's q/k norms over
    the whole projections, under tp): per layer, each one's mean of squares is summed over
    the axes that split it, in float32, a value per token, three times: forward, made again
    in the backward pass (no remat policy keeps a reduction's output), and its input
    gradient's sum of x times the output gradient. In pipeline stages in every tick."""
    model, tokens = layout.skeleton.model_cfg, tokens_per_device(cfg, layout.shape)
    layers = model.stacked_layers * stage_overhead(layout) + model.prefix_layers + prediction_layers(layout)
    out = []
    for axes in split_norms(layout):
        n = ways(axes, layout.shape)
        out.append(Expected("all-reduce", "+".join(axes), layers * 3 * tokens * 4 * 2 * (n - 1) / n,
                            "norms over split projections: the mean of squares, forward, again and backward"))
    return out


def _vocab_split(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    """Where tp splits the vocabulary: the embedding's lookup (its rows, or under
    Megatron-SP the table), the output head's input, and the softmax's statistics."""
    t, model = layout.shape["tp"], layout.skeleton.model_cfg
    if "tp" not in axes_of(layout.rules.activations["vocab"]):
        return []
    reduced = functools.partial(_reduced, cfg, t)
    tokens = tokens_per_device(cfg, layout.shape)
    # 1f1b runs the head on the last stage, per microbatch, in a branch of every tick
    # (counting.head_runs); multi-token prediction runs it once more per depth, with the
    # lookup of the later inputs.
    predicted = 1 + prediction_depth(model)
    head_tokens = tokens * head_runs(layout) * predicted
    head_input = head_tokens * model.embed * compute_bytes
    out = []
    if cfg.parallelism.megatron_sp:
        # XLA gathers the float32 table for the lookup (and reduce-scatters its gradient)
        # rather than reduce-scattering the looked-up rows.
        table = model.vocab * model.embed * 4
        out.append(Expected("all-gather", "tp", (t - 1) / t * table, "vocab split: the table, for the lookup"))
        fused, after = table_scatter_axes(cfg, layout)
        if after:  # over a replicating axis and the stored ones, then the shard summed over the rest and tp
            n, g = ways(fused, layout.shape), ways(after, layout.shape)
            out.append(Expected("reduce-scatter", "+".join(fused), (n - 1) / n * table, "vocab split: the table's gradient"))
            out.append(Expected("all-reduce", "+".join(after), 2 * (g - 1) / g * table / n,
                                "vocab split: the table's gradient"))
        else:
            n = t * ways(fused, layout.shape)
            out.append(Expected("reduce-scatter", "+".join(live((*fused, "tp"), layout.shape)), (n - 1) / n * table,
                                "vocab split: the table's gradient"))
    else:
        out += reduced(predicted * tokens * model.embed * 4, 1, "vocab split: embedding lookup (float32 rows)")
    out += reduced(head_input, 1, "vocab split: the output head's input")
    out.append(Expected("all-reduce", "tp", 2 * (t - 1) / t * head_tokens * 4 * 3, "vocab split: softmax statistics"))
    return out


def sequence_parallel(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    """K/V traffic of attention over sp (spmd.parallel.context), per layer."""
    n = layout.shape["sp"]
    if n == 1:
        return []
    model, shape = layout.skeleton.model_cfg, layout.shape
    kv_heads = model.kv_heads * layout.kv_copies / ways(("tp",), shape) if layout.kv_copies > 1 else \
        model.kv_heads / ways(axes_of(layout.rules.activations["kv_heads"]), shape)
    block = (cfg.training.batch / ways(BATCH_AXES, shape) * cfg.training.seq / n * kv_heads * model.head_dim
             * compute_bytes)
    recomputed = cfg.model.remat != "none"  # "none" keeps the received blocks; the others fetch them again
    # In pipeline stages a device runs 1/pp of the layers, in every tick (bubbles included).
    # A prefix of layers outside the stages runs on a device's rows, which pp splits too.
    layers = (model.stacked_layers * stage_overhead(layout) + model.prefix_layers
              + prediction_layers(layout)) / shape["pp"]
    if cfg.parallelism.attention == "ring":
        # K and V: n - 1 hops forward [and again, recomputed], n - 1 again backward, beside
        # their float32 gradients' n - 1 hops and the last one home in the compute dtype
        # (spmd.parallel.context's ring-level backward pass). At n = 2 the recomputed hop
        # is the backward pass's: XLA inlines the one-trip loops and sends the blocks once.
        hops = 2 * (n - 1) * (3 if recomputed and n > 2 else 2) + 2 * ((n - 1) * 4 / compute_bytes + 1)
        return [Expected("collective-permute", "sp", layers * hops * block, "ring attention: K/V blocks")]
    gathers = 2 * (2 if recomputed else 1)
    return [Expected("all-gather", "sp", layers * gathers * (n - 1) * block, "attention: K and V gathered"),
            Expected("reduce-scatter", "sp", layers * 2 * (n - 1) * block, "attention: K/V gradients")]


def expert_parallel(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    """All-to-all of tokens over ep, per MoE layer (spmd.parallel.experts); in capacity mode with
    the sequence split over sp, the per-expert counts of every chunk's choices, gathered
    over sp to rank each choice in its sequence."""
    ep, sp, model = layout.shape["ep"], layout.shape["sp"], layout.skeleton.model_cfg
    if model.moe is None:
        return []
    out = []
    sequences = tokens_per_device(cfg, layout.shape) * sp / cfg.training.seq
    per_sequence = sequences * model.moe.experts * 4
    if sp > 1 and model.moe.balance_loss == "sequence" and per_sequence >= SMALL_BYTES:  # (less: listed as scalars)
        # The sequence-wise balance loss: each sequence's share of choices and mean score
        # per expert, and its choices per token, summed over its chunks (float32). The model's
        # layers only: multi-token prediction's router adds no balance loss (not `moe_runs`).
        out.append(Expected("all-reduce", "sp", model.moe_layers_run * stage_overhead(layout) * 3 * per_sequence
                            * 2 * (sp - 1) / sp, "MoE statistics per sequence"))
    if sp > 1 and cfg.moe.moe_dispatch == "capacity":
        # Each rank's two chunks' choices counted per expert (int32), gathered from the
        # others (spmd.parallel.context.make_capacity_slots); XLA runs the gather twice per layer.
        counts = sequences * 2 * model.moe.experts * 4
        out.append(Expected("all-gather", "sp", moe_runs(layout) * 2 * (sp - 1) * counts,
                            "capacity: each chunk's choices per expert, to rank them in the sequence"))
    tokens = live((*layout.data_axes, "sp"), layout.shape)
    if model.moe.balance_loss == "pooled" and tokens and not layout.schedule:
        # The pooled balance loss (transformers') needs each layer's choices and mean router
        # probability per expert over the whole batch, and the load per expert is reported:
        # three float32 vectors per MoE layer, summed over the axes that split the tokens.
        n = ways(tokens, layout.shape)
        out.append(Expected("all-reduce", "+".join(tokens), model.moe_layers * 3 * model.moe.experts * 4
                            * 2 * (n - 1) / n, "MoE statistics: choices, router probability and load per expert"))
    if ep == 1:
        return out
    out += expert_copies(cfg, layout)
    return out + expert_exchange(cfg, layout, compute_bytes, ragged=cfg.moe.moe_dispatch == "dropless"
                                 and ragged_exchange(layout.mesh) is not None)


def moe_runs(layout: Layout) -> float:
    """MoE layers a device runs on `tokens_per_device` rows: the model's (in pipeline
    stages 1/p of them each tick, bubbles included) and multi-token prediction's."""
    return layout.skeleton.model_cfg.moe_layers_run * stage_overhead(layout) + prediction_layers(layout)


def expert_copies(cfg, layout: Layout) -> list[Expected]:
    """Expert copies (spmd.parallel.balance.tie): in each MoE layer a device holds, the
    gradients of the R copy slots (to add to their homes) and then of their homes (to
    write back to the copies), 2R expert rows of every expert weight as the gradients are
    stored, one at a time: the device that holds the row picks it, and it is all-reduced
    over ep."""
    ep = layout.shape["ep"]
    tied = tied_rows_bytes(cfg, layout)
    return [Expected("all-reduce", "ep", 2 * (ep - 1) / ep * tied,
                     "expert copies: the copies' and their homes' gradients")] if tied else []


def tied_rows_bytes(cfg, layout: Layout, rows_of_one_copy: bool = False) -> float:
    """Bytes per device of the 2R expert rows of gradients that expert copies tie (every
    MoE layer the device holds, at once; or of one copy's 2 rows), or 0 without copies over ep."""
    ep, slots = layout.shape["ep"], layout.skeleton.routing.slots
    if ep == 1 or not slots:
        return 0.0
    copies = slots - layout.skeleton.model_cfg.moe.experts
    rows = 0.0
    for p in params(layout, cfg):
        if "experts" not in p.names or not p.trained or p.predicts:  # (the prediction modules' have no copies)
            continue
        split = set(live(spec_axes(p.names, layout.rules.grads), layout.shape)) - {"ep"}
        if layout.schedule and p.stacked:  # each stage holds its own layers
            split.add("pp")
        rows += p.numel / slots * p.itemsize / ways(split, layout.shape)
    return 2 * rows if rows_of_one_copy else 2 * copies * rows


def expert_exchange(cfg, layout: Layout, compute_bytes: int, ragged: bool) -> list[Expected]:
    """The all-to-alls of routed tokens over ep: capacity buffers, dropless blocks padded to
    the worst case (XLA:CPU), or, `ragged`, the rows there are (GPUs, TPUs: an expected
    k rows per token, (ep - 1) / ep of them leaving, as under balanced routing; the real
    figure follows the router)."""
    ep, model = layout.shape["ep"], layout.skeleton.model_cfg
    leaves = (ep - 1) / ep
    dropless = cfg.moe.moe_dispatch == "dropless"
    recomputed = cfg.model.remat != "none"  # the others run the forward exchanges again

    def per_layer(copies: bool) -> float:
        rows = tokens_per_device(cfg, layout.shape) * model.moe.top_k if ragged else expert_rows(cfg, layout, copies)
        exchange = rows * model.embed * compute_bytes * leaves
        indices = rows * 4 * leaves if dropless else 0  # each row's expert, forward only
        return (3 if recomputed else 2) * 2 * exchange + (2 if recomputed else 1) * indices
    kind = "ragged dropless rows" if ragged else "padded dropless blocks" if dropless else "capacity buffers"
    # In pipeline stages every tick runs the stage's layers, bubbles included; the
    # prediction modules' experts have no copies.
    layers = model.moe_layers_run * stage_overhead(layout) * per_layer(True)
    return [Expected("ragged-all-to-all" if ragged else "all-to-all", "ep",
                     layers + prediction_layers(layout) * per_layer(False), f"experts: routed tokens, {kind}")]


def entering_targets(cfg, layout: Layout) -> float:
    """Bytes of a device's pp group's targets (int32) that enter stages holding the head,
    with multi-token prediction's later inputs and targets (int32) per depth."""
    depth = prediction_depth(layout.skeleton.model_cfg)
    return tokens_per_device(cfg, layout.shape) * layout.schedule.stages * 4 * (1 + 2 * depth)


def stage_statistics(cfg, layout: Layout) -> list[Expected]:
    """The MoE layers' statistics as the stages' map ends, where the schedule writes its
    backward pass out: means over the batch axes the map is manual over
    (spmd.parallel.pipeline.kit.stage_statistics), in every accumulated round; per layer of
    the device's stages what the step reads of them, three scalars and, float32, a load per
    expert and, where the router keeps its state, one per slot. (Under gpipe and circular,
    differentiated by autodiff, XLA's program has no such bytes: deepseek-v3-small's
    preset, 2026-12-07.)"""
    schedule, model = layout.schedule, layout.skeleton.model_cfg
    written = schedule and schedule.writes_backward and model.moe
    shards = live(batch_axes(manual_axes(layout.shape)), layout.shape) if written else ()
    if not shards:
        return []
    n, route = ways(shards, layout.shape), layout.skeleton.routing
    layers = model.moe_layers_run * (2 if schedule.name == "dualpipe" else 1) / schedule.stages
    per_layer = (3 + model.moe.experts + ((route.slots or model.moe.experts) if route.balanced else 0)) * 4
    return [Expected("all-reduce", "+".join(shards), cfg.training.grad_accum * layers * per_layer * 2 * (n - 1) / n,
                     "MoE statistics: means over the batch shards as the stages end")]


def pipeline_stages(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    """Activations between pipeline stages (spmd.parallel.pipeline): each tick a stage's output
    microbatch to the next stage, forward and (its gradient) backward; entering, the
    embedded rows all-gathered over pp, leaving, the outputs reduce-scattered (and
    backward their gradients the other way)."""
    schedule = layout.schedule
    if schedule is None:
        return []
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    # The device's rows of the step before pp splits them (m microbatches), as the
    # residual stream lays them out (Megatron-SP splits their sequence over tp).
    split = layout.shape["tp"] if cfg.parallelism.megatron_sp else 1
    rows = tokens_per_device(cfg, layout.shape) * p * layout.skeleton.model_cfg.embed * compute_bytes / split
    ticks = v * m * stage_overhead(layout)  # v*m + p - 1
    leaves = (p - 1) / p
    # The rows entering have a gradient only where the embedding trains (not under LoRA).
    entering = 0 if layout.skeleton.lora else 1
    if schedule.name in SPLIT_BACKWARD:
        # One send per tick each way (none where the tick's pairing is empty: p = 2, every
        # other tick), the second chunk's weights exchanged entering and their gradients
        # leaving (float32, as stored: zb-v's half a stage, DualPipe's whole mirrored
        # stage; the weights once a step, the same in every accumulated pass, their
        # gradients once a pass); the rows move a rank a pair of ticks to where they enter,
        # and their gradients back home (Conveyor: no copy of them on every stage); the
        # targets enter as for 1f1b.
        def stored(p_):
            return p_.numel * p_.itemsize / ways(spec_axes(p_.names, layout.rules.params), layout.shape)
        dual, share = schedule.name == "dualpipe", schedule.mirrored_share
        weights = share * sum(stored(p_) for p_ in params(layout, cfg) if p_.stacked)
        gradients = cfg.training.grad_accum * share * sum(stored(p_) for p_ in params(layout, cfg)
                                                          if p_.stacked and p_.trained)
        targets = entering_targets(cfg, layout)
        # zb-v's MoE statistics leave the stages split over pp, and every device reads them
        # all: per layer three scalars and, float32, a load per slot and one per expert.
        # DualPipe's second stage's are sent to the mirror stage and added to its own there.
        model = layout.skeleton.model_cfg
        statistics = (model.moe_layers_run
                      * (3 + model.moe.experts + (layout.skeleton.routing.slots or model.moe.experts)) * 4
                      if model.moe else 0)
        if dual:
            weights += statistics / (2 * p)
        else:
            targets += statistics
        fed, returned = zero_bubble.conveyed(p, m, dual)
        moved = (zero_bubble.sends(p, m, dual) + fed + entering * returned) * rows / m
        return [Expected("collective-permute", "pp", moved + weights + gradients,
                         "chunk outputs and their gradients; rows to where they enter and their gradients home; "
                         "the second chunk's weights, gradients (and DualPipe's MoE statistics)"),
                Expected("all-gather", "pp", leaves * targets, "targets entering the stages; MoE statistics leaving")]
    if head_in_stages(layout):
        # Forward sends in the warm-up and steady ticks, backward ones in the steady and
        # cool-down ticks; where the cool-down is one tick (1f1b, p = 2: vp - 1 ticks) its
        # unused send is dropped. Only x enters (with the targets, int32) and only its
        # gradient leaves.
        sends = 2 * ticks - (1 if v * p == 2 else 0)
        targets = entering_targets(cfg, layout)
        return [Expected("collective-permute", "pp", sends * rows / m, "stage outputs forward, their gradients back"),
                Expected("all-gather", "pp", leaves * (rows + targets), "rows and targets entering the stages"),
                Expected("reduce-scatter", "pp", entering * leaves * rows, "the gradient of the rows entering")]
    return [Expected("collective-permute", "pp", 2 * ticks * rows / m, "stage outputs forward, their gradients back"),
            Expected("all-gather", "pp", 2 * leaves * rows, "rows entering the stages; output gradients"),
            Expected("reduce-scatter", "pp", (1 + entering) * leaves * rows, "rows leaving the stages; input gradients")]
