"""The model without arrays: its graph, parameter shapes and logical names, and the stacked
layers' storage for circular pipelines. Derived with `nnx.eval_shape`: nothing is allocated."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from models import FAMILIES, PRESETS, LlamaConfig, Routing, model_class
from models.lora import LoRA
from models.lora import split as lora_split
from models.moe import RouterState
from spmd.base.errors import UserError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# --remat's choices: none, full, dots, and those of a family's own (DeepSeek-V3's "mla")
REMAT = tuple(dict.fromkeys(policy for family in FAMILIES.values() for policy in family.REMAT))


def model_config(model, moe):
    """The model: --init-from's, or the preset with the run's overrides (depth, number of
    experts, top-k): of the model and moe sections of the run's options (spmd.run.options)."""
    empty = {"empty_layers": model.empty_layers} if model.empty_layers else {}
    base = model.architecture or PRESETS[model.preset or "tiny"]
    if model.remat not in model_class(base).REMAT:
        raise UserError(f"--remat {model.remat} is not one of {model.name}'s: {', '.join(model_class(base).REMAT)}")
    if model.mtp_depth:
        if not hasattr(base, "mtp_depth"):
            raise UserError(f"--mtp-depth: multi-token prediction is DeepSeek-V3's; {model.name} has none")
        empty["mtp_depth"] = model.mtp_depth
    if model.architecture is not None:
        return dataclasses.replace(model.architecture, **empty)
    model_cfg = dataclasses.replace(PRESETS[model.preset or "tiny"], **empty)
    try:  # a family's config refuses shapes it cannot build (models.deepseek3: a depth within its dense prefix)
        if model.layers is not None:
            model_cfg = dataclasses.replace(model_cfg, layers=model.layers)
        if model_cfg.moe is None:
            return model_cfg
        moe = dataclasses.replace(model_cfg.moe, **{k: v for k, v in (("experts", moe.experts), ("top_k", moe.top_k))
                                                      if v is not None})
        return dataclasses.replace(model_cfg, moe=moe)
    except ValueError as exc:
        raise UserError(f"model {model.preset}: {exc}") from None


def is_names(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) or n is None for n in x)


@dataclasses.dataclass(frozen=True)
class ModelSkeleton:
    """The model without arrays: its graph, parameter shapes and logical names."""

    model_cfg: LlamaConfig
    graphdef: nnx.GraphDef
    shapes: dict  # pure dict of jax.ShapeDtypeStruct, of the parameters
    names: dict  # pure dict of logical-name tuples, one per dimension
    # The MoE layers' router state (models.moe.RouterState), when the routing keeps one.
    router_shapes: dict = dataclasses.field(default_factory=dict)
    router_names: dict = dataclasses.field(default_factory=dict)
    lora: LoRA | None = None  # adapters (models.lora): only they train, the rest is frozen
    routing: Routing = Routing()  # how the MoE layers route tokens, and what balancing state they keep

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))

    def trained(self, tree: dict) -> dict:
        """The part of a tree shaped like the parameters that trains: the adapters with LoRA."""
        return lora_split(tree)[0] if self.lora else tree

    def frozen(self, tree: dict) -> dict | None:
        """The part that does not train (the base weights with LoRA), or None."""
        return lora_split(tree)[1] if self.lora else None


def routing(moe, model_cfg) -> Routing:
    """How the run routes tokens (the moe section of its options): dispatch, and the
    balancing state it keeps (spmd.parallel.balance)."""
    balanced = model_cfg.moe is not None and (moe.router_bias_rate > 0 or moe.redundant_experts > 0)
    slots = model_cfg.moe.experts + moe.redundant_experts if balanced and moe.redundant_experts else None
    return Routing(moe.moe_dispatch, moe.capacity_factor, balanced, slots, moe.router_bias_weight and not balanced)


def lora(options) -> LoRA | None:
    """The run's adapters (its lora section: --lora-rank, models.lora), or None: a full fine-tune."""
    if not options.lora_rank:
        return None
    return LoRA(options.lora_rank, options.lora_alpha, tuple(t.strip() for t in options.lora_targets.split(",")))


def skeleton_for(step) -> ModelSkeleton:
    """The model a step builds (spmd.parallel.options.StepOptions)."""
    return model_skeleton(step.model_cfg, step.model.dtype, step.model.remat, routing(step.moe, step.model_cfg),
                          lora(step.lora))


def build_model(model_cfg, dtype: str, remat: str, routing: Routing, lora: LoRA | None, rngs: nnx.Rngs):
    return model_class(model_cfg)(model_cfg, dtype=DTYPES[dtype], remat=remat, routing=routing, lora=lora, rngs=rngs)


@functools.lru_cache(maxsize=32)  # read-only; spmd.plan --auto builds many layouts of one model
def model_skeleton(model: str | LlamaConfig, dtype: str = "float32", remat: str = "none",
                   routing: Routing = Routing(), lora: LoRA | None = None) -> ModelSkeleton:
    """`model`: a preset's name or a model config. The graph holds dtype, remat, routing
    and the adapters."""
    model_cfg = PRESETS[model] if isinstance(model, str) else model
    abstract = nnx.eval_shape(lambda: build_model(model_cfg, dtype, remat, routing, lora, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes, names, router_shapes, router_names = {}, {}, {}, {}
    for path, var in nnx.to_flat_state(state):
        kept_in = (router_shapes, router_names) if isinstance(var, RouterState) else (shapes, names)
        kept_in[0][path] = jax.ShapeDtypeStruct(var.shape, var.dtype)
        kept_in[1][path] = tuple(var.get_metadata()["out_sharding"])
    tree = traverse_util.unflatten_dict
    return ModelSkeleton(model_cfg, graphdef, tree(shapes), tree(names), tree(router_shapes), tree(router_names), lora,
                         routing)


def restacked(skeleton: ModelSkeleton, repeats: int) -> ModelSkeleton:
    """The skeleton with its stacked layers stored as (repeats, layers / repeats): the
    circular schedule's layout (spmd.parallel.pipeline)."""
    def names(n):
        return (None, *n) if n and n[0] == "layers" else n

    return dataclasses.replace(skeleton, shapes=restack(skeleton.shapes, repeats),
                               names=jax.tree.map(names, skeleton.names, is_leaf=is_names),
                               router_shapes=restack(skeleton.router_shapes, repeats),
                               router_names=jax.tree.map(names, skeleton.router_names, is_leaf=is_names))


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
