"""One run's layout: mesh, rules and the model's shapes -> every sharding.

Everything is derived from the abstract model (no arrays are created) and checked first
(spmd.parallel.checks), so a layout that does not fit fails with one clear line, before anything
is compiled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax

from spmd.parallel.checks import check_layout, fewest_empty_layers, kv_copies
from spmd.parallel.defaults import default_layout
from spmd.parallel.mesh import BATCH_AXES, build_mesh, format_mesh
from spmd.parallel.pipeline import Schedule
from spmd.parallel.rules import Rules, spec_for, without_axes
from spmd.parallel.options import StepOptions, step_options
from spmd.parallel.skeleton import ModelSkeleton, is_names, restack


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh: jax.sharding.Mesh
    shape: Mapping[str, int]  # all six axes, in mesh order
    rules: Rules
    skeleton: ModelSkeleton
    schedule: Schedule | None = None  # pipeline stages (pp > 1)

    def shardings(self, table: Mapping, trained: bool = False) -> dict:
        """NamedSharding per parameter, under one rules table (params, grads or opt_state);
        `trained`: of the parameters that train only (the adapters, with LoRA)."""
        names = self.skeleton.trained(self.skeleton.names) if trained else self.skeleton.names
        return jax.tree.map(lambda n: self.named(spec_for(n, table)), names, is_leaf=is_names)

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
        """Copies of each key/value head computed with (spmd.parallel.checks.kv_copies)."""
        return kv_copies(self.shape, self.skeleton.model_cfg)

    @property
    def accumulation_axes(self) -> tuple[str, ...]:
        """The batch axes whose gradient reduction gradient accumulation defers to once
        per step (spmd.parallel.step): all of them, but ep where experts are split over it, since
        tokens must travel to their experts' devices in every microbatch."""
        split_experts = self.skeleton.model_cfg.moe is not None and self.shape["ep"] > 1
        return tuple(a for a in BATCH_AXES if not (split_experts and a == "ep"))

    def per_shard_specs(self, axes: tuple[str, ...]) -> dict:
        """Specs of gradients (of the parameters that train) kept per shard of `axes`: a
        leading axis split over them, the rest as stored."""
        def spec(names):
            return jax.P(axes, *without_axes(spec_for(names, self.rules.grads), axes))
        return jax.tree.map(spec, self.skeleton.trained(self.skeleton.names), is_leaf=is_names)

    def opt_state_shardings(self, tx: optax.GradientTransformation, abstract_opt_state) -> object:
        return optax.tree_map_params(
            tx, lambda _, s: s, abstract_opt_state, self.shardings(self.rules.opt_state, trained=True),
            transform_non_params=lambda _: self.replicated,
        )

    @property
    def repeats(self) -> int:
        """Chunks of layers per pipeline stage: the circular schedule stores the stacked
        layers as (repeats, layers / repeats)."""
        return self.schedule.repeats if self.schedule else 1

    @property
    def empty_layers_needed(self) -> int:
        """The fewest empty layers that even out this layout's pipeline chunks (0 without stages)."""
        return fewest_empty_layers(self.skeleton.model_cfg, self.shape["pp"] * self.repeats) if self.schedule else 0

    def stored(self, tree):
        """A model's params (or optimizer state) as this layout stores them."""
        return restack(tree, self.repeats) if self.repeats > 1 else tree

    def describe(self) -> str:
        return format_mesh(self.shape)


def make_layout(cfg: StepOptions, devices=None, for_training: bool = True) -> Layout:
    """Resolve the mesh for `devices` (default: all; no mesh given: their default layout,
    spmd.parallel.defaults) and check every divisibility (of the batch and sequence too,
    unless the layout is only for holding parameters)."""
    cfg, devices = step_options(cfg), list(jax.devices() if devices is None else devices)
    if cfg.parallelism.mesh is None:
        shape, _ = default_layout(cfg, len(devices), serving=not for_training, for_training=for_training)
    else:
        shape = cfg.parallelism.mesh_spec.resolve(len(devices))
    rules, skeleton, schedule = check_layout(cfg, shape, for_training)
    return Layout(build_mesh(shape, devices, cfg.parallelism.mesh_spec.dcn), shape, rules, skeleton, schedule)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs carrying their shardings)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))
