"""The rules table: logical axis names -> mesh axes. Parallelism as data, in one place.

Each logical name has two entries, following Levanter's split between where a parameter
*lives* and how values are *computed*:

- `at_rest`: how a parameter dimension is stored. `embed` is split over `fsdp` and `sp`
  (ZeRO-3 over those axes: sp's devices hold different tokens, so they can hold different
  shards of the weights too); heads, MLP width and vocab over `tp` (Megatron column/row).
- `compute`: how an activation dimension is laid out. The batch goes over the batch axes,
  the sequence over `sp`, heads / MLP / vocab over `tp`.

`--zero` picks which state the `dp` axis also splits (on the `embed` dimension, beside
`fsdp`): 0 nothing (DDP replicas), 1 optimizer state, 2 + gradients, 3 + parameters.
`ep` splits it too, where a weight is replicated over ep (every weight but the experts':
ep splits their batch, as dp does; DeepSpeed's and DeepSeek's ZeRO over every data-parallel
rank); an expert's weight keeps ep on its `experts` dimension.
In one fused step stages 1 and 2 compile alike: the optimizer only reads its own shard
of the reduced gradient, so gradients are reduce-scattered straight to it (ZeRO's
communication volume of reduce-scatter + all-gather), never all-reduced whole.
Pipeline stages (`pp` on `layers`) and experts (`ep` on `experts`) have their entries here
too, so those features plug in without touching models. Megatron sequence parallelism
(`--megatron-sp`) is a variant of the table: outside attention and the MLP, the residual
stream's sequence (`residual_seq`) is split over tp as well, so XLA turns each tensor-
parallel all-reduce into a reduce-scatter into that layout and an all-gather out of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax

from models.annotate import PREFIX_LAYERS, Storage, axes_of, spec_of
from spmd.parallel.mesh import BATCH_AXES

Axes = str | tuple[str, ...] | None

#            logical name: (at_rest,  compute)
TABLE: dict[str, tuple[Axes, Axes]] = {
    "batch": (None, BATCH_AXES),
    "seq": (None, "sp"),
    "residual_seq": (None, "sp"),  # the residual stream's sequence; Megatron-SP adds tp
    # FSDP over the context axis too (as MaxText: sp splits no weight else); fsdp major, in
    # the mesh's order, which XLA:GPU reduce-scatters the gradient in (sp major: it
    # all-reduced 20 GiB a step of llama3-8b-32k-8xh100's 14 GiB reduce-scatter). Under
    # accumulation, ACCUMULATED_EMBED.
    "embed": (("fsdp", "sp"), None),
    "heads": ("tp", "tp"),
    "kv_heads": ("tp", "tp"),
    "head_dim": (None, None),
    "mlp": ("tp", "tp"),
    "vocab": ("tp", "tp"),
    "experts": ("ep", "ep"),
    "layers": ("pp", None),  # pipeline stages own contiguous layers (spmd.parallel.pipeline)
    PREFIX_LAYERS: (None, None),  # a dense prefix runs with the embedding, outside the stages (models.deepseek3)
}

# The axes the hand-written maps are manual over, as the table places them: pipeline stages
# own layers (spmd.parallel.pipeline), ring attention passes the sequence's chunks (spmd.parallel.context),
# experts' tokens travel to where the experts live (spmd.parallel.experts).
STAGE_AXIS = TABLE["layers"][0]
SEQUENCE_AXIS = TABLE["seq"][1]
EXPERT_AXIS = TABLE["experts"][0]

ZERO_STAGES = (0, 1, 2, 3)
ZERO_SHARDED_DIM = "embed"  # the dimension that ZeRO splits over dp, beside fsdp
# What ZeRO adds to it, each only where the array does not name it already: dp, and ep,
# which replicates every weight but the experts'. (Not pp, which replicates the weights
# outside the stages: an embed dimension seldom divides by dp x ep x pp; DeepSeek-V3's
# 7168 by 2 x 64 x 16 does not.)
ZERO_AXES = ("dp", "ep")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Resolved tables for one ZeRO stage: logical name -> mesh axes, per kind of state."""

    params: Mapping[str, Axes]
    grads: Mapping[str, Axes]
    opt_state: Mapping[str, Axes]
    activations: Mapping[str, Axes]

    def storage(self, local_axes: tuple[str, ...] = (), moves_rows: bool = True) -> Storage:
        """Where parameters and gradients live, for `models.annotate.weight`; `moves_rows`:
        whether lookups move their rows to where the table is (`models.lookup.looked_up`).

        `local_axes`: axes that may not be named where the weights are used: inside a vmap
        over batch shards (gradients per shard, not reduced), or inside a map that is
        manual over them. Dimensions stored split over them are left to XLA (unconstrained)."""
        def local(table):
            return {name: jax.P.UNCONSTRAINED if set(axes_of(axes)) & set(local_axes) else axes
                    for name, axes in table.items()}
        return Storage(params=local(self.params), grads=local(self.grads), moves_rows=moves_rows)

    def activation_rules(self, local_axes: tuple[str, ...] = (), data_axes: tuple[str, ...] = BATCH_AXES,
                         ) -> tuple[tuple[str, Axes], ...]:
        """Flax-style rules for `models.annotate.constrain`.

        `local_axes`: the values live inside one shard along these axes (a vmap over batch
        shards whose mapped axis is already split over them, or a map manual over them),
        so no name maps to them. `data_axes`: what splits `batch` (outside pipeline
        stages, pp as well).
        """
        table = dict(self.activations) | {"batch": data_axes}
        return tuple((name, _without(axes, local_axes)) for name, axes in table.items())


def _without(entry: Axes, drop: tuple[str, ...]) -> Axes:
    if entry is jax.P.UNCONSTRAINED:
        return entry
    kept = tuple(a for a in axes_of(entry) if a not in drop)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


MEGATRON_SP = {"residual_seq": ("sp", "tp")}  # norms and residuals split along the sequence over tp too
# tp beyond the key/value heads (tp a multiple of them): the kv projection is stored whole
# on every tp device, and where used XLA computes on each device only the kv heads its
# query heads read (they follow from the heads' split), as Megatron and vLLM replicate a kv
# head on the devices that share it; its gradient is summed over those devices.
SHARED_KV_HEADS = {"kv_heads": (None, jax.P.UNCONSTRAINED)}


# With gradient accumulation, embed is stored sp major: the order the sums arrive in (sp's
# reduction in each microbatch, fsdp's once), which fsdp major made XLA permute every step,
# a copy of the parameters (XLA:CPU and XLA:GPU alike).
ACCUMULATED_EMBED = ("sp", "fsdp")


def make_rules(zero: int, megatron_sp: bool = False, shared_kv_heads: bool = False,
               accumulating: bool = False) -> Rules:
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero stage must be one of {ZERO_STAGES}")
    table = TABLE | (SHARED_KV_HEADS if shared_kv_heads else {})
    if accumulating:
        table["embed"] = (ACCUMULATED_EMBED, table["embed"][1])
    at_rest = {name: entry[0] for name, entry in table.items()}
    compute = {name: entry[1] for name, entry in table.items()}
    if megatron_sp:
        compute.update(MEGATRON_SP)

    def with_dp(stage: int) -> dict[str, Axes]:
        table = dict(at_rest)
        if zero >= stage:
            # fsdp major, dp minor: each fsdp shard splits further over dp, so the
            # optimizer's shard lies inside the parameter's (no resharding between them).
            table[ZERO_SHARDED_DIM] = (*axes_of(table[ZERO_SHARDED_DIM]), *ZERO_AXES)
        return table

    return Rules(params=with_dp(3), grads=with_dp(1), opt_state=with_dp(1), activations=compute)


def placed(table: Mapping[str, Axes]) -> dict[str, Axes]:
    """A compute table for arrays placed between programs (a sharding must be decided):
    dimensions left to XLA are replicated."""
    return {name: None if axes is jax.P.UNCONSTRAINED else axes for name, axes in table.items()}


def spec_for(names: tuple[str | None, ...], table: Mapping[str, Axes]) -> jax.sharding.PartitionSpec:
    """PartitionSpec of one array from the logical names of its dimensions (an axis named by
    two of them stays with the one naming it earliest: models.annotate.spec_of)."""
    return spec_of(names, table)


def without_axes(spec: jax.sharding.PartitionSpec, drop: tuple[str, ...]) -> jax.sharding.PartitionSpec:
    """The same spec with some mesh axes removed (e.g. the batch axes, to replicate over them)."""
    return jax.P(*(_without(entry, drop) for entry in spec))
