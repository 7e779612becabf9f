"""Pipelined steps: the model split into what runs outside the stages (the embedding, the
head and the loss) and what the stages run (chunks of the stacked layers), and the loss and
gradients of a step under each schedule (spmd.parallel.pipeline, spmd.parallel.pipeline.zero_bubble):
GPipe and circular differentiated by autodiff, 1F1B and zb-v computing the stages'
gradients themselves."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import model_class
from models.attention import Packing
from models.lora import dropping, joined
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import BATCH_AXES
from spmd.parallel.objective import (AuxLosses, Columns, aux_weights_per_layer, model_columns, moe_metrics, objective,
                                     predicted_further, prediction_depth)
from spmd.parallel.pipeline import (SPLIT_BACKWARD, Head, MapSpecs, PipelineRun, StageProgram, batch_axes,
                                    from_microbatches, manual_axes, manual_spec, one_f_one_b, pipeline, stacked_spec,
                                    to_microbatches)
from spmd.parallel.rules import spec_for
from spmd.parallel.skeleton import is_names
from spmd.parallel.pipeline.zero_bubble import zb_v


class Auxiliary(NamedTuple):
    """What a step's loss reads besides the trained parameters and the rows: the terms added
    to it (`aux`; None: the run's, as evaluated, spmd.parallel.step fills it in), the MoE
    layers' router state (`router`, spmd.parallel.balance; None if the model keeps none),
    the count of targets its mean is over (`denominator`: packed rows'; None: each
    microbatch's own mean) and the parameters that are not trained (`frozen`: a LoRA run's
    base; None if all are)."""
    aux: AuxLosses | None = None
    router: dict | None = None
    denominator: jax.Array | None = None
    frozen: dict | None = None


class StageParts(NamedTuple):
    model_of: object  # outer params -> the model, its stages' weights as placeholders
    outer: dict  # the non-stacked parameters
    columns: Columns  # the batch as the model reads it
    blocks: dict  # what the stages take: the stacked weights (and router state)
    stage: object  # stage(chunk, x, packing=None, fixed=None) -> (y, statistics)
    # What the stages read but do not differentiate, stored as the blocks are: a frozen
    # base's stacked weights and the layers' structure (LAYER_STRUCTURE); None if neither.
    fixed: dict | None = None

    def embedded(self) -> jax.Array:
        return self.model_of(self.outer).embed(self.columns.inputs, self.columns.positions, self.columns.packing)

    def side(self, shards: int, schedule) -> Packing | None:
        """What the stages read of each microbatch besides its activations: its examples'
        segment ids and positions (packed rows), as (m, mb, seq) arrays; else None."""
        packing = self.columns.packing
        return None if packing is None else jax.tree.map(lambda a: to_microbatches(a, shards, schedule), packing)


# The layers' structure, as int32 arrays beside the stacked weights (one entry per stored
# layer) in what the stages read: each layer's kind (Gemma 3's sliding 1, global 0), its
# index (which adapters' dropout reads) and whether it is a layer (1) or an empty one
# (LlamaConfig.empty_layers). Keys, in the order the model's run_layers takes them.
LAYER_STRUCTURE = ("layer_kinds", "layer_indices", "layer_filled")


def stage_parts(graphdef, params, rows, in_stage, stacked: str, order: np.ndarray | None,
                inputs: Auxiliary = Auxiliary(), layout: Layout | None = None) -> StageParts:
    """What a pipelined step is made of: the model less its stages' weights (a model of
    their shapes holds their place; `model_of(outer)`), the non-stacked parameters, the
    batch's columns (in the order sp lays them out), the stages' input `blocks`, and
    `stage(chunk, x, packing)`, which runs a chunk of them on one microbatch (of packed
    rows: with its examples) under the rules inside the stages and returns its output and
    its layers' statistics (MoE layers'). `layout`: the run's, for how the stacked layers
    are stored (circular's repeats) and, where `inputs.aux` weighs multi-token prediction,
    its columns; None: one chunk per stage, no prediction further.

    The blocks are the stacked weights, with the MoE layers' router state if the model
    keeps one (`inputs.router`, spmd.parallel.balance): the schedules differentiate whole
    chunks, so it rides in them as float32 (exact for slot numbers), with a zero gradient
    (it only chooses experts); `_weights_of` takes it out of their gradients.

    What the stages read and no one differentiates is `fixed`, which every schedule slices
    as it slices the blocks and passes beside each chunk: the stacked part of `inputs.frozen`
    (parameters that are not trained: a LoRA run's base, `params` being the adapters), and
    the layers' structure where they differ (`LAYER_STRUCTURE`: Gemma 3's kinds, empty
    layers, dropout's indices), so that each chunk runs its own layers' pattern."""
    router, frozen = inputs.router, inputs.frozen
    repeats, depth = (1, 0) if layout is None else (layout.repeats, _depth(inputs.aux, layout))
    columns = model_columns(rows, order, depth)
    positions = columns.positions  # a constant (numpy), which the stages' map may close over
    every = params if frozen is None else joined(frozen, params)
    outer = {name: value for name, value in every.items() if name != stacked}
    blocks = params[stacked]
    fixed = None if frozen is None else frozen[stacked]
    if router:
        blocks = joined(blocks, jax.tree.map(lambda x: x.astype(jnp.float32), router[stacked]))
    # (The router state among them: the model of their shapes holds its place too.)
    no_blocks = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype), joined(fixed or {}, blocks))
    model_of = lambda outer: nnx.merge(graphdef, joined(outer, {stacked: no_blocks}))  # noqa: E731
    model = model_of(outer)
    blocks_graph = nnx.split(getattr(model, stacked))[0]
    structure = _layer_structure(model, jax.tree.leaves(no_blocks)[0].shape[:2 if repeats > 1 else 1])
    fixed = joined(fixed or {}, structure) or None

    def stage(chunk, x, packing=None, fixed=None):
        chunk = joined(fixed or {}, chunk)
        local, indices, filled = (chunk.pop(key, None) for key in LAYER_STRUCTURE)
        with in_stage():
            return model_of(outer).run_layers(nnx.merge(blocks_graph, chunk), x, positions, packing,
                                              None if local is None else local == 1, indices,
                                              filled=None if filled is None else filled == 1)

    return StageParts(model_of, outer, columns, blocks, stage, fixed)


def _depth(aux: AuxLosses | None, layout: Layout) -> int:
    """Multi-token prediction's columns in the batch: the model's depth where `aux` weighs it, else 0."""
    return 0 if aux is None or aux.mtp_weight is None else prediction_depth(layout.skeleton.model_cfg)


def _layer_structure(model, stored: tuple[int, ...]) -> dict:
    """The `LAYER_STRUCTURE` arrays the model's layers need, shaped `stored` (as the stacked
    layers are stored: (layers,), or circular's (repeats, layers / repeats)); none where
    every layer is alike."""
    kinds, filled = model.layer_kinds(model.cfg), model.cfg.filled_steps()
    kind_key, index_key, filled_key = LAYER_STRUCTURE
    out = {}
    if kinds is not None:  # empty layers, stored last, take the kind 0: they run nothing
        out[kind_key] = np.concatenate([kinds, np.zeros(math.prod(stored) - len(kinds), bool)])
    if filled is not None:
        out[filled_key] = filled
    if dropping():
        out[index_key] = np.arange(math.prod(stored))
    return {key: jnp.asarray(value, jnp.int32).reshape(stored) for key, value in out.items()}


def _weights_of(tree: dict, weights: dict) -> dict:
    """The part of `tree` (blocks' gradients) at the paths of `weights`."""
    return {k: _weights_of(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in weights.items()}


def map_specs(layout: Layout, parts: StageParts, head=None) -> MapSpecs:
    """How the pipeline's map takes the stages' weights, the `head`'s and the stages'
    fixed part: by their names (`manual_spec`: the stacked layers over pp, experts over ep);
    what has no weight's names (the router state, the layers' structure) as the stacked
    layers are stored."""
    names, stacked = layout.skeleton.names, model_class(layout.skeleton.model_cfg).STACKED
    manual = manual_axes(layout.shape)

    def specs(tree, at, stacked: bool):
        default = stacked_spec(layout.repeats) if stacked else jax.P()

        def spec(path, _):
            node = at
            for key in path:
                node = node.get(getattr(key, "key", None)) if isinstance(node, dict) else None
                if node is None:
                    return default
            return manual_spec(node, stacked, manual) if is_names(node) else default
        return jax.tree_util.tree_map_with_path(spec, tree)

    return MapSpecs(specs(parts.blocks, names[stacked], True), specs(head or {}, names, False),
                    specs(parts.fixed or {}, names[stacked], True))


def _pipeline_run(layout: Layout, specs: MapSpecs) -> PipelineRun:
    """The run's pipeline: its mesh and schedule, one microbatch of the residual stream
    (batch, seq, embed) as the rules lay it out, and the weights' `specs`."""
    rows = spec_for(("batch", "residual_seq", "embed"), {**layout.rules.activations, "batch": BATCH_AXES})
    return PipelineRun(layout.mesh, layout.schedule, rows, specs)


def pipelined_loss(graphdef, params, rows, layout: Layout, in_stage, order, inputs: Auxiliary) -> tuple[jax.Array, dict]:
    """`model_loss` with the stacked layers run as pipeline stages (spmd.parallel.pipeline); the
    embedding, head and loss run outside, on rows split over the data axes and pp. `params`:
    all the model's (a frozen base joined to them: autodiff takes what is trained), so
    `inputs.frozen` is not read; `inputs.aux` is given."""
    schedule, shards = layout.schedule, layout.batch_shards
    aux, denominator = inputs.aux, inputs.denominator
    parts = stage_parts(graphdef, params, rows, in_stage, model_class(layout.skeleton.model_cfg).STACKED, order,
                        inputs._replace(frozen=None), layout)
    model, columns = parts.model_of(parts.outer), parts.columns
    x = to_microbatches(parts.embedded(), shards, schedule)
    out, stats = pipeline(_pipeline_run(layout, map_specs(layout, parts)),
                          StageProgram(parts.stage, parts.blocks, parts.side(shards, schedule), parts.fixed), x,
                          model.remat_policy())
    hidden = from_microbatches(out, shards, schedule)
    loss, metrics = objective(model.logits(hidden), columns.targets, _of_layers(stats, model.cfg), aux,
                              columns.weights, denominator)
    return predicted_further(model, hidden, columns, aux, loss, metrics | _stacked_loads(stats), denominator)


def one_f_one_b_grads(graphdef, params, rows, layout: Layout, in_stage, order, inputs: Auxiliary) -> tuple[dict, dict]:
    """Metrics and gradients of `pipelined_loss` under the 1F1B schedule, which computes
    the stages' gradients itself (spmd.parallel.pipeline.one_f_one_b); autodiff does the rest.
    Gradients of `params` only, not of the `inputs.frozen` rest (a LoRA run's base);
    `inputs.aux` is given."""
    schedule, shards = layout.schedule, layout.batch_shards
    aux, denominator = inputs.aux, inputs.denominator
    family = model_class(layout.skeleton.model_cfg)
    parts = stage_parts(graphdef, params, rows, in_stage, family.STACKED, order, inputs, layout)
    model_of, outer, columns = parts.model_of, parts.outer, parts.columns
    trained = {name: value for name, value in params.items() if name != family.STACKED}  # of the outer ones
    head_names = [name for name in family.head_params(layout.skeleton.model_cfg) if name in trained]
    # Packed rows: each microbatch's loss over its share of the step's count (the schedule
    # averages the microbatches' losses over them and over the batch shards of the map).
    shard_count = math.prod(layout.shape[a] for a in batch_axes(manual_axes(layout.shape)))
    part = None if denominator is None else denominator / (schedule.microbatches * shard_count)

    def head(head_params, y, labels):
        """One microbatch's loss to minimize and its metrics (the MoE layers' terms come
        through their statistics' weights instead), on the last stage."""
        targets, weights, later, packing = labels
        with in_stage():
            model = model_of({**outer, **head_params})
            loss, metrics = objective(model.logits(y), targets, {}, AuxLosses(), weights, part)
            mb_columns = Columns(None, targets, columns.positions, packing, weights, later)
            return predicted_further(model, y, mb_columns, aux, loss, metrics, part)

    x, embed_vjp = jax.vjp(lambda t: to_microbatches(parts._replace(outer={**outer, **t}).embedded(), shards, schedule),
                           trained)
    run = zb_v if schedule.name in SPLIT_BACKWARD else one_f_one_b
    labels = jax.tree.map(lambda a: to_microbatches(a, shards, schedule),
                          (columns.targets, columns.weights, columns.later, columns.packing))
    head_params = {name: outer[name] for name in head_names}
    head_metrics, d_blocks, d_head, dx, stats = run(
        _pipeline_run(layout, map_specs(layout, parts, head_params)),
        StageProgram(parts.stage, parts.blocks, parts.side(shards, schedule), parts.fixed),
        Head(head, head_params, aux_weights_per_layer(aux, layout.skeleton.model_cfg.moe_layers)), x, labels)
    (grads,) = embed_vjp(dx)
    grads = grads | {name: jax.tree.map(jnp.add, grads[name], d_head[name]) for name in head_names}
    d_blocks = _weights_of(d_blocks, params[family.STACKED])
    metrics = moe_metrics(_of_layers(stats, layout.skeleton.model_cfg), aux.balance) | _stacked_loads(stats) if stats else {}
    return head_metrics | metrics, grads | {family.STACKED: d_blocks}


def _stacked_loads(stats: dict) -> dict:
    """The experts' loads of every stacked layer, the empty ones' zeros, laid out over pp as
    the stages are (spmd.parallel.step reads them so): cut to the MoE layers, XLA moved
    them over pp to put the empty ones back (an all-to-all)."""
    return {name: stats[name] for name in ("expert_load", "slot_load") if name in stats}


def _of_layers(stats: dict, model_cfg) -> dict:
    """The stages' statistics (stacked layers', in stored order) less those of the empty
    layers, which are stored last: what the model's `forward` returns."""
    return jax.tree.map(lambda s: s[:model_cfg.layer_steps], stats) if model_cfg.empty_layers else stats
