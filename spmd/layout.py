"""One run's layout: mesh, rules and the model's shapes -> every sharding, checked up front.

Everything is derived from the abstract model (no arrays are created), so a layout that
does not fit fails here with one clear line, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx, traverse_util

from models import FAMILIES, PRESETS, LlamaConfig, Routing, model_class
from spmd.config import model_config
from spmd.errors import UserError
from spmd.mesh import BATCH_AXES, build_mesh, emulated_device_count, format_mesh, parse_mesh, resolve_mesh
from spmd.pipeline import Schedule
from spmd.rules import Rules, axes_of, make_rules, spec_for, without_axes

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def is_names(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) or n is None for n in x)


@dataclasses.dataclass(frozen=True)
class ModelSkeleton:
    """The model without arrays: its graph, parameter shapes and logical names."""

    model_cfg: LlamaConfig
    graphdef: nnx.GraphDef
    shapes: dict  # pure dict of jax.ShapeDtypeStruct
    names: dict  # pure dict of logical-name tuples, one per dimension

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))


def routing(cfg) -> Routing:
    return Routing(cfg.moe_dispatch, cfg.capacity_factor)


def skeleton_for(cfg) -> ModelSkeleton:
    return model_skeleton(model_config(cfg), cfg.dtype, cfg.remat, routing(cfg))


@functools.lru_cache(maxsize=32)  # read-only; spmd.plan --auto builds many layouts of one model
def model_skeleton(model: str | LlamaConfig, dtype: str = "float32", remat: str = "none",
                   routing: Routing = Routing()) -> ModelSkeleton:
    """`model`: a preset's name or a model config. The graph holds dtype, remat and routing."""
    model_cfg = PRESETS[model] if isinstance(model, str) else model
    abstract = nnx.eval_shape(lambda: model_class(model_cfg)(model_cfg, dtype=DTYPES[dtype], remat=remat, routing=routing,
                                            rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes, names = {}, {}
    for path, var in nnx.to_flat_state(state):
        shapes[path] = jax.ShapeDtypeStruct(var.shape, var.dtype)
        names[path] = tuple(var.get_metadata()["out_sharding"])
    return ModelSkeleton(model_cfg, graphdef, traverse_util.unflatten_dict(shapes), traverse_util.unflatten_dict(names))


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: jax.sharding.Mesh
    shape: Mapping[str, int]  # all six axes, in mesh order
    rules: Rules
    skeleton: ModelSkeleton
    schedule: Schedule | None = None  # pipeline stages (pp > 1)

    def shardings(self, table: Mapping) -> dict:
        """NamedSharding per parameter, under one rules table (params, grads or opt_state)."""
        return jax.tree.map(lambda n: self.named(spec_for(n, table)), self.skeleton.names, is_leaf=is_names)

    def named(self, spec: jax.sharding.PartitionSpec) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        return self.named(jax.P())

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes that split a step's rows: the batch axes, and pp (outside the pipeline)."""
        return BATCH_AXES + (("pp",) if self.schedule else ())

    @property
    def batch_sharding(self) -> jax.sharding.NamedSharding:
        return self.named(jax.P(self.data_axes, None))

    @property
    def batch_shards(self) -> int:
        return math.prod(self.shape[a] for a in BATCH_AXES)

    @property
    def kv_copies(self) -> int:
        """Copies of each key/value head computed with (models.annotate.copies): tp / kv_heads
        where tp splits the query heads more finely than the kv heads (rules.SHARED_KV_HEADS)."""
        tp, kv = self.shape["tp"], self.skeleton.model_cfg.kv_heads
        return 1 if kv % tp == 0 else tp // kv

    @property
    def accumulation_axes(self) -> tuple[str, ...]:
        """The batch axes whose gradient reduction gradient accumulation defers to once
        per step (spmd.step): all of them, but ep where experts are split over it, since
        tokens must travel to their experts' devices in every microbatch."""
        split_experts = self.skeleton.model_cfg.moe is not None and self.shape["ep"] > 1
        return tuple(a for a in BATCH_AXES if not (split_experts and a == "ep"))

    def per_shard_specs(self, axes: tuple[str, ...]) -> dict:
        """Specs of gradients kept per shard of `axes`: a leading axis split over them,
        the rest as stored."""
        def spec(names):
            return jax.P(axes, *without_axes(spec_for(names, self.rules.grads), axes))
        return jax.tree.map(spec, self.skeleton.names, is_leaf=is_names)

    def opt_state_shardings(self, tx: optax.GradientTransformation, abstract_opt_state) -> object:
        return optax.tree_map_params(
            tx, lambda _, s: s, abstract_opt_state, self.shardings(self.rules.opt_state),
            transform_non_params=lambda _: self.replicated,
        )

    @property
    def repeats(self) -> int:
        """Chunks of layers per pipeline stage: the circular schedule stores the stacked
        layers as (repeats, layers / repeats)."""
        return self.schedule.repeats if self.schedule else 1

    def stored(self, tree):
        """A model's params (or optimizer state) as this layout stores them."""
        return restack(tree, self.repeats) if self.repeats > 1 else tree

    def describe(self) -> str:
        return format_mesh(self.shape)


def make_layout(cfg, devices=None, for_training: bool = True) -> Layout:
    """Resolve the mesh for `devices` (default: all) and check every divisibility
    (of the batch and sequence too, unless the layout is only for holding parameters)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh(parse_mesh(cfg.mesh), len(devices))
    rules, skeleton, schedule = check_layout(cfg, shape, for_training)
    dcn = parse_mesh(getattr(cfg, "dcn", None))
    return Layout(build_mesh(shape, devices, dcn), shape, rules, skeleton, schedule)


def check_layout(cfg, shape: Mapping[str, int], for_training: bool = True):
    """Every check of a mesh shape against the run, without devices. -> (rules, skeleton, schedule)"""
    skeleton = skeleton_for(cfg)
    rules = make_rules(cfg.zero, cfg.megatron_sp, shared_kv_heads(cfg, shape, skeleton.model_cfg))
    schedule = check_pipeline(cfg, shape, skeleton.model_cfg, for_training)
    if schedule and schedule.repeats > 1:
        skeleton = restacked(skeleton, schedule.repeats)
    check_divisible(cfg, shape, rules, skeleton, for_training)
    return rules, skeleton, schedule


def shared_kv_heads(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig) -> bool:
    """Whether tp splits the query heads more finely than the key/value heads (tp a
    multiple of them), so that devices share a kv head (rules.SHARED_KV_HEADS)."""
    tp, kv = shape["tp"], model_cfg.kv_heads
    if kv % tp == 0:
        return False
    if tp % kv or model_cfg.heads % tp:
        raise UserError(f"model {cfg.model_name}: tp={tp} must divide heads={model_cfg.heads} and either divide "
                        f"kv_heads={kv} or be a multiple of it")
    return True


def check_before_devices(cfg, processes: int = 1, for_training: bool = True) -> None:
    """With emulated CPU devices, the layout's checks before the devices are made: a
    mesh that cannot hold the run (dp=1000000) is refused, not built."""
    sizes = parse_mesh(cfg.mesh)
    count = emulated_device_count(sizes, cfg.cpu_devices, processes)
    if count is not None and processes >= 1:
        check_layout(cfg, resolve_mesh(sizes, count * processes), for_training)


def restacked(skeleton: ModelSkeleton, repeats: int) -> ModelSkeleton:
    """The skeleton with its stacked layers stored as (repeats, layers / repeats): the
    circular schedule's layout (spmd.pipeline)."""
    def names(n):
        return (None, *n) if n and n[0] == "layers" else n

    return dataclasses.replace(skeleton, shapes=restack(skeleton.shapes, repeats),
                               names=jax.tree.map(names, skeleton.names, is_leaf=is_names))


STACKED_KEYS = frozenset(family.STACKED for family in FAMILIES.values())


def is_stacked(path) -> bool:
    """Whether a leaf of params (or optimizer state, which mirrors them) is a stacked layer's."""
    return any(getattr(k, "key", None) in STACKED_KEYS for k in path)


def restack(tree, repeats: int):
    """Stacked-layer leaves (in params or optimizer state) of a model's (layers, ...)
    layout -> (repeats, layers / repeats, ...); repeats < 0 undoes it."""
    def leaf(path, x):
        if not is_stacked(path):
            return x
        shape = (repeats, x.shape[0] // repeats, *x.shape[1:]) if repeats > 0 else (-1, *x.shape[2:])
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(shape, x.dtype)
        return x.reshape(shape)
    return jax.tree_util.tree_map_with_path(leaf, tree)


def check_pipeline(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig, for_training: bool) -> Schedule | None:
    """The pipeline schedule of a layout with pp > 1, its divisibility checked."""
    p = shape["pp"]
    if p == 1:
        if cfg.pp_schedule != "gpipe" or cfg.microbatches is not None:
            raise UserError("--pp-schedule, --pp-repeats and --microbatches need a pp axis (e.g. --mesh pp=2,dp=4)")
        return None
    schedule = Schedule.of(cfg, p)
    if model_cfg.layers % (p * schedule.repeats):
        raise UserError(f"model {cfg.model_name}: {model_cfg.layers} layers do not divide into pp x repeats = "
                        f"{p} x {schedule.repeats} pipeline chunks")
    m = schedule.microbatches
    if m % p:
        raise UserError(f"--microbatches {m} must be a multiple of pp={p} "
                        "(the head and loss split the microbatches over the stages)")
    if model_cfg.moe and shape["sp"] > 1 and shape["ep"] > 1 and cfg.moe_dispatch == "capacity":
        # XLA's partitioner aborts on ranking the choices along a sequence split over sp
        # inside the stages' map with experts over ep ("Check failed: partition_group_list
        # ... spmd_partitioner_util.cc:497", XLA:CPU, jax 0.10.2); dropless needs no ranking.
        raise UserError("pipeline stages with sp and ep need --moe-dispatch dropless (capacity mode's ranking of "
                        "the choices along a sequence split over sp makes XLA abort here)")
    if for_training:
        shards = math.prod(shape[a] for a in BATCH_AXES)
        if cfg.microbatch % (m * shards):
            raise UserError(f"--batch {cfg.microbatch} does not divide into {m} microbatches x "
                            f"{shards} batch shards" + (" per --grad-accum step" if cfg.grad_accum > 1 else ""))
    return schedule


def check_divisible(cfg, shape: Mapping[str, int], rules: Rules, skeleton: ModelSkeleton,
                    for_training: bool = True) -> None:
    if for_training:
        check_batch(cfg, shape)
    flat_shapes = traverse_util.flatten_dict(skeleton.shapes)
    flat_names = traverse_util.flatten_dict(skeleton.names, is_leaf=lambda _, v: is_names(v))
    for table in (rules.params, rules.grads, rules.opt_state):
        for path, names in flat_names.items():
            for size, name in zip(flat_shapes[path].shape, names):
                axes = axes_of(table.get(name))
                ways = math.prod(shape[a] for a in axes)
                if size % ways:
                    split = "x".join(f"{a}={shape[a]}" for a in axes)
                    raise UserError(
                        f"model {cfg.model_name}: {name}={size} does not divide by {split} "
                        f"(parameter {'.'.join(map(str, path))}, --zero {cfg.zero})"
                    )


def check_batch(cfg, shape: Mapping[str, int]) -> None:
    shards = math.prod(shape[a] for a in BATCH_AXES)
    batch_axes = "x".join(f"{a}={shape[a]}" for a in BATCH_AXES if shape[a] > 1) or "1"
    if cfg.microbatch % shards:
        what = f"--batch {cfg.batch}" + (f" / --grad-accum {cfg.grad_accum} = {cfg.microbatch}" if cfg.grad_accum > 1 else "")
        raise UserError(f"{what} does not divide by the batch axes ({batch_axes} = {shards} shards)")
    sp = shape["sp"]
    if sp > 1 and cfg.seq % (2 * sp):
        raise UserError(f"--seq {cfg.seq} does not divide into 2 x sp = {2 * sp} chunks "
                        "(sequence parallelism gives each sp rank two chunks, one early and one late)")
    if cfg.megatron_sp and cfg.seq % (sp * shape["tp"]):
        raise UserError(f"--megatron-sp: --seq {cfg.seq} does not divide by sp x tp = {sp * shape['tp']}")


def bytes_per_device(tree) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs carrying their shardings)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))
