"""The run's configuration: one dataclass, its command line, YAML presets and checks.

A YAML file given with `--config` is turned into flags placed before the command line's
own, so flags override the file and both go through the same parsing and checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence

from models import PRESETS
from models.lora import ATTENTION_TARGETS, MLP_TARGETS, TARGETS
from spmd.base import hardware
from spmd.base.cli import (TOKENS_PER_STEP, OneLineErrorParser, changed, finite,
                           flag_of, integer, nonempty, shown)
from spmd.base.errors import UserError
from spmd.parallel.pipeline import REPEATED_SCHEDULES, WRITTEN_OUT
from spmd.run.config_file import read_config_file
from spmd.run.options import TrainConfig, section_fields

# The options by section (spmd.run.options): `--help` lists the flags by section, and a YAML
# file may give its keys under these (`optimizer: {lr: 3.0e-4, warmup: 500}`) as well as flat.
# `model` and `data` are also options: a mapping under them is the section, a name the preset
# or the path.
SECTIONS: dict[str, tuple[str, ...]] = {
    section.name: tuple(option for option, f in section_fields(section.default_factory) if f.metadata.get("cli", True))
    for section in dataclasses.fields(TrainConfig)
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}


def train_parser(prog: str = "python -m spmd.train",
                 description: str = "Train a model on a named device mesh.") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE.yaml", type=nonempty,
                        help="YAML file of these options, flat or by section (flags override it)")
    groups = {section: parser.add_argument_group(f"{section} options") for section in SECTIONS}
    for option, f in cli_options():
        group = groups[SECTION_OF[option]]
        kwargs = {k: v for k, v in f.metadata.items() if k not in ("help", "bounds", "option")}
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            group.add_argument(flag_of(option), action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
            continue
        kind = {"int": integer, "float": finite, "int | None": integer, "float | None": finite}.get(f.type, nonempty)
        group.add_argument(flag_of(option), type=kind, default=f.default, help=help_text, **kwargs)
    return parser


def cli_options() -> list[tuple[str, dataclasses.Field]]:
    """Every option a flag sets, by its flat name, with its section's field."""
    return [(option, f) for section in dataclasses.fields(TrainConfig)
            for option, f in section_fields(section.default_factory) if f.metadata.get("cli", True)]


def _yaml_to_argv(path: str) -> list[str]:
    """The file's options as flags. Each value must have its flag's type: YAML's null,
    booleans, numbers and lists are never turned into text (`out: null` is no directory
    named None; `scale_lr: "false"` is no boolean)."""
    data = read_config_file(path)
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    names = dict(cli_options())
    argv: list[str] = []
    spelled: dict[str, object] = {}  # option -> the key that gave it (grad_accum and grad-accum are one)
    for key, value in _flattened(data, path):
        name = str(key).replace("-", "_")
        if name not in names:
            raise UserError(f"config file {path}: unknown option {key!r}")
        if name in spelled:
            raise UserError(f"config file {path}: {spelled[name]} and {key} are one option, given twice; give it once")
        spelled[name] = key
        field, flag = names[name], flag_of(name)
        wrong = f"config file {path}: {key} must be"
        if field.type == "bool":
            if not isinstance(value, bool):
                raise UserError(f"{wrong} true or false, got {value!r}")
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            if field.default is not None:
                raise UserError(f"{wrong} given a value (null is allowed only where the default is none)")
        elif name in ("mesh", "dcn") and isinstance(value, Mapping):
            pairs = [f"{k}={_scalar(v, f'{wrong} a mapping of axis: size')}" for k, v in value.items()]
            argv += [flag, ",".join(pairs) or "dp=1"]  # {}: no axis split, one device
        else:
            argv += [flag, _scalar(value, f"{wrong} a single value")]
    return argv


def _flattened(data: Mapping, path: str) -> list[tuple[object, object]]:
    """A YAML file's (key, value) pairs, those given under a section (SECTIONS) taken out
    of it: each must be one of the section's options."""
    pairs = []
    for key, value in data.items():
        if key in SECTIONS and key not in SECTION_OF and not isinstance(value, Mapping):
            raise UserError(f"config file {path}: {key} is a section, a mapping of its options "
                            f"({', '.join(SECTIONS[key])}); got {shown(value)}")
        if key not in SECTIONS or not isinstance(value, Mapping):
            pairs.append((key, value))
            continue
        for inner, inner_value in value.items():
            name = str(inner).replace("-", "_")
            if name not in SECTIONS[key]:
                where = f"an option of the {SECTION_OF[name]} section" if name in SECTION_OF else "no option"
                raise UserError(f"config file {path}: {key}.{inner} is {where}; the {key} section holds "
                                f"{', '.join(SECTIONS[key])}")
            pairs.append((inner, inner_value))
    return pairs


def _scalar(value, refusal: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UserError(f"{refusal}, got {value!r}")
    return str(value)


def parse(argv: Sequence[str] | None = None, prog: str = "python -m spmd.train",
          description: str = "Train a model on a named device mesh.",
          add_extras: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """The run's options as given (spmd.run.resolve checks them), plus the values of any
    flags `add_extras` adds (for other commands that take a run's options, like spmd.plan)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = train_parser(prog, description)
    if add_extras:
        add_extras(parser)
    config_path = find_config(argv)
    file_argv = _yaml_to_argv(config_path) if config_path else []
    ns = parser.parse_args(file_argv + argv)
    return TrainConfig.of(**{option: getattr(ns, option) for option, _ in cli_options()}), ns


def find_config(argv: Sequence[str]) -> str | None:
    found = [(i, arg) for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if len(found) > 1:
        raise UserError("--config is given twice; give one file (flags override it)")
    if not found:
        return None
    i, arg = found[0]
    path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
    if not path.strip():
        raise UserError("--config needs a file name")
    return path


def check(cfg: TrainConfig) -> TrainConfig:
    """The options checked against each other and the model they name (spmd.run.resolve
    finds it), before any device is touched; the mesh-dependent checks live in
    spmd.parallel.checks."""
    if cfg.model.preset is not None and cfg.model.preset not in PRESETS:
        raise UserError(f"unknown model {cfg.model.preset!r}; choose one of {', '.join(PRESETS)}")
    values = cfg.record()
    for option, f in cli_options():
        value, bounds = values[option], f.metadata["bounds"]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not bounds.holds(value):
            raise UserError(f"{flag_of(option)} must be {bounds}, got {value}")
    if cfg.training.batch * cfg.training.seq > TOKENS_PER_STEP:
        raise UserError(f"--batch {cfg.training.batch} x --seq {cfg.training.seq} is "
                        f"{cfg.training.batch * cfg.training.seq:,} tokens a step; at most "
                        f"{TOKENS_PER_STEP:,} (2**30) can be held: give a smaller --batch or --seq")
    if cfg.data.tokenizer and not cfg.data.path:
        raise UserError("--tokenizer applies to --data; the built-in data has its own tokens")
    cfg.parallelism.mesh_spec  # noqa: B018  (parsed here: a bad --mesh or --dcn is refused before anything else)
    _validate_moe(cfg, cfg.model_cfg)
    _validate_pipeline(cfg)
    _validate_lora(cfg, cfg.model_cfg)
    # (parsed here: refused before anything runs)
    if cfg.logging.profile_range and cfg.logging.profile_range[1] > cfg.training.steps:
        raise UserError(f"--profile-steps {cfg.logging.profile_steps} goes beyond --steps {cfg.training.steps}")
    _validate_mtp(cfg)
    if cfg.checkpoint.save_every and not cfg.checkpoint.out:
        raise UserError("--save-every needs --out DIR")
    if cfg.parallelism.hardware is not None:
        hardware.get(cfg.parallelism.hardware)
    if cfg.training.batch % cfg.training.grad_accum:
        raise UserError(f"--batch {cfg.training.batch} does not divide into --grad-accum {cfg.training.grad_accum} "
                        "microbatches")
    if cfg.data.data_workers is not None and cfg.data.data_workers > (cpus := hardware.usable_cpus()):
        raise UserError(f"--data-workers {cfg.data.data_workers} is more than the {cpus} CPUs this process may use: "
                        f"each worker keeps a CPU busy, so more would only compete for them; give at most {cpus}")
    return cfg


def _validate_moe(cfg: TrainConfig, model_cfg) -> None:
    if model_cfg.moe is None:
        for name in ("experts", "top_k", "router_bias_rate", "redundant_experts", "rebalance_every", "balance_loss",
                     "aux_loss_weight", "z_loss_weight"):
            if getattr(cfg.moe, name):
                raise UserError(f"{flag_of(name)} applies to MoE models; {cfg.model.name} is dense")
        return
    experts = cfg.moe.experts if cfg.moe.experts is not None else model_cfg.moe.experts
    top_k = cfg.moe.top_k if cfg.moe.top_k is not None else model_cfg.moe.top_k
    if top_k > experts:
        raise UserError(f"--top-k {top_k} is more than the {experts} experts")
    if cfg.moe.rebalance_every is not None and not cfg.moe.redundant_experts:
        raise UserError("--rebalance-every applies to --redundant-experts")
    if cfg.moe.redundant_experts and cfg.model.init_from:
        raise UserError("--redundant-experts and --init-from: a run with expert copies starts from its own "
                        "initialization (or resumes its checkpoint)")
    if (cfg.moe.balance_loss or model_cfg.moe.balance_loss) == "pooled" and cfg.parallelism.pp_schedule in WRITTEN_OUT:
        # Its gradient in one layer depends on the loads of every layer, which a stage's
        # backward pass under these schedules does not have.
        raise UserError(f"--pp-schedule {cfg.parallelism.pp_schedule} takes the per-sequence balance loss only; "
                        "the pooled one (transformers', the default of imported MoE models) couples every layer: "
                        "give --balance-loss sequence, or --pp-schedule gpipe or circular")
    if cfg.model.empty_layers % model_cfg.moe.every:
        raise UserError(f"--empty-layers {cfg.model.empty_layers}: {cfg.model.name} stacks its layers in groups of "
                        f"{model_cfg.moe.every} (MoE in every {model_cfg.moe.every}th); give a multiple of it")
    if cfg.model.layers is not None and cfg.model.layers % model_cfg.moe.every:
        raise UserError(f"--layers {cfg.model.layers}: {cfg.model.name} has MoE in every {model_cfg.moe.every}th "
                        f"layer; give a multiple of {model_cfg.moe.every}")


def _validate_mtp(cfg: TrainConfig) -> None:
    cfg.model.mtp_switch  # noqa: B018  (parsed here)
    if not cfg.model.mtp_depth:
        if others := changed(cfg.model, ("mtp_weight", "mtp_weight_later")):
            raise UserError(f"{flag_of(others[0])} applies to multi-token prediction; give --mtp-depth D")
        return
    if cfg.model.mtp_depth >= cfg.training.seq:
        raise UserError(f"--mtp-depth {cfg.model.mtp_depth} predicts beyond --seq {cfg.training.seq}: "
                        "give a longer --seq")


def _validate_lora(cfg: TrainConfig, model_cfg) -> None:
    if cfg.lora.adapter and not cfg.model.init_from:
        raise UserError("--adapter needs --init-from, the base model the adapter was trained on")
    if not cfg.lora.lora_rank:
        if others := changed(cfg.lora, ("lora_alpha", "lora_targets", "lora_dropout", "base_dtype", "adapter")):
            raise UserError(f"{flag_of(others[0])} applies to LoRA runs; give --lora-rank R")
        return
    if not model_cfg.projection_shapes():
        raise UserError(f"--lora-rank: LoRA adapts Llama's projections (q_proj, ...), which {cfg.model.name}'s latent "
                        "attention does not have")
    targets = [t.strip() for t in cfg.lora.lora_targets.split(",")]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not all(targets):
        raise UserError(f"--lora-targets {cfg.lora.lora_targets}: {unknown[0] if unknown else 'an empty name'} "
                        f"is not a projection of {cfg.model.name}; its projections are {', '.join(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise UserError(f"--lora-targets {cfg.lora.lora_targets} names a projection twice")
    mlp = [t for t in targets if t in MLP_TARGETS]
    if mlp and model_cfg.moe is not None:
        raise UserError(f"--lora-targets {mlp[0]}: the MLPs of {cfg.model.name} are experts, which take no adapters; "
                        f"target its attention projections ({', '.join(ATTENTION_TARGETS)})")
    for target in targets:
        inputs, outputs = (math.prod(dims) for dims in model_cfg.projection_shapes()[target])
        if cfg.lora.lora_rank > min(inputs, outputs):
            raise UserError(f"--lora-rank {cfg.lora.lora_rank} is more than {target}'s smaller side "
                            f"({inputs} -> {outputs} in {cfg.model.name}); give at most {min(inputs, outputs)}")
    if cfg.moe.redundant_experts:
        raise UserError("--redundant-experts and --lora-rank: expert copies move trained experts between devices; "
                        "a LoRA run's experts are frozen")


def check_empty_layers(cfg: TrainConfig, pp: int, needed: int = 0) -> None:
    """Empty layers only even out pipeline stages: a new run would carry more than the
    stages need (`needed`: spmd.parallel.layout.Layout.empty_layers_needed) for nothing.
    (A resumed run keeps those its checkpoint holds, on any mesh; a model served from one
    skips them.)"""
    model = cfg.model
    if model.empty_layers and pp == 1:
        raise UserError(f"--empty-layers {model.empty_layers} evens out pipeline stages, and the mesh has none (pp=1): "
                        "give a mesh with pp (e.g. --mesh pp=2), or no --empty-layers")
    if model.empty_layers > needed:
        raise UserError(f"--empty-layers {model.empty_layers} is more than the pp={pp} stages need to even out; give "
                        + (f"--empty-layers {needed}" if needed else "no --empty-layers: the layers divide without"))


def _validate_pipeline(cfg: TrainConfig) -> None:
    schedule = cfg.parallelism.pp_schedule
    if schedule in REPEATED_SCHEDULES and cfg.parallelism.pp_repeats < 2:
        # (interleaved-1f1b with one chunk per stage is 1f1b: asked for by its name)
        raise UserError(f"--pp-schedule {schedule} needs --pp-repeats 2 or more (chunks of layers per stage)"
                        + ("; with one chunk it is --pp-schedule 1f1b" if schedule != "circular" else ""))
    if schedule not in REPEATED_SCHEDULES and cfg.parallelism.pp_repeats != 1:
        raise UserError(f"--pp-repeats applies to --pp-schedule {' and '.join(REPEATED_SCHEDULES)}, not {schedule}")
