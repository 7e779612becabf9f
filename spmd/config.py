"""The run's configuration: one dataclass, its command line, YAML presets and checks.

A YAML file given with `--config` is turned into flags placed before the command line's
own, so flags override the file and both go through the same parsing and checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from spmd.errors import UserError

DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "dots")
ON_NAN = ("stop", "skip")
ATTENTION = ("ring", "all-gather")
MOE_DISPATCH = ("dropless", "capacity")
PP_SCHEDULES = ("gpipe", "circular", "1f1b")
TOKEN_DTYPES = ("uint16", "uint32")


def _field(default, help: str, **argparse_kwargs):
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    mesh: str = _field("dp=2,fsdp=2,tp=2", "mesh axis sizes, e.g. dp=4,tp=8 (axes pp,dp,fsdp,ep,sp,tp; unnamed = 1; -1 = the remaining devices)")
    cpu_devices: int | None = _field(None, "number of emulated CPU devices (default: what the mesh needs)")
    model: str = _field("tiny", "model preset (see models.PRESETS)")
    steps: int = _field(300, "optimizer steps to run")
    batch: int = _field(32, "global batch size, in sequences")
    seq: int = _field(64, "sequence length, in tokens")
    seed: int = _field(0, "seed of the initial parameters and of the data order")
    lr: float = _field(3e-3, "peak learning rate")
    warmup: int = _field(20, "linear warmup steps")
    min_lr_ratio: float = _field(0.1, "final learning rate of the cosine decay, as a fraction of the peak")
    weight_decay: float = _field(0.01, "AdamW weight decay (matrices only)")
    b1: float = _field(0.9, "Adam beta1")
    b2: float = _field(0.95, "Adam beta2")
    clip: float = _field(1.0, "global gradient-norm clipping threshold")
    scale_lr: bool = _field(False, "linear scaling rule: lr x batch / ref-batch")
    ref_batch: int = _field(256, "reference batch of --scale-lr")
    dtype: str = _field("float32", "compute dtype (master weights stay float32)", choices=DTYPES)
    zero: int = _field(0, "ZeRO stage over dp: 0 replicas, 1 optimizer state, 2 + gradients, 3 + parameters", choices=(0, 1, 2, 3))
    grad_accum: int = _field(1, "microbatches per step, accumulated in a scan with one gradient reduction")
    remat: str = _field("none", "activation checkpointing of each block", choices=REMAT)
    attention: str = _field("ring", "attention across the sp axis: K/V blocks passed around a ring, or all-gathered", choices=ATTENTION)
    megatron_sp: bool = _field(False, "Megatron sequence parallelism: norms and residuals split along the sequence over tp too")
    layers: int | None = _field(None, "number of layers (default: the preset's)")
    pp_schedule: str = _field("gpipe", "pipeline schedule over the pp axis (gpipe, circular with --pp-repeats chunks per stage, 1f1b)", choices=PP_SCHEDULES)
    pp_repeats: int = _field(1, "circular schedule: chunks of layers per pipeline stage (v)")
    microbatches: int | None = _field(None, "pipeline microbatches per step (default: pp; a multiple of pp)")
    experts: int | None = _field(None, "MoE models: number of experts (default: the preset's)")
    top_k: int | None = _field(None, "MoE models: experts per token (default: the preset's)")
    moe_dispatch: str = _field("dropless", "MoE models: every token reaches its experts, or each expert takes at most a capacity of each sequence's tokens (the rest dropped)", choices=MOE_DISPATCH)
    capacity_factor: float = _field(1.25, "capacity mode: slots per expert per sequence = factor x seq x top-k / experts")
    aux_loss_weight: float = _field(0.01, "MoE models: weight of the load-balancing loss")
    z_loss_weight: float = _field(0.001, "MoE models: weight of the router z-loss")
    log_every: int = _field(10, "print a log line every N steps (metrics are fetched from devices only then)")
    metrics_file: str | None = _field(None, "write one JSON object per step to this .jsonl file (appended on resume)")
    out: str | None = _field(None, "directory for checkpoints; a run resumes from its latest checkpoint there")
    save_every: int = _field(0, "save a checkpoint every N steps (0: only at the end); needs --out")
    keep: int = _field(3, "checkpoints to keep in --out")
    resume: str | None = _field(None, "resume from this run directory's latest checkpoint, or from one step's directory")
    on_nan: str = _field("stop", "on a non-finite loss, drop that update, then stop (naming the last good checkpoint) or skip and go on", choices=ON_NAN)
    hardware: str | None = _field(None, "accelerator the layout is planned for (spmd/hardware.toml; default: the one found, if listed)")
    data: str | None = _field(None, "local training data: a text file or folder (.txt/.md, .jsonl, .parquet) or token files (.npy, .bin); default: the built-in synthetic chain")
    tokenizer: str | None = _field(None, "SentencePiece .model or Hugging Face tokenizer.json for text data (default: UTF-8 bytes)")
    text_field: str = _field("text", "the field of JSONL records / column of Parquet files that holds the text")
    token_dtype: str = _field("uint16", "dtype of raw .bin token files (.npy files say their own)", choices=TOKEN_DTYPES)
    eval_every: int = _field(0, "every N steps, report the loss on held-out data (0: never)")
    eval_batches: int = _field(4, "batches of held-out data per evaluation")
    eval_fraction: float = _field(0.05, "share of --data's samples held out for evaluation (when --eval-every is set)")
    coordinator: str | None = _field(None, "several processes: process 0's host:port, or 'auto' to let JAX find the cluster (TPU pod, SLURM, Open MPI); default: from the environment, else one process")
    num_processes: int | None = _field(None, "several processes: how many")
    process_id: int | None = _field(None, "several processes: this one's index, 0 to N-1")
    dcn: str | None = _field(None, "the part of the mesh that spans processes or slices over the data-center network, e.g. dp=2 (each named axis's factor; the rest of the mesh stays within a host or slice)")
    step_timeout: float = _field(300.0, "seconds the host waits for a step before deciding a process died or hangs, and exiting with an error")
    heartbeat_timeout: int = _field(100, "several processes: seconds without a heartbeat before the others give up on a process")

    @property
    def microbatch(self) -> int:
        return self.batch // self.grad_accum


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of these options (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {k: v for k, v in f.metadata.items() if k != "help"}
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int}.get(f.type, str)
        parser.add_argument(flag, type=kind, default=f.default, help=help_text, **kwargs)
    return parser


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


def _yaml_to_argv(path: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where else ""
        raise UserError(f"config file {path} is not valid YAML{at}") from None
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    names = {f.name: f for f in dataclasses.fields(TrainConfig)}
    argv: list[str] = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise UserError(f"config file {path}: unknown option {key!r}")
        flag = "--" + name.replace("_", "-")
        if names[name].type == "bool":
            argv.append(flag if value else "--no-" + flag[2:])
        elif name in ("mesh", "dcn") and isinstance(value, Mapping):
            argv += [flag, ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    return parse_with_extras(argv)[0]


def parse_with_extras(argv: Sequence[str] | None = None, prog: str = "python -m spmd.train",
                      description: str = "Train a model on a named device mesh.",
                      add_extras: Callable[[argparse.ArgumentParser], None] | None = None,
                      ) -> tuple[TrainConfig, argparse.Namespace]:
    """The run's config, plus the values of any flags `add_extras` adds (for other CLIs
    that take a run's options, like spmd.plan)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(prog, description)
    if add_extras:
        add_extras(parser)
    config_path = _find_config(argv)
    file_argv = _yaml_to_argv(config_path) if config_path else []
    ns = parser.parse_args(file_argv + argv)
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)}
    return validate(TrainConfig(**values)), ns


def _find_config(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UserError("--config needs a file name")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks that need no devices and no model; the mesh-dependent ones live in spmd.layout."""
    from models import PRESETS

    if cfg.model not in PRESETS:
        raise UserError(f"unknown model {cfg.model!r}; choose one of {', '.join(PRESETS)}")
    for name in ("batch", "seq", "grad_accum", "log_every", "ref_batch", "keep", "pp_repeats", "eval_batches",
                 "heartbeat_timeout"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    for name in ("steps", "warmup", "save_every", "eval_every"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} must not be negative, got {getattr(cfg, name)}")
    if cfg.lr <= 0 or cfg.clip <= 0:
        raise UserError("--lr and --clip must be positive")
    if not 0 < cfg.eval_fraction < 1 or not cfg.step_timeout > 0:
        raise UserError("--eval-fraction must be between 0 and 1, and --step-timeout positive")
    if cfg.tokenizer and not cfg.data:
        raise UserError("--tokenizer applies to --data; the built-in data has its own tokens")
    if cfg.dcn:
        from spmd.mesh import parse_mesh

        parse_mesh(cfg.dcn)
    _validate_moe(cfg, PRESETS[cfg.model])
    _validate_pipeline(cfg)
    if cfg.save_every and not cfg.out:
        raise UserError("--save-every needs --out DIR")
    if cfg.hardware is not None:
        from spmd import hardware

        hardware.get(cfg.hardware)
    if cfg.batch % cfg.grad_accum:
        raise UserError(f"--batch {cfg.batch} does not divide into --grad-accum {cfg.grad_accum} microbatches")
    return cfg


def _validate_moe(cfg: TrainConfig, model_cfg) -> None:
    if model_cfg.moe is None:
        if cfg.experts is not None or cfg.top_k is not None:
            raise UserError(f"--experts and --top-k apply to MoE models; {cfg.model} is dense")
        return
    experts = cfg.experts if cfg.experts is not None else model_cfg.moe.experts
    top_k = cfg.top_k if cfg.top_k is not None else model_cfg.moe.top_k
    if experts < 1 or top_k < 1:
        raise UserError(f"--experts and --top-k must be at least 1, got {experts} and {top_k}")
    if top_k > experts:
        raise UserError(f"--top-k {top_k} is more than the {experts} experts")
    if cfg.layers is not None and cfg.layers % model_cfg.moe.every:
        raise UserError(f"--layers {cfg.layers}: {cfg.model} has MoE in every {model_cfg.moe.every}th layer; "
                        f"give a multiple of {model_cfg.moe.every}")
    if not cfg.capacity_factor > 0:
        raise UserError(f"--capacity-factor must be positive, got {cfg.capacity_factor}")
    if cfg.aux_loss_weight < 0 or cfg.z_loss_weight < 0:
        raise UserError("--aux-loss-weight and --z-loss-weight must not be negative")


def _validate_pipeline(cfg: TrainConfig) -> None:
    if cfg.layers is not None and cfg.layers < 1:
        raise UserError(f"--layers must be at least 1, got {cfg.layers}")
    if cfg.microbatches is not None and cfg.microbatches < 1:
        raise UserError(f"--microbatches must be at least 1, got {cfg.microbatches}")
    if cfg.pp_schedule == "circular" and cfg.pp_repeats < 2:
        raise UserError("--pp-schedule circular needs --pp-repeats 2 or more (chunks of layers per stage)")
    if cfg.pp_schedule != "circular" and cfg.pp_repeats != 1:
        raise UserError(f"--pp-repeats applies to --pp-schedule circular, not {cfg.pp_schedule}")


def model_config(cfg: TrainConfig):
    """The model preset with the run's overrides (depth, number of experts, top-k)."""
    from models import PRESETS

    model_cfg = PRESETS[cfg.model]
    if cfg.layers is not None:
        model_cfg = dataclasses.replace(model_cfg, layers=cfg.layers)
    if model_cfg.moe is None:
        return model_cfg
    moe = dataclasses.replace(model_cfg.moe, **{k: v for k, v in (("experts", cfg.experts), ("top_k", cfg.top_k))
                                                  if v is not None})
    return dataclasses.replace(model_cfg, moe=moe)
