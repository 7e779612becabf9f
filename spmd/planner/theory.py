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
  layer under full remat, which recomputes the forward up to the MLP); a vocab split over tp adds one
  all-reduce for the embedding lookup, one for the output head's input gradient and
  three small ones for the softmax statistics (max, sum, target logit);
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

Expert copies (spmd.parallel.balance) add one all-reduce over ep of the experts' gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
from flax import traverse_util

from models import model_class
from models.lora import MLP_TARGETS, is_adapter
from spmd.parallel import pipeline, zero_bubble
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import AXES, BATCH_AXES
from spmd.parallel.rules import axes_of, spec_for
from spmd.parallel.skeleton import DTYPES, is_names, routing


@dataclasses.dataclass(frozen=True)
class Expected:
    op: str
    axes: str  # "+"-joined mesh axes, outer to inner (as spmd.planner.traffic names them)
    bytes_per_device: float
    why: str


@dataclasses.dataclass(frozen=True)
class Param:
    path: str
    numel: int
    itemsize: int
    names: tuple
    stacked: bool  # one slice per layer, used inside the layer scan
    trained: bool = True  # False: a LoRA run's frozen base (no gradient, no optimizer state)
    adapter: bool = False  # a LoRA adapter's matrix (models.lora)


def uses(p: Param, model_cfg, compute_bytes: int) -> tuple[int, ...]:
    """Bytes per element of each use of a parameter, as models.llama computes with it:
    vectors (norm scales), what is added per element without multiplying the residual
    stream (biases, which have no embed dimension) and the lookup table in float32,
    matrices (adapters' too) in the compute dtype, and a tied embedding also as the output head."""
    if p.path == model_class(model_cfg).LOOKUP_TABLE:  # its rows are read in float32
        return (4, compute_bytes) if model_cfg.tie_embeddings else (4,)
    return (4,) if not p.adapter and (_is_vector(p) or "embed" not in p.names) else (compute_bytes,)


def _is_vector(p: Param) -> bool:
    return len([n for n in p.names if n != "layers"]) == 1


def params(layout: Layout, cfg=None) -> list[Param]:
    """The model's parameters; of a LoRA run (`cfg`), the frozen ones stored in --base-dtype."""
    shapes = traverse_util.flatten_dict(layout.skeleton.shapes)
    names = traverse_util.flatten_dict(layout.skeleton.names, is_leaf=lambda _, v: is_names(v))
    lora = layout.skeleton.lora is not None
    base_bytes = jnp.dtype(DTYPES[cfg.base_dtype]).itemsize if lora and cfg is not None else 4
    found = []
    for path in shapes:
        trained = not lora or is_adapter(path)
        found.append(Param(".".join(map(str, path)), math.prod(shapes[path].shape),
                           jnp.dtype(shapes[path].dtype).itemsize if trained else base_bytes, names[path],
                           "layers" in names[path], trained, lora and trained))
    return found


def live(axes, shape: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(a for a in AXES if a in axes and shape[a] > 1)


def ways(axes, shape: Mapping[str, int]) -> int:
    return math.prod(shape[a] for a in axes)


def spec_axes(names, table) -> tuple[str, ...]:
    return tuple(a for entry in spec_for(names, table) for a in axes_of(entry))


def tokens_per_device(cfg, shape: Mapping[str, int], microbatch: bool = False) -> int:
    """Tokens one device computes on in a step (or in one accumulated microbatch), outside
    pipeline stages (where pp splits the rows too)."""
    rows = cfg.microbatch if microbatch else cfg.batch
    return rows * cfg.seq // (ways(BATCH_AXES, shape) * shape["sp"] * shape["pp"])


def stage_overhead(layout: Layout) -> float:
    """Executed over useful work of the stacked layers: every stage runs every tick of
    its schedule, (v*m + p - 1)/(v*m) of the useful ones (1f1b: GPipe's, v = 1;
    interleaved-1f1b: circular's); 1
    without a pipeline. Each device runs 1/p of the layers on p times `tokens_per_device`."""
    return 1 / (1 - layout.schedule.bubble) if layout.schedule else 1.0


def _head_in_stages(layout: Layout) -> bool:
    return layout.schedule is not None and layout.schedule.writes_backward


def _backward_gathers(cfg, layout: Layout, stage_runs: float) -> float:
    """How often the backward pass gathers the stacked weights again (once per forward).
    In GPipe stages XLA hoists that gather out of the backward tick loop (the weights are
    the same every tick), under every remat policy: once. A circular schedule under remat
    "full" runs each tick's forward once more in the backward pass (spmd.parallel.pipeline.
    _run_chunk): twice per forward."""
    if layout.schedule is None or layout.schedule.writes_backward:
        return stage_runs
    if _picks_again(layout):
        return stage_runs * (2 if cfg.remat == "full" else 1)
    return 1


def _picks_again(layout: Layout) -> bool:
    """Whether autodiff's backward pass picks each tick's chunk again under the model's
    remat policy (circular: spmd.parallel.pipeline._run_chunk); the written-out backward of
    interleaved-1f1b runs each chunk's backward once."""
    return layout.schedule is not None and layout.schedule.repeats > 1 and not layout.schedule.writes_backward


def compute_table(layout: Layout) -> Mapping:
    """How parameters are laid out where used: the activations' rules, and under pipeline
    stages the stacked layers split over pp (each stage runs its own)."""
    table = layout.rules.activations
    return {**table, "layers": "pp"} if layout.schedule else table


def collectives(cfg, layout: Layout) -> list[Expected]:
    shape, rules = layout.shape, layout.rules
    compute_bytes = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    model_cfg = layout.skeleton.model_cfg
    used_table = compute_table(layout)
    # Weight gradients are summed over every axis that splits the tokens.
    plain_tokens = live((*layout.data_axes, "sp"), shape)
    # Under Megatron-SP the residual stream is split over tp too, and with it the tokens
    # that the vectors used on it (norm scales) see.
    residual_tokens = live((*layout.data_axes, "sp", "tp"), shape) if cfg.megatron_sp else plain_tokens
    # How often a device runs its share of the stacked layers forward: once per
    # microbatch; in pipeline stages a 1/v chunk of them each tick.
    stage_runs = cfg.grad_accum * (layout.schedule.microbatches if layout.schedule else 1) * stage_overhead(layout)
    out: list[Expected] = []
    for p in params(layout, cfg):
        compute = spec_axes(p.names, used_table)
        summed = residual_tokens if _is_vector(p) else plain_tokens
        if _is_vector(p) and "head_dim" in p.names:  # a per-head norm (Qwen3's q/k): every head's share adds up
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
        gathered = live(set(at_rest) - set(compute), shape)
        if gathered and layout.schedule and p.stacked and pipeline.BATCH_AXIS in gathered:
            # Stored split over dp (ZeRO-3), the stages' weights enter the map (manual over
            # dp) gathered over it, once per step; over the rest (fsdp) as below.
            n = shape[pipeline.BATCH_AXIS]
            out.append(Expected("all-gather", pipeline.BATCH_AXIS, (n - 1) / n * slice_numel * p.itemsize / ways(
                [a for a in gathered if a != pipeline.BATCH_AXIS], shape), "stage weights entering the pipeline"))
            gathered = tuple(a for a in gathered if a != pipeline.BATCH_AXIS)
        if gathered:
            n = ways(gathered, shape)
            # Stacked weights are gathered in the layer scans of every microbatch (every
            # tick of a pipeline), and again in backward; the others once.
            times = (stage_runs + _backward_gathers(cfg, layout, stage_runs)) if p.stacked else 1
            out.append(Expected("all-gather", "+".join(gathered), times * (n - 1) / n * slice_numel * sum(widths),
                                "weights gathered where used" + (", again in backward" if p.stacked else "")))
        fused = _table_scatter_axes(cfg, layout) if p.path == model_class(model_cfg).LOOKUP_TABLE else ()
        if fused:  # reduce-scattered together with tp's (_tensor_parallel); the rest reduces that shard
            token_axes, grad_numel = tuple(a for a in token_axes if a not in fused), grad_numel / ways(fused, shape)
        # A tied table's two uses (the lookup, the head) are reduced each on its own, as
        # computed (models.annotate.weight reduces each use's gradient where it is taken).
        if not p.trained:  # a frozen weight is only read
            continue
        per_use = [(w,) for w in widths] if len(widths) > 1 and not _accumulated(cfg, layout) else [widths]
        for use in per_use:
            out += _gradients(cfg, layout, p, token_axes, grad_numel, use, stage_runs)
        out += _shared_kv_heads(cfg, layout, p, max(widths), stage_runs)
        regather = live(set(spec_axes(p.names, rules.opt_state)) - set(at_rest), shape)
        if regather:
            n = ways(regather, shape)
            stored = p.numel * p.itemsize / ways(at_rest, shape)
            out.append(Expected("all-gather", "+".join(regather), (n - 1) / n * stored,
                                "parameters after the sharded optimizer update (ZeRO-1/2)"))
    out += _tensor_parallel(cfg, layout, compute_bytes)
    out += _sequence_parallel(cfg, layout, compute_bytes)
    out += _expert_parallel(cfg, layout, compute_bytes)
    out += [e for e in _pipeline(cfg, layout, compute_bytes) if e.bytes_per_device]
    return out


def _gradients(cfg, layout: Layout, p: Param, token_axes: tuple[str, ...], slice_numel: float,
               widths: tuple[int, ...], stage_runs: float) -> list[Expected]:
    """A parameter's gradient, summed over `token_axes`: reduce-scattered over the axes it
    is stored split over, all-reduced over the rest. It is summed in the widest dtype of
    its uses, or in float32 (the accumulators' dtype) when summed over microbatches (or
    pipeline ticks) before the one reduction."""
    if layout.schedule and p.stacked and cfg.grad_accum == 1:
        # In the stages: over the automatic axes (fsdp) each tick, as computed; over the
        # manual ones (dp) once, after the ticks are summed.
        manual = tuple(a for a in token_axes if a == pipeline.BATCH_AXIS)
        phases = [(tuple(a for a in token_axes if a not in manual), stage_runs, max(widths)), (manual, 1, p.itemsize)]
    elif _accumulated(cfg, layout):
        # Accumulated (spmd.parallel.step): over the axes inside the per-shard vmap (sp, and ep with
        # split experts) in every microbatch, as computed; over the accumulation axes once,
        # the float32 sums.
        once = tuple(a for a in token_axes if a in layout.accumulation_axes)
        phases = [(tuple(a for a in token_axes if a not in once), cfg.grad_accum, max(widths)), (once, 1, p.itemsize)]
    else:
        # 1f1b sums the head's gradients over microbatches before reducing them (and
        # pipeline rounds theirs over rounds).
        summed_first = cfg.grad_accum > 1 or (_head_in_stages(layout) and not p.stacked)
        phases = [(token_axes, 1, p.itemsize if summed_first else max(widths))]
    stored_split = live(spec_axes(p.names, layout.rules.grads), layout.shape)
    out, numel = [], slice_numel
    for axes, times, width in phases:
        scatter = tuple(a for a in stored_split if a in axes)
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


def _accumulated(cfg, layout: Layout) -> bool:
    """Whether gradients are summed per shard over microbatches (spmd.parallel.step's vmap)."""
    return cfg.grad_accum > 1 and not layout.schedule


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


def _table_scatter_axes(cfg, layout: Layout) -> tuple[str, ...]:
    """Under Megatron-SP with the vocabulary split over tp, XLA reduce-scatters the lookup
    table's gradient over tp and over the token axes it is stored split over (fsdp, sp) in
    one collective: those axes."""
    shape, rules = layout.shape, layout.rules
    if not (cfg.megatron_sp and shape["tp"] > 1 and "tp" in axes_of(rules.activations["vocab"])):
        return ()
    table = next(p for p in params(layout) if p.path == model_class(layout.skeleton.model_cfg).LOOKUP_TABLE)
    stored = spec_axes(table.names, rules.grads)
    return live([a for a in stored if a != "tp" and a in (*layout.data_axes, "sp")], shape)


def _adapters_over_tp(cfg, layout: Layout, token_bytes: float, per_layer: float) -> list[Expected]:
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

    forward = count(("o_proj", "down_proj")) * (2 if cfg.remat == "full" else 1)
    backward = count(("q_proj", "gate_proj", "up_proj") + (("k_proj", "v_proj") if c == 1 else ()))
    rank = token_bytes * lora.rank
    out = [Expected("all-reduce", "tp", per_layer * (forward + backward) * 2 * (t - 1) / t * rank,
                    "LoRA: adapters' rank-wide products on split projections")]
    kv, shared = model.kv_heads, per_layer * count(("k_proj", "v_proj")) if c > 1 else 0
    if shared:
        out += [Expected("all-reduce", f"tp:inner{c}", shared * 2 * (c - 1) / c * token_bytes * model.head_dim,
                         "LoRA: a shared kv head's output gradient, over the devices sharing it"),
                Expected("all-reduce", f"tp:outer{kv}", shared * 2 * (kv - 1) / kv * rank,
                         "LoRA: keys' and values' rank-wide products over the kv heads")]
    return out


def _tensor_parallel(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    t = layout.shape["tp"]
    if t == 1:
        return []
    model = layout.skeleton.model_cfg
    tokens = tokens_per_device(cfg, layout.shape)
    activation = tokens * model.embed * compute_bytes  # outside pipeline stages: the head's input
    # 1f1b runs the head on the last stage, per microbatch: in a branch that every device's
    # program holds in each of its v*m + p - 1 forward ticks (taken there on the last stage
    # only, by interleaved-1f1b only in a microbatch's last round), so the compiled step
    # counts it once per tick, on a microbatch of its pp group's rows.
    head_tokens = tokens * (layout.shape["pp"] * layout.schedule.repeats * stage_overhead(layout)
                            if _head_in_stages(layout) else 1)
    head_input = head_tokens * model.embed * compute_bytes
    per_layer = stage_overhead(layout)  # the layers' activations, in pipeline stages, bubble ticks included
    lookup = tokens * model.embed * 4  # float32 rows (the model's LOOKUP_TABLE)
    vocab_split = "tp" in axes_of(layout.rules.activations["vocab"])
    out = []

    def reduced(nbytes: float, times: float, why: str):
        """`times` all-reduces of `nbytes`; under Megatron-SP each is a reduce-scatter
        into the sequence-split residual stream and an all-gather out of it."""
        if cfg.megatron_sp:
            out.append(Expected("reduce-scatter", "tp", times * (t - 1) / t * nbytes, why))
            out.append(Expected("all-gather", "tp", times * (t - 1) / t * nbytes, why))
        else:
            out.append(Expected("all-reduce", "tp", times * 2 * (t - 1) / t * nbytes, why))

    # Per layer: the attention and MLP outputs forward, their input gradients backward. An
    # MoE layer's experts reduce their rows instead (and its shared expert the tokens).
    moe_layers = model.moe_layers
    dense = model.layers - moe_layers + (moe_layers if model.moe and model.moe.shared_experts else 0)
    reduced(activation, per_layer * (2 * model.layers + 2 * dense),
            "Megatron: block outputs forward, block input gradients backward")
    if _picks_again(layout) and cfg.remat == "full":
        reduced(activation, per_layer * 2 * model.layers, "circular stages: each tick's forward again")
    out += _adapters_over_tp(cfg, layout, tokens * compute_bytes, per_layer)
    if moe_layers:
        rows = expert_rows(cfg, layout) * model.embed * compute_bytes
        out.append(Expected("all-reduce", "tp", per_layer * moe_layers * 2 * 2 * (t - 1) / t * rows,
                            "experts: their outputs forward, their input gradients backward"))
    if cfg.remat == "full":
        # The forward is recomputed up to the MLP (its output is not needed for gradients).
        layers = per_layer * model.layers
        if cfg.megatron_sp:  # attention input and output, and the MLP's input, again
            out.append(Expected("all-gather", "tp", 2 * layers * (t - 1) / t * activation, "remat"))
            out.append(Expected("reduce-scatter", "tp", layers * (t - 1) / t * activation, "remat"))
        else:
            reduced(activation, layers, "remat: the attention output again")
    if vocab_split and cfg.megatron_sp:
        # XLA gathers the float32 table for the lookup (and reduce-scatters its gradient)
        # rather than reduce-scattering the looked-up rows.
        table = model.vocab * model.embed * 4
        out.append(Expected("all-gather", "tp", (t - 1) / t * table, "vocab split: the table, for the lookup"))
        fused = _table_scatter_axes(cfg, layout)
        n = t * ways(fused, layout.shape)
        out.append(Expected("reduce-scatter", "+".join(live((*fused, "tp"), layout.shape)), (n - 1) / n * table,
                            "vocab split: the table's gradient"))
        reduced(head_input, 1, "vocab split: the output head's input")
    elif vocab_split:
        reduced(lookup, 1, "vocab split: embedding lookup (float32 rows)")
        reduced(head_input, 1, "vocab split: the output head's input")
    if vocab_split:
        out.append(Expected("all-reduce", "tp", 2 * (t - 1) / t * head_tokens * 4 * 3, "vocab split: softmax statistics"))
    return out


def _sequence_parallel(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    """K/V traffic of attention over sp (spmd.parallel.context), per layer."""
    n = layout.shape["sp"]
    if n == 1:
        return []
    model, shape = layout.skeleton.model_cfg, layout.shape
    kv_heads = model.kv_heads * layout.kv_copies / ways(("tp",), shape) if layout.kv_copies > 1 else \
        model.kv_heads / ways(axes_of(layout.rules.activations["kv_heads"]), shape)
    block = cfg.batch / ways(BATCH_AXES, shape) * cfg.seq / n * kv_heads * model.head_dim * compute_bytes
    recomputed = cfg.remat != "none"  # "none" keeps the received blocks; the others fetch them again
    # In pipeline stages a device runs 1/pp of the layers, in every tick (bubbles included).
    layers = model.layers * stage_overhead(layout) / shape["pp"]
    if cfg.attention == "ring":
        hops = 2 * (n - 1) * (3 if recomputed else 2)  # K and V: forward, their gradients back, [forward again]
        return [Expected("collective-permute", "sp", layers * hops * block, "ring attention: K/V blocks")]
    gathers = 2 * (2 if recomputed else 1)
    return [Expected("all-gather", "sp", layers * gathers * (n - 1) * block, "attention: K and V gathered"),
            Expected("reduce-scatter", "sp", layers * 2 * (n - 1) * block, "attention: K/V gradients")]


def expert_rows(cfg, layout: Layout) -> int:
    """Rows of tokens each device runs through its experts per MoE layer (spmd.parallel.experts):
    capacity mode's buffers, or the dropless choices (padded per destination over ep)."""
    moe, ep, sp = layout.skeleton.model_cfg.moe, layout.shape["ep"], layout.shape["sp"]
    tokens = tokens_per_device(cfg, layout.shape)
    capacity = routing(cfg).capacity(cfg.seq, moe)
    slots = routing(cfg).slots or moe.experts  # with copies (spmd.parallel.balance), each slot is an expert here
    if capacity is not None:  # per sequence; a device's chunk of c tokens fills at most c slots
        chunk = cfg.seq // sp
        return tokens // chunk * slots * min(capacity, chunk)
    return tokens * ep * min(moe.top_k, slots // ep)


def _expert_parallel(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
    """All-to-all of tokens over ep, per MoE layer (spmd.parallel.experts); in capacity mode with
    the sequence split over sp, the per-expert counts of every chunk's choices, gathered
    over sp to rank each choice in its sequence."""
    ep, sp, model = layout.shape["ep"], layout.shape["sp"], layout.skeleton.model_cfg
    if model.moe is None:
        return []
    out = []
    if sp > 1 and cfg.moe_dispatch == "capacity":
        # Each rank's two chunks' choices counted per expert (int32), gathered from the
        # others (spmd.parallel.context.make_capacity_slots); XLA runs the gather twice per layer.
        sequences = tokens_per_device(cfg, layout.shape) * sp / cfg.seq
        counts = sequences * 2 * model.moe.experts * 4
        out.append(Expected("all-gather", "sp", model.moe_layers * stage_overhead(layout) * 2 * (sp - 1) * counts,
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
    if routing(cfg).slots:  # expert copies: each copy's gradient summed with its twins' (spmd.parallel.balance.tie)
        expert_grads = model.moe_layers * model.moe.experts * 3 * model.embed * model.moe.expert_mlp * 4
        out.append(Expected("all-reduce", "ep", 2 * (ep - 1) / ep * expert_grads,
                            "expert copies: gradients summed per expert"))
    rows, leaves = expert_rows(cfg, layout), (ep - 1) / ep
    dropless = cfg.moe_dispatch == "dropless"
    exchange = rows * model.embed * compute_bytes * leaves
    indices = rows * 4 * leaves if dropless else 0  # each row's expert, forward only
    recomputed = cfg.remat != "none"  # the others run the forward exchanges again
    per_layer = (3 if recomputed else 2) * 2 * exchange + (2 if recomputed else 1) * indices
    # In pipeline stages every tick runs the stage's layers, bubbles included.
    return out + [Expected("all-to-all", "ep", model.moe_layers * stage_overhead(layout) * per_layer,
                           f"experts: routed tokens, {'padded dropless blocks' if dropless else 'capacity buffers'}")]


def _pipeline(cfg, layout: Layout, compute_bytes: int) -> list[Expected]:
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
    split = layout.shape["tp"] if cfg.megatron_sp else 1
    rows = tokens_per_device(cfg, layout.shape) * p * layout.skeleton.model_cfg.embed * compute_bytes / split
    ticks = v * m * stage_overhead(layout)  # v*m + p - 1
    leaves = (p - 1) / p
    # The rows entering have a gradient only where the embedding trains (not under LoRA).
    entering = 0 if layout.skeleton.lora else 1
    if schedule.name == "zb-v":
        # One send per tick each way (none where the tick's pairing is empty: p = 2, every
        # other tick), the second chunk's weights exchanged entering and their gradients
        # leaving (float32, as stored); rows and targets enter and their gradient leaves as
        # for 1f1b.
        def stored(p_):
            return p_.numel * p_.itemsize / ways(spec_axes(p_.names, layout.rules.params), layout.shape)
        weights = sum(stored(p_) for p_ in params(layout, cfg) if p_.stacked) / 2
        gradients = sum(stored(p_) for p_ in params(layout, cfg) if p_.stacked and p_.trained) / 2
        targets = tokens_per_device(cfg, layout.shape) * p * 4
        return [Expected("collective-permute", "pp", zero_bubble.sends(p, m) * rows / m + weights + gradients,
                         "chunk outputs and their gradients; the second chunk's weights and gradients"),
                Expected("all-gather", "pp", leaves * (rows + targets), "rows and targets entering the stages"),
                Expected("reduce-scatter", "pp", entering * leaves * rows, "the gradient of the rows entering")]
    if _head_in_stages(layout):
        # Forward sends in the warm-up and steady ticks, backward ones in the steady and
        # cool-down ticks; where the cool-down is one tick (1f1b, p = 2: vp - 1 ticks) its
        # unused send is dropped. Only x enters (with the targets, int32) and only its
        # gradient leaves.
        sends = 2 * ticks - (1 if v * p == 2 else 0)
        targets = tokens_per_device(cfg, layout.shape) * p * 4
        return [Expected("collective-permute", "pp", sends * rows / m, "stage outputs forward, their gradients back"),
                Expected("all-gather", "pp", leaves * (rows + targets), "rows and targets entering the stages"),
                Expected("reduce-scatter", "pp", entering * leaves * rows, "the gradient of the rows entering")]
    return [Expected("collective-permute", "pp", 2 * ticks * rows / m, "stage outputs forward, their gradients back"),
            Expected("all-gather", "pp", 2 * leaves * rows, "rows entering the stages; output gradients"),
            Expected("reduce-scatter", "pp", (1 + entering) * leaves * rows, "rows leaving the stages; input gradients")]


def by_op_and_axes(expected: list[Expected]) -> dict[tuple[str, str], float]:
    totals: dict[tuple[str, str], float] = {}
    for e in expected:
        totals[(e.op, e.axes)] = totals.get((e.op, e.axes), 0.0) + e.bytes_per_device
    return totals
