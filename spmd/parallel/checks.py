"""Every check of a run against its mesh before anything is compiled, and the table of
what combines with what.

`check_layout` is the one entry point (spmd.parallel.layout builds on what it returns); each
refusal is one `UserError` line. `FEATURES` names the parallel axes and the options that
change a step's layout; every combination of them works but those in `REFUSED`, and a
test holds the README's "What combines" section to these two tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from flax import traverse_util

from models import LlamaConfig
from spmd.base.errors import UserError
from spmd.parallel.mesh import AXES, BATCH_AXES, emulated_device_count
from spmd.parallel.pipeline import Schedule
from spmd.parallel.rules import Rules, axes_of, make_rules, spec_for
from spmd.parallel.options import step_options
from spmd.parallel.skeleton import ModelSkeleton, is_names, restacked, skeleton_for

# ------------------------------------------------------------------ what combines

# The parallel axes and the features that change how a step is laid out, each with when a
# run uses it (cfg, mesh shape, model config).
FEATURES: dict[str, Callable] = {
    **{axis: (lambda axis: lambda cfg, shape, model: shape[axis] > 1)(axis) for axis in AXES},
    "MoE": lambda cfg, shape, model: model.moe is not None,
    "capacity": lambda cfg, shape, model: model.moe is not None and cfg.moe.moe_dispatch == "capacity",
    "grad-accum": lambda cfg, shape, model: cfg.training.grad_accum > 1,
    "Megatron-SP": lambda cfg, shape, model: cfg.parallelism.megatron_sp,
    "ZeRO": lambda cfg, shape, model: cfg.parallelism.zero > 0,
    "expert balancing": lambda cfg, shape, model: model.moe is not None and bool(
        cfg.moe.router_bias_rate or cfg.moe.redundant_experts),
    "LoRA": lambda cfg, shape, model: bool(cfg.lora.lora_rank),
}
# Every combination of FEATURES combines, but these (each with why, as the user reads it):
# none today. (Pipeline stages with sp and ep in capacity mode were refused, while XLA ranked the
# choices along the sp-split sequence: its partitioner aborted, "Check failed:
# partition_group_list ... spmd_partitioner_util.cc:497"; spmd.parallel.context ranks them now.)
REFUSED: dict[frozenset, str] = {}


def features(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig) -> frozenset:
    return frozenset(name for name, used in FEATURES.items() if used(cfg, shape, model_cfg))


def check_combination(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig) -> None:
    used = features(cfg, shape, model_cfg)
    for combination, why in REFUSED.items():
        if combination <= used:
            raise UserError(why)


# ------------------------------------------------------------------ the checks

def check_layout(cfg, shape: Mapping[str, int], for_training: bool = True):
    """Every check of a mesh shape against the run, without devices. -> (rules, skeleton, schedule)"""
    skeleton = skeleton_for(cfg)
    check_combination(cfg, shape, skeleton.model_cfg)
    rules = make_rules(cfg.parallelism.zero, cfg.parallelism.megatron_sp,
                       shared_kv_heads(cfg, shape, skeleton.model_cfg), cfg.training.grad_accum > 1)
    check_expert_slots(cfg, shape, skeleton.model_cfg)
    schedule = check_pipeline(cfg, shape, skeleton.model_cfg, for_training)
    if schedule and schedule.repeats > 1:
        skeleton = restacked(skeleton, schedule.repeats)
    check_divisible(cfg, shape, rules, skeleton, for_training)
    return rules, skeleton, schedule


def kv_copies(shape: Mapping[str, int], model_cfg: LlamaConfig) -> int:
    """Copies of each key/value head computed with (models.annotate.copies): tp / kv_heads
    where devices share kv heads (`shared_kv_heads`), else 1."""
    tp, kv = shape["tp"], model_cfg.kv_heads
    return 1 if kv % tp == 0 else tp // kv


def shared_kv_heads(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig) -> bool:
    """Whether devices share a kv head (rules.SHARED_KV_HEADS): tp a multiple of the kv
    heads that divides the query heads; any other tp that does not divide them is refused."""
    tp, kv = shape["tp"], model_cfg.kv_heads
    if kv % tp == 0:
        return False
    if tp % kv or model_cfg.heads % tp:
        raise UserError(f"model {cfg.model.name}: tp={tp} must divide heads={model_cfg.heads} and either divide "
                        f"kv_heads={kv} or be a multiple of it")
    return True


def check_before_devices(cfg, processes: int = 1, for_training: bool = True) -> None:
    """With emulated CPU devices, the layout's checks before the devices are made: a
    mesh that cannot hold the run (dp=1000000) is refused, not built. (Without --mesh the
    layout is chosen among those that pass them, once the devices are there.)"""
    if step_options(cfg).parallelism.mesh is None:
        return
    count = emulated_device_count(cfg.parallelism.mesh_spec.sizes, cfg.parallelism.cpu_devices, processes)
    if count is not None and processes >= 1:
        check_layout(cfg, cfg.parallelism.mesh_spec.resolve(count * processes), for_training)


def check_expert_slots(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig) -> None:
    """Redundant experts are copies spread over the ep devices: they need some, and
    experts + copies must split evenly over them."""
    r, ep = cfg.moe.redundant_experts, shape["ep"]
    if not r or model_cfg.moe is None:
        return
    if ep == 1:
        raise UserError(f"--redundant-experts {r} spreads copies of busy experts over ep devices; the mesh has ep=1 "
                        "(e.g. --mesh ep=4)")
    slots = model_cfg.moe.experts + r
    if slots % ep:
        raise UserError(f"--redundant-experts {r}: {model_cfg.moe.experts} experts + {r} copies = {slots} slots do "
                        f"not split over ep={ep} devices")


def fewest_empty_layers(model_cfg: LlamaConfig, chunks: int) -> int:
    """The fewest empty layers after the real ones that even out `chunks` pipeline chunks
    (an MoE group's layers stay together)."""
    real = model_cfg.stacked_layers - model_cfg.empty_layers
    unit = chunks * model_cfg.layers_per_step
    return -(-real // unit) * unit - real


def check_pipeline(cfg, shape: Mapping[str, int], model_cfg: LlamaConfig, for_training: bool) -> Schedule | None:
    """The pipeline schedule of a layout with pp > 1, its divisibility checked."""
    p = shape["pp"]
    if p == 1:
        if cfg.parallelism.pp_schedule != "gpipe" or cfg.parallelism.microbatches is not None:
            raise UserError("--pp-schedule, --pp-repeats and --microbatches need a pp axis (e.g. --mesh pp=2,dp=4)")
        return None
    schedule = Schedule.of(cfg, p)
    if not model_cfg.dense_prefix_only:
        raise UserError(f"model {cfg.model.name}: pipeline stages take its MoE layers as one stack, after the dense "
                        f"ones, but dense layers {list(model_cfg.dense_positions)} stand between MoE layers; "
                        "lay it out without pp")
    layers = model_cfg.stacked_layers  # what the stages split (a prefix of layers runs before them)
    real = layers - model_cfg.empty_layers
    what = (f"{real} layers" if real == model_cfg.layers else
            f"{real} MoE layers (its {model_cfg.layers - real} dense ones run before the stages)")
    if model_cfg.empty_layers:
        what += f" and {model_cfg.empty_layers} empty ones"
    chunks = p * schedule.repeats  # (zb-v: 2 per stage)
    if schedule.name == "zb-v":
        why = (f"--pp-schedule zb-v: model {cfg.model.name}'s {what} do not divide into 2 x pp = {chunks} chunks "
               "(each stage runs one going down and one coming back)")
    else:
        why = (f"model {cfg.model.name}: {what} do not divide into pp x repeats = {p} x {schedule.repeats} "
               "pipeline chunks")
    if layers % chunks:
        least = fewest_empty_layers(model_cfg, chunks)
        raise UserError(f"{why}: give --empty-layers {least} (identity layers that even out the stages)" if least
                        else f"{why}: the {real} layers divide without --empty-layers; give none")
    if schedule.name == "dualpipe" and p % 2:
        raise UserError(f"--pp-schedule dualpipe needs an even pp (pp={p}): device d holds stages d and "
                        f"pp-1-d, and the two directions alternate ticks")
    m = schedule.microbatches
    if m % p:
        raise UserError(f"--microbatches {m} must be a multiple of pp={p} "
                        "(the head and loss split the microbatches over the stages)")
    if for_training:
        shards = math.prod(shape[a] for a in BATCH_AXES)
        if cfg.training.microbatch % (m * shards):
            raise UserError(f"--batch {cfg.training.microbatch} does not divide into {m} microbatches x "
                            f"{shards} batch shards"
                            + (" per --grad-accum step" if cfg.training.grad_accum > 1 else ""))
    return schedule


def check_divisible(cfg, shape: Mapping[str, int], rules: Rules, skeleton: ModelSkeleton,
                    for_training: bool = True) -> None:
    if for_training:
        check_batch(cfg, shape)
    flat_shapes = traverse_util.flatten_dict(skeleton.shapes)
    flat_names = traverse_util.flatten_dict(skeleton.names, is_leaf=lambda _, v: is_names(v))
    for table in (rules.params, rules.grads, rules.opt_state):
        for path, names in flat_names.items():
            for size, name, entry in zip(flat_shapes[path].shape, names, spec_for(names, table)):
                axes = axes_of(entry)
                ways = math.prod(shape[a] for a in axes)
                if size % ways:
                    split = "x".join(f"{a}={shape[a]}" for a in axes)
                    raise UserError(
                        f"model {cfg.model.name}: {name}={size} does not divide by {split} "
                        f"(parameter {'.'.join(map(str, path))}, --zero {cfg.parallelism.zero})"
                    )


def check_batch(cfg, shape: Mapping[str, int]) -> None:
    shards = math.prod(shape[a] for a in BATCH_AXES)
    batch_axes = "x".join(f"{a}={shape[a]}" for a in BATCH_AXES if shape[a] > 1) or "1"
    if cfg.training.microbatch % shards:
        what = f"--batch {cfg.training.batch}"
        if cfg.training.grad_accum > 1:
            what += f" / --grad-accum {cfg.training.grad_accum} = {cfg.training.microbatch}"
        raise UserError(f"{what} does not divide by the batch axes ({batch_axes} = {shards} shards)")
    sp = shape["sp"]
    if sp > 1 and cfg.training.seq % (2 * sp):
        raise UserError(f"--seq {cfg.training.seq} does not divide into 2 x sp = {2 * sp} chunks "
                        "(sequence parallelism gives each sp rank two chunks, one early and one late)")
    if cfg.parallelism.megatron_sp and cfg.training.seq % (sp * shape["tp"]):
        raise UserError(f"--megatron-sp: --seq {cfg.training.seq} does not divide by sp x tp = {sp * shape['tp']}")
