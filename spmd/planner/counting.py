"""What the planner's theory counts with: the parameters as it sees them (their bytes, how
each is used and whether it trains), the ways an axis set splits, the tokens a device
computes on, the pipeline's overheads, and the `Expected` collectives it reports
(spmd.planner.theory for the parameters' traffic, spmd.planner.activations for the
activations', spmd.planner.footprint for memory)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax.numpy as jnp
from flax import traverse_util

from models import model_class
from models.annotate import LAYERS, PREDICTIONS, PREFIX_LAYERS
from models.lookup import rows_route
from models.lora import is_adapter
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import AXES, BATCH_AXES
from spmd.parallel.objective import prediction_depth
from spmd.parallel.rules import axes_of, spec_for
from spmd.parallel.skeleton import DTYPES, is_names


SMALL_BYTES = 1024  # collectives moving less each time are scalars (loss, norms, MoE statistics): listed, not flagged


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
    stacked: bool  # one slice per layer, used inside the layer scan (split into pipeline stages)
    trained: bool = True  # False: a LoRA run's frozen base (no gradient, no optimizer state)
    adapter: bool = False  # a LoRA adapter's matrix (models.lora)
    prefix: int = 0  # one slice per layer of a prefix run by a scan of its own before the stacked layers: how many
    predicts: bool = False  # of a multi-token prediction module (models.deepseek3's `mtp`)


def uses(p: Param, model_cfg, compute_bytes: int) -> tuple[int, ...]:
    """Bytes per element of each use of a parameter, as models.llama computes with it:
    vectors (norm scales), what is added per element without multiplying the residual
    stream (biases, which have no embed dimension) and the lookup table in float32,
    matrices (adapters' too) in the compute dtype, and a tied embedding also as the output
    head. Multi-token prediction (models.deepseek3) looks the table up and runs the head
    (models.llama's `head`) once more per depth."""
    again = 1 + prediction_depth(model_cfg)
    if p.path == model_class(model_cfg).LOOKUP_TABLE:  # its rows are read in float32
        return (4,) * again + ((compute_bytes,) * again if model_cfg.tie_embeddings else ())
    if p.path == "head":
        return (compute_bytes,) * again
    return (4,) if not p.adapter and (is_vector(p) or "embed" not in p.names) else (compute_bytes,)


def is_vector(p: Param) -> bool:
    """One dimension besides the stack's: the layers' (and, stored as circular's and zb-v's
    (repeats, layers / repeats) stack, spmd.parallel.skeleton.restacked, the repeats' unnamed
    one before them) or a prefix's."""
    names = p.names[1:] if p.names[:2] == (None, LAYERS) else p.names
    return len([n for n in names if n not in (LAYERS, PREFIX_LAYERS)]) == 1


def params(layout: Layout, cfg=None) -> list[Param]:
    """The model's parameters; of a LoRA run (`cfg`), the frozen ones stored in --base-dtype."""
    shapes = traverse_util.flatten_dict(layout.skeleton.shapes)
    names = traverse_util.flatten_dict(layout.skeleton.names, is_leaf=lambda _, v: is_names(v))
    lora = layout.skeleton.lora is not None
    base_bytes = jnp.dtype(DTYPES[cfg.lora.base_dtype]).itemsize if lora and cfg is not None else 4
    found = []
    for path in shapes:
        trained = not lora or is_adapter(path)
        prefix = shapes[path].shape[0] if names[path][:1] == (PREFIX_LAYERS,) else 0
        found.append(Param(".".join(map(str, path)), math.prod(shapes[path].shape),
                           jnp.dtype(shapes[path].dtype).itemsize if trained else base_bytes, names[path],
                           LAYERS in names[path], trained, lora and trained, prefix, path[0] == PREDICTIONS))
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
    rows = cfg.training.microbatch if microbatch else cfg.training.batch
    return rows * cfg.training.seq // (ways(BATCH_AXES, shape) * shape["sp"] * shape["pp"])


def stage_overhead(layout: Layout) -> float:
    """Executed over useful work of the stacked layers: every stage runs every tick of
    its schedule, (v*m + p - 1)/(v*m) of the useful ones (1f1b: GPipe's, v = 1;
    interleaved-1f1b: circular's); 1
    without a pipeline. Each device runs 1/p of the layers on p times `tokens_per_device`."""
    return 1 / (1 - layout.schedule.bubble) if layout.schedule else 1.0


def head_in_stages(layout: Layout) -> bool:
    return layout.schedule is not None and layout.schedule.writes_backward


def head_runs(layout: Layout) -> float:
    """How often the compiled step runs the output head on `tokens_per_device` rows: once
    outside pipeline stages; in them (1f1b, zb-v, DualPipe) in a branch that every device's
    program holds in each of its v*m + p - 1 forward ticks (taken on the last stage only),
    on a microbatch of its pp group's rows: once per tick, as the compiled step counts it."""
    if not head_in_stages(layout):
        return 1.0
    return layout.shape["pp"] * layout.schedule.repeats * stage_overhead(layout)


def prediction_layers(layout: Layout) -> float:
    """Multi-token prediction's blocks (models.deepseek3), in runs of one layer on
    `tokens_per_device` rows: one per depth, where the head runs (`head_runs`)."""
    return prediction_depth(layout.skeleton.model_cfg) * head_runs(layout)


def in_head(layout: Layout, p: Param) -> bool:
    """Whether `p` is read only by the output head (not a tied table, which the lookup reads too)."""
    model_cfg = layout.skeleton.model_cfg
    family = model_class(model_cfg)
    top = p.path.split(".")[0]
    return top in family.head_params(model_cfg) and top != family.LOOKUP_TABLE


def picks_again(layout: Layout) -> bool:
    """Whether autodiff's backward pass picks each tick's chunk again under the model's
    remat policy (circular: spmd.parallel.pipeline.kit.run_chunk); the written-out backward of
    interleaved-1f1b runs each chunk's backward once."""
    return layout.schedule is not None and layout.schedule.repeats > 1 and not layout.schedule.writes_backward


def compute_table(layout: Layout) -> Mapping:
    """How parameters are laid out where used: the activations' rules, and under pipeline
    stages the stacked layers split over pp (each stage runs its own)."""
    table = layout.rules.activations
    return {**table, "layers": "pp"} if layout.schedule else table


def table_scatter_axes(cfg, layout: Layout) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Under Megatron-SP with the vocabulary split over tp, how XLA reduces the lookup
    table's gradient: (the axes of one reduce-scatter, those its shard is summed over
    after). Without axes that replicate the table, it reduce-scatters over tp and the
    token axes the table is stored split over (fsdp, sp) in one collective: (those axes,
    ()), tp implied (so too where ZeRO-2 stores the gradient over dp). With dp or ep
    (which splits only the experts) replicating it as well, it reduce-scatters over the
    outer of them and the stored axes, and sums the shard over the other and tp after
    (measured on dp=2,sp=2,tp=2, ep=2,tp=2, dp=2,ep=2,tp=2 and, with ZeRO-2, dp=2,tp=2,
    ep=2,tp=2 and dp=2,ep=2,tp=2)."""
    shape, rules = layout.shape, layout.rules
    if not (cfg.parallelism.megatron_sp and shape["tp"] > 1 and "tp" in axes_of(rules.activations["vocab"])):
        return (), ()
    table = next(p for p in params(layout) if p.path == model_class(layout.skeleton.model_cfg).LOOKUP_TABLE)
    stored = spec_axes(table.names, rules.grads)
    fused = [a for a in stored if a != "tp" and a in (*layout.data_axes, "sp")]
    replicas = live([a for a in ("dp", "ep") if a not in fused], shape)
    if not replicas:
        return live(fused, shape), ()
    return (live([a for a in AXES if a == replicas[0] or a in fused], shape),
            live([a for a in AXES if a in replicas[1:] or a == "tp"], shape))


def rows_moved(cfg, layout: Layout) -> tuple[str, ...]:
    """The axes the lookups move their rows along to the table (models.lookup.looked_up),
    as spmd.parallel.step sets them up; () where they gather the table (pipelines, and
    inside accumulation's per-shard map, where the table's axes are the map's)."""
    if cfg.training.grad_accum > 1 and not layout.schedule:
        return ()
    storage = layout.rules.storage(moves_rows=layout.schedule is None)
    route = rows_route(storage, dict(layout.rules.activation_rules((), layout.data_axes)), layout.shape)
    return route[1] if route else ()


def expert_rows(cfg, layout: Layout, copies: bool = True) -> int:
    """Rows of tokens each device runs through its experts per MoE layer (spmd.parallel.experts):
    capacity mode's buffers, or the dropless choices (padded per destination over ep).
    `copies`: in a layer with the run's expert copies (the prediction modules' have none)."""
    moe, ep, sp = layout.skeleton.model_cfg.moe, layout.shape["ep"], layout.shape["sp"]
    tokens = tokens_per_device(cfg, layout.shape)
    capacity = layout.skeleton.routing.capacity(cfg.training.seq, moe)
    # with copies (spmd.parallel.balance), each slot is an expert here
    slots = (layout.skeleton.routing.slots if copies else None) or moe.experts
    if capacity is not None:  # per sequence; a device's chunk of c tokens fills at most c slots
        chunk = cfg.training.seq // sp
        return tokens // chunk * slots * min(capacity, chunk)
    return tokens * ep * min(moe.top_k, slots // ep)


def split_norms(layout: Layout) -> list[tuple[str, ...]]:
    """Per norm of a block (the config's `block_norms`) that normalizes over elements split
    across devices where used, the mesh axes its mean of squares is summed over: a norm
    over a whole projection (OLMo 2's q/k norms, laid out as the heads) under a split of the
    heads. Norms over the residual stream or within a head read elements one device holds.
    A key norm's heads are split as the query heads are where tp goes beyond the kv heads
    (each device computes the copies of the one it shares: models.llama's `_project`)."""
    model_cfg, table = layout.skeleton.model_cfg, layout.rules.activations
    found = []
    for shape, names in model_cfg.block_norms().values():
        names = tuple("heads" if n == "kv_heads" and layout.kv_copies > 1 else n for n in names)
        axes = live(spec_axes(names, table), layout.shape)
        if axes:
            found.append(axes)
    return found


def by_op_and_axes(expected: list[Expected]) -> dict[tuple[str, str], float]:
    totals: dict[tuple[str, str], float] = {}
    for e in expected:
        totals[(e.op, e.axes)] = totals.get((e.op, e.axes), 0.0) + e.bytes_per_device
    return totals
