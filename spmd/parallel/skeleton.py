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


def model_config(cfg):
    """The model: --init-from's, or the preset with the run's overrides (depth, number of
    experts, top-k)."""
    empty = {"empty_layers": cfg.empty_layers} if cfg.empty_layers else {}
    base = cfg.architecture or PRESETS[cfg.model or "tiny"]
    if cfg.remat not in model_class(base).REMAT:
        raise UserError(f"--remat {cfg.remat} is not one of {cfg.model_name}'s: {', '.join(model_class(base).REMAT)}")
    if cfg.mtp_depth:
        if not hasattr(base, "mtp_depth"):
            raise UserError(f"--mtp-depth: multi-token prediction is DeepSeek-V3's; {cfg.model_name} has none")
        empty["mtp_depth"] = cfg.mtp_depth
    if cfg.architecture is not None:
        return dataclasses.replace(cfg.architecture, **empty)
    model_cfg = dataclasses.replace(PRESETS[cfg.model or "tiny"], **empty)
    try:  # a family's config refuses shapes it cannot build (models.deepseek3: a depth within its dense prefix)
        if cfg.layers is not None:
            model_cfg = dataclasses.replace(model_cfg, layers=cfg.layers)
        if model_cfg.moe is None:
            return model_cfg
        moe = dataclasses.replace(model_cfg.moe, **{k: v for k, v in (("experts", cfg.experts), ("top_k", cfg.top_k))
                                                      if v is not None})
        return dataclasses.replace(model_cfg, moe=moe)
    except ValueError as exc:
        raise UserError(f"model {cfg.model}: {exc}") from None


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

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))

    def trained(self, tree: dict) -> dict:
        """The part of a tree shaped like the parameters that trains: the adapters with LoRA."""
        return lora_split(tree)[0] if self.lora else tree

    def frozen(self, tree: dict) -> dict | None:
        """The part that does not train (the base weights with LoRA), or None."""
        return lora_split(tree)[1] if self.lora else None


def routing(cfg) -> Routing:
    """How the run routes tokens: dispatch, and the balancing state it keeps (spmd.parallel.balance)."""
    moe = cfg.model_cfg.moe
    balanced = moe is not None and (cfg.router_bias_rate > 0 or cfg.redundant_experts > 0)
    slots = moe.experts + cfg.redundant_experts if balanced and cfg.redundant_experts else None
    return Routing(cfg.moe_dispatch, cfg.capacity_factor, balanced, slots, cfg.router_bias_weight and not balanced)


def lora(cfg) -> LoRA | None:
    """The run's adapters (--lora-rank, models.lora), or None: a full fine-tune."""
    if not cfg.lora_rank:
        return None
    return LoRA(cfg.lora_rank, cfg.lora_alpha, tuple(t.strip() for t in cfg.lora_targets.split(",")))


def skeleton_for(cfg) -> ModelSkeleton:
    return model_skeleton(cfg.model_cfg, cfg.dtype, cfg.remat, routing(cfg), lora(cfg))


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
    return ModelSkeleton(model_cfg, graphdef, tree(shapes), tree(names), tree(router_shapes), tree(router_names), lora)


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
