"""The run's configuration: one dataclass, its command line, YAML presets and checks.

A YAML file given with `--config` is turned into flags placed before the command line's
own, so flags override the file and both go through the same parsing and checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence

from models import PRESETS
from models.lora import ATTENTION_TARGETS, MAX_ALPHA, MLP_TARGETS, TARGETS
from spmd.base import hardware
from spmd.base.cli import (DATA_FLAGS, DTYPES, SEED, SEQ, TOKENS_PER_STEP, OneLineErrorParser, changed, finite,
                           flag_of, integer, nonempty, parse_integer, shown)
from spmd.base.errors import UserError
from spmd.base.schema import Bounds
from spmd.parallel.mesh import MeshSpec
from spmd.parallel.pipeline import PP_SCHEDULES, REPEATED_SCHEDULES, WRITTEN_OUT
from spmd.parallel.skeleton import REMAT, model_config
from spmd.run.config_file import read_config_file
from spmd.run.distributed import MAX_PROCESSES

ON_NAN = ("stop", "skip")
ATTENTION = ("ring", "all-gather")
ATTENTION_KERNELS = ("auto", "xla", "cudnn", "splash", "chunked")
MOE_DISPATCH = ("dropless", "capacity")
BALANCE_LOSSES = ("sequence", "pooled")  # models.moe.MoEConfig.balance_loss

# The upper bounds of the sizes a run's options set, checked before anything is allocated.
# Steps (--steps, --warmup, every step a flag names): optax's schedule and the step counter
# are int32 (beyond, the first step overflows).
STEPS = 2**31 - 1
# The model's sizes a flag sets (layers, experts, their copies): far beyond any published
# model (DeepSeek-V3: 61 layers, 256 experts), so that a typo is refused, not built.
MODEL_SIZE = 2**16
# The weight of a loss term beside the main loss (MoE's balance and z-losses, multi-token
# prediction): DeepSeek-V3 gives 0.3, Mixtral 0.02; a thousand swamps the main loss long
# before a term of a few nats times it leaves float32's range.
LOSS_WEIGHT = 1000.0
# Seconds a process waits for the others: a week, within every clock's and runtime's range
# (Python's waits end at threading.TIMEOUT_MAX; JAX's distributed runtime takes int seconds).
WAIT_S = 7 * 24 * 3600


def _field(default, help: str, at_least=None, above=None, at_most=None, below=None, **argparse_kwargs):
    bounds = Bounds(at_least, above, at_most, below)
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds, **argparse_kwargs})


def _data_field(name: str):
    """A field defined by spmd.base.cli.DATA_FLAGS, as spmd.corpus and spmd.eval take it too."""
    flag, b = DATA_FLAGS[name], DATA_FLAGS[name].bounds
    return _field(flag.default, flag.help, b.at_least, b.above, b.at_most, b.below,
                  **({"choices": flag.choices} if flag.choices else {}))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    mesh: str | None = _field(None, "mesh axis sizes, e.g. dp=4,tp=8 (axes pp,dp,fsdp,ep,sp,tp; unnamed = 1; -1 = the remaining devices); none: every device found, laid out by spmd.parallel.defaults: dp=2,fsdp=2,tp=2 on 8 (as many emulated on a CPU-only host set up with none), fsdp over any other number")
    cpu_devices: int | None = _field(None, "number of emulated CPU devices (default: what the mesh needs)", at_least=1)
    model: str | None = _field(None, "model preset (see models.PRESETS; default: tiny, or the model of --init-from, or that of the checkpoint --resume names)")
    init_from: str | None = _field(None, "start from the weights of a Hugging Face model directory (config.json and safetensors: Llama, Mixtral); the model is the directory's, and its tokenizer.json tokenizes --data")
    steps: int = _field(300, "optimizer steps to run", at_least=0, at_most=STEPS)
    batch: int = _field(32, "global batch size, in sequences", at_least=1, at_most=TOKENS_PER_STEP)
    seq: int = _field(64, "sequence length, in tokens", SEQ.at_least, at_most=SEQ.at_most)
    seed: int = _field(0, "seed of the initial parameters and of the data order", SEED.at_least, at_most=SEED.at_most)
    lr: float = _field(3e-3, "peak learning rate", above=0)
    warmup: int = _field(20, "linear warmup steps from 0 to the peak (kept as given: a warmup of --steps or more ends the run before the peak)", at_least=0, at_most=STEPS)
    min_lr_ratio: float = _field(0.1, "final learning rate of the cosine decay, as a fraction of the peak", at_least=0, at_most=1)
    weight_decay: float = _field(0.01, "AdamW weight decay (matrices only)", at_least=0)
    b1: float = _field(0.9, "Adam beta1", at_least=0, below=1)
    b2: float = _field(0.95, "Adam beta2", at_least=0, below=1)
    eps: float = _field(1e-8, "Adam epsilon, added to the root of the second moment", above=0)
    clip: float = _field(1.0, "global gradient-norm clipping threshold", above=0)
    scale_lr: bool = _field(False, "linear scaling rule: lr x batch / ref-batch")
    ref_batch: int = _field(256, "reference batch of --scale-lr", at_least=1, at_most=TOKENS_PER_STEP)
    dtype: str = _field("float32", "compute dtype (master weights stay float32)", choices=DTYPES)
    zero: int = _field(0, "ZeRO stage over dp (and ep, for every weight but the experts): 0 replicas, 1 optimizer state, 2 + gradients, 3 + parameters", choices=(0, 1, 2, 3))
    grad_accum: int = _field(1, "microbatches per step, accumulated in a scan with one gradient reduction", at_least=1,
                             at_most=TOKENS_PER_STEP)
    remat: str = _field("none", "activation checkpointing of each block: none keeps every matmul output, dots those without batch dimensions, full only the block's input; DeepSeek-V3's mla is none but for latent attention's up-projections, made again from their latents", choices=REMAT)
    attention: str = _field("ring", "attention across the sp axis: K/V blocks passed around a ring, or all-gathered", choices=ATTENTION)
    attention_kernel: str = _field("auto", "attention's kernel: auto (cudnn on NVIDIA GPUs, splash on TPU, chunked elsewhere), xla (scores materialized), cudnn (fused flash attention), splash (Pallas, TPU), chunked (flash-style in plain JAX: memory linear in the sequence)", choices=ATTENTION_KERNELS)
    megatron_sp: bool = _field(False, "Megatron sequence parallelism: norms and residuals split along the sequence over tp too")
    layers: int | None = _field(None, "number of layers (default: the preset's)", at_least=1, at_most=MODEL_SIZE)
    empty_layers: int = _field(0, "identity layers after the stacked ones, so that pipeline stages of equal depth hold a depth that does not divide (DeepSeek-V3's 58 MoE layers as 16 x 2 chunks of 2: 6); stages run them (their compute and memory), a step without stages skips them; never trained or exported", at_least=0, at_most=MODEL_SIZE)
    pp_schedule: str = _field("gpipe", "pipeline schedule over the pp axis (gpipe, circular with --pp-repeats chunks per stage, 1f1b, interleaved-1f1b: 1f1b on circular's chunks, zb-v: zero bubble, 2 chunks per stage in a V, dualpipe: DeepSeek's two directions, 2 stages per device)", choices=PP_SCHEDULES)
    pp_repeats: int = _field(1, "circular and interleaved-1f1b schedules: chunks of layers per pipeline stage (v)", at_least=1, at_most=MODEL_SIZE)
    microbatches: int | None = _field(None, "pipeline microbatches per step (default: pp; a multiple of pp)", at_least=1,
                                      at_most=TOKENS_PER_STEP)
    experts: int | None = _field(None, "MoE models: number of experts (default: the preset's)", at_least=1, at_most=MODEL_SIZE)
    top_k: int | None = _field(None, "MoE models: experts per token (default: the preset's)", at_least=1,
                                 at_most=MODEL_SIZE)
    moe_dispatch: str = _field("dropless", "MoE models: every token reaches its experts, or each expert takes at most a capacity of each sequence's tokens (the rest dropped)", choices=MOE_DISPATCH)
    capacity_factor: float = _field(1.25, "capacity mode: slots per expert per sequence = factor x seq x top-k / experts", above=0)
    router_bias_rate: float = _field(0.0, "MoE models: auxiliary-loss-free balancing (DeepSeek-V3): after each step, each expert's selection bias moves by this much towards the mean load (0: off)", at_least=0)
    redundant_experts: int = _field(0, "MoE models: extra expert slots over ep holding copies of the busiest experts (EPLB); experts + this must divide by ep", at_least=0, at_most=MODEL_SIZE)
    rebalance_every: int | None = _field(None, "with --redundant-experts: recompute the placement of experts on slots from the measured load every N steps (default: 50)", at_least=1, at_most=STEPS)
    balance_loss: str | None = _field(None, "MoE models: the load-balancing loss per sequence (spmd's presets), or pooled over the batch and all MoE layers (transformers' Mixtral and Qwen-MoE); default: the model's (pooled for an imported model)", choices=BALANCE_LOSSES)
    aux_loss_weight: float | None = _field(None, "MoE models: weight of the load-balancing loss (default: the model's: 0.01 for presets, config.json's router_aux_loss_coef for an imported model)", at_least=0, at_most=LOSS_WEIGHT)
    z_loss_weight: float | None = _field(None, "MoE models: weight of the router z-loss (default: the model's: 0.001 for presets, 0 for an imported model, which has none)", at_least=0, at_most=LOSS_WEIGHT)
    mtp_depth: int = _field(0, "DeepSeek-V3: multi-token prediction modules after the model (the report's D; DeepSeek trained 1), the k-th predicting the token k + 1 beyond the next; trained with the main loss, left out of exported models", at_least=0, at_most=MODEL_SIZE)
    mtp_weight: float = _field(0.3, "multi-token prediction: the weight of its loss, the mean over its depths (the report's λ)", at_least=0, at_most=LOSS_WEIGHT)
    mtp_weight_later: str | None = _field(None, "multi-token prediction: STEP:WEIGHT, its weight from that optimizer step on (DeepSeek-V3: 0.3, then 0.1 for its last 4.8T of 14.8T tokens)")
    log_every: int = _field(10, "print a log line every N steps (metrics are fetched from devices only then)", at_least=1,
                           at_most=STEPS)
    profile_steps: str | None = _field(None, "capture a profiler trace of steps A to B (A:B, numbered as in the log line, both included)")
    profile_dir: str = _field("profile", "directory of the --profile-steps trace (TensorBoard's profile plugin, xprof, Perfetto)")
    tensorboard: str | None = _field(None, "also write every metric as TensorBoard scalars into this directory (process 0)")
    metrics_file: str | None = _field(None, "write one JSON object per step to this .jsonl file (a resumed run keeps the records before its checkpoint)")
    out: str | None = _field(None, "directory for checkpoints; a run resumes from its latest checkpoint there")
    save_every: int = _field(0, "save a checkpoint every N steps (0: only at the end); needs --out", at_least=0,
                            at_most=STEPS)
    keep: int = _field(3, "checkpoints to keep in --out", at_least=1, at_most=STEPS)
    resume: str | None = _field(None, "resume from this run directory's latest checkpoint, or from one step's directory")
    resume_with_changes: bool = _field(False, "resume although --steps, --batch, --seq, --seed or the learning-rate schedule differ from the checkpoint's run")
    on_nan: str = _field("stop", "on a non-finite loss, drop that update, then stop (naming the last good checkpoint) or skip and go on", choices=ON_NAN)
    hardware: str | None = _field(None, "accelerator the layout is planned for (spmd/base/hardware.toml; default: the one found, if listed)")
    data: str | None = _field(None, "local training data: a text file or folder (.txt/.md, .jsonl, .parquet), fine-tuning records (JSONL, Parquet or a datasets folder of prompt/completion or chat messages), or token files (.npy, .bin); default: the built-in synthetic chain")
    tokenizer: str | None = _field(None, "SentencePiece .model, Hugging Face tokenizer.json, or a Hugging Face tokenizer directory (with its chat template: chat records need one) for --data (default: UTF-8 bytes, or --init-from's)")
    text_field: str = _data_field("text_field")
    token_dtype: str = _data_field("token_dtype")
    loss_on: str = _data_field("loss_on")
    overlong: str = _data_field("overlong")
    data_workers: int | None = _field(None, "fine-tuning records: processes that tokenize them ahead of the steps (0: the trainer's own; default: one per CPU the process may use, less one, at most 8, when there are more than 2,048 records; at most the CPUs it may use)", at_least=0)
    max_record_bytes: int = _data_field("max_record_bytes")
    document_mask: bool = _data_field("document_mask")
    eval_every: int = _field(0, "every N steps, report the loss on held-out data (0: never)", at_least=0,
                            at_most=STEPS)
    eval_batches: int = _field(4, "batches of held-out data per evaluation (no more than it holds)", at_least=1,
                               at_most=1_000_000)
    eval_fraction: float = _field(0.05, "share of --data's samples held out for evaluation (when --eval-every is set)", above=0, below=1)
    coordinator: str | None = _field(None, "several processes: process 0's host:port, or 'auto' to let JAX find the cluster (TPU pod, SLURM, Open MPI); default: from the environment, else one process")
    num_processes: int | None = _field(None, "several processes: how many", at_least=1, at_most=MAX_PROCESSES)
    process_id: int | None = _field(None, "several processes: this one's index, 0 to N-1", at_least=0,
                                    at_most=MAX_PROCESSES - 1)
    dcn: str | None = _field(None, "the part of the mesh that spans processes or slices over the data-center network, e.g. dp=2 (each named axis's factor; the rest of the mesh stays within a host or slice)")
    step_timeout: float = _field(300.0, "seconds the host waits for a step before deciding a process died or hangs, and exiting with an error", above=0, at_most=WAIT_S)
    join_timeout: int = _field(300, "several processes: seconds to wait for all of them to join the run before giving up", at_least=1, at_most=WAIT_S)
    ignore_fit: bool = _field(False, "train even when the plan says the step does not fit the devices' memory")
    lora_rank: int | None = _field(None, "train low-rank adapters (LoRA, as PEFT defines them) of this rank on --lora-targets, the base weights frozen (default: a full fine-tune)", at_least=1, at_most=MODEL_SIZE)
    lora_alpha: float = _field(8.0, "LoRA: the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)", above=0,
                               at_most=MAX_ALPHA)
    lora_targets: str = _field("q_proj,k_proj,v_proj,o_proj", "LoRA: the projections adapted, in Hugging Face names (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    lora_dropout: float = _field(0.0, "LoRA: the probability of dropping each element of an adapter's input, in training (PEFT's lora_dropout)", at_least=0, below=1)
    base_dtype: str = _field("float32", "LoRA: the dtype the frozen base weights are stored in", choices=DTYPES)
    adapter: str | None = _field(None, "LoRA: start from a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) on --init-from's model")
    heartbeat_timeout: int = _field(100, "several processes: seconds without a heartbeat before the others give up on a process", at_least=1, at_most=WAIT_S)
    # Not a flag: the model config when it is no preset (--init-from's config.json, or a
    # resumed checkpoint's); saved with the run, so the run can be resumed and exported.
    architecture: object = dataclasses.field(default=None, metadata={"cli": False, "bounds": Bounds()})
    # Not a flag: a model served from a checkpoint trained with --router-bias-rate keeps the
    # learned selection bias as one of its weights (spmd.run.weights).
    router_bias_weight: bool = dataclasses.field(default=False, metadata={"cli": False, "bounds": Bounds()})

    @functools.cached_property
    def mesh_spec(self):
        """`mesh` and `dcn`, parsed (spmd.parallel.mesh.MeshSpec): the one place the strings are read."""
        return MeshSpec.parse(self.mesh, self.dcn)

    @functools.cached_property
    def model_cfg(self):
        """The model this run builds (spmd.parallel.skeleton.model_config): resolved once, here,
        and read by every part of the run."""
        return model_config(self)

    @property
    def model_name(self) -> str:
        if self.model:
            return self.model
        if self.init_from:
            return f"{self.init_from} (Hugging Face)"
        return "imported" if self.architecture is not None else "tiny"

    @functools.cached_property
    def profile_range(self) -> tuple[int, int] | None:
        """--profile-steps A:B as (A, B), steps numbered from 1 as in the log line."""
        if self.profile_steps is None:
            return None
        match = re.fullmatch(r"([0-9]+):([0-9]+)", self.profile_steps)
        if not match:
            raise UserError(f"--profile-steps must be A:B (first and last step to profile), got "
                            f"{shown(self.profile_steps)}")
        first, last = (parse_integer(match[i], f"--profile-steps {side}", Bounds(at_least=0, at_most=STEPS))
                       for i, side in ((1, "A"), (2, "B")))
        if not 1 <= first <= last:
            raise UserError(f"--profile-steps {self.profile_steps}: the first step must be at least 1 and at most the last")
        if last > self.steps:
            raise UserError(f"--profile-steps {self.profile_steps} goes beyond --steps {self.steps}")
        return first, last

    @functools.cached_property
    def mtp_switch(self) -> tuple[int, float] | None:
        """--mtp-weight-later STEP:WEIGHT as (step, weight)."""
        if self.mtp_weight_later is None:
            return None
        match = re.fullmatch(r"([0-9]+):([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", self.mtp_weight_later)
        if not match:
            raise UserError(f"--mtp-weight-later must be STEP:WEIGHT (e.g. 5000:0.1), got "
                            f"{shown(self.mtp_weight_later)}")
        step = parse_integer(match[1], "--mtp-weight-later's STEP", Bounds(at_least=0, at_most=STEPS))
        weight, bounds = float(match[2]), Bounds(at_least=0, at_most=LOSS_WEIGHT)
        if not bounds.holds(weight):  # (the regex admits no sign, NaN nor infinity; 1e999 is infinite)
            raise UserError(f"--mtp-weight-later's WEIGHT must be {bounds}, got {shown(match[2])}")
        return step, weight

    @property
    def microbatch(self) -> int:
        return self.batch // self.grad_accum


# The options by the part of the trainer that reads them, as torchtitan's job config groups
# them: `--help` lists the flags by section, and a YAML file may give its keys under these
# (`optimizer: {lr: 3.0e-4, warmup: 500}`) as well as flat. `model` is also an option: a
# mapping under it is the section, a name the preset.
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "init_from", "layers", "empty_layers", "dtype", "remat", "attention_kernel", "mtp_depth",
              "mtp_weight", "mtp_weight_later"),
    "training": ("steps", "batch", "seq", "seed", "grad_accum", "on_nan"),
    "optimizer": ("lr", "warmup", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "clip", "scale_lr", "ref_batch"),
    "parallelism": ("mesh", "dcn", "cpu_devices", "zero", "megatron_sp", "attention", "pp_schedule", "pp_repeats",
                    "microbatches", "hardware", "ignore_fit"),
    "moe": ("experts", "top_k", "moe_dispatch", "capacity_factor", "router_bias_rate", "redundant_experts",
            "rebalance_every", "balance_loss", "aux_loss_weight", "z_loss_weight"),
    "lora": ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "base_dtype", "adapter"),
    "data": ("data", "tokenizer", "text_field", "token_dtype", "loss_on", "overlong", "data_workers",
             "max_record_bytes", "document_mask", "eval_every", "eval_batches", "eval_fraction"),
    "checkpoint": ("out", "save_every", "keep", "resume", "resume_with_changes"),
    "logging": ("log_every", "metrics_file", "tensorboard", "profile_steps", "profile_dir"),
    "processes": ("coordinator", "num_processes", "process_id", "join_timeout", "heartbeat_timeout", "step_timeout"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}


def train_parser(prog: str = "python -m spmd.train",
                 description: str = "Train a model on a named device mesh.") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE.yaml", type=nonempty,
                        help="YAML file of these options, flat or by section (flags override it)")
    groups = {section: parser.add_argument_group(f"{section} options") for section in SECTIONS}
    for f in cli_fields():
        group = groups[SECTION_OF[f.name]]
        kwargs = {k: v for k, v in f.metadata.items() if k not in ("help", "bounds")}
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            group.add_argument(flag_of(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kind = {"int": integer, "float": finite, "int | None": integer, "float | None": finite}.get(f.type, nonempty)
        group.add_argument(flag_of(f.name), type=kind, default=f.default, help=help_text, **kwargs)
    return parser


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli", True)]


def _yaml_to_argv(path: str) -> list[str]:
    """The file's options as flags. Each value must have its flag's type: YAML's null,
    booleans, numbers and lists are never turned into text (`out: null` is no directory
    named None; `scale_lr: "false"` is no boolean)."""
    data = read_config_file(path)
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise UserError(f"config file {path} must hold a mapping of option: value")
    names = {f.name: f for f in cli_fields()}
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
    values = {f.name: getattr(ns, f.name) for f in cli_fields()}
    return TrainConfig(**values), ns


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
    if cfg.model is not None and cfg.model not in PRESETS:
        raise UserError(f"unknown model {cfg.model!r}; choose one of {', '.join(PRESETS)}")
    for f in dataclasses.fields(cfg):
        value, bounds = getattr(cfg, f.name), f.metadata["bounds"]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not bounds.holds(value):
            raise UserError(f"{flag_of(f.name)} must be {bounds}, got {value}")
    if cfg.batch * cfg.seq > TOKENS_PER_STEP:
        raise UserError(f"--batch {cfg.batch} x --seq {cfg.seq} is {cfg.batch * cfg.seq:,} tokens a step; at most "
                        f"{TOKENS_PER_STEP:,} (2**30) can be held: give a smaller --batch or --seq")
    if cfg.tokenizer and not cfg.data:
        raise UserError("--tokenizer applies to --data; the built-in data has its own tokens")
    cfg.mesh_spec  # noqa: B018  (parsed here: a bad --mesh or --dcn is refused before anything else)
    _validate_moe(cfg, cfg.model_cfg)
    _validate_pipeline(cfg)
    _validate_lora(cfg, cfg.model_cfg)
    cfg.profile_range  # noqa: B018  (parsed here: a bad range is refused before anything runs)
    _validate_mtp(cfg)
    if cfg.save_every and not cfg.out:
        raise UserError("--save-every needs --out DIR")
    if cfg.hardware is not None:
        hardware.get(cfg.hardware)
    if cfg.batch % cfg.grad_accum:
        raise UserError(f"--batch {cfg.batch} does not divide into --grad-accum {cfg.grad_accum} microbatches")
    if cfg.data_workers is not None and cfg.data_workers > (cpus := hardware.usable_cpus()):
        raise UserError(f"--data-workers {cfg.data_workers} is more than the {cpus} CPUs this process may use: each "
                        f"worker keeps a CPU busy, so more would only compete for them; give at most {cpus}")
    return cfg


def _validate_moe(cfg: TrainConfig, model_cfg) -> None:
    if model_cfg.moe is None:
        for name in ("experts", "top_k", "router_bias_rate", "redundant_experts", "rebalance_every", "balance_loss",
                     "aux_loss_weight", "z_loss_weight"):
            if getattr(cfg, name):
                raise UserError(f"{flag_of(name)} applies to MoE models; {cfg.model_name} is dense")
        return
    experts = cfg.experts if cfg.experts is not None else model_cfg.moe.experts
    top_k = cfg.top_k if cfg.top_k is not None else model_cfg.moe.top_k
    if top_k > experts:
        raise UserError(f"--top-k {top_k} is more than the {experts} experts")
    if cfg.rebalance_every is not None and not cfg.redundant_experts:
        raise UserError("--rebalance-every applies to --redundant-experts")
    if cfg.redundant_experts and cfg.init_from:
        raise UserError("--redundant-experts and --init-from: a run with expert copies starts from its own "
                        "initialization (or resumes its checkpoint)")
    if (cfg.balance_loss or model_cfg.moe.balance_loss) == "pooled" and cfg.pp_schedule in WRITTEN_OUT:
        # Its gradient in one layer depends on the loads of every layer, which a stage's
        # backward pass under these schedules does not have.
        raise UserError(f"--pp-schedule {cfg.pp_schedule} takes the per-sequence balance loss only; the pooled one "
                        "(transformers', the default of imported MoE models) couples every layer: give --balance-loss "
                        "sequence, or --pp-schedule gpipe or circular")
    if cfg.empty_layers % model_cfg.moe.every:
        raise UserError(f"--empty-layers {cfg.empty_layers}: {cfg.model_name} stacks its layers in groups of "
                        f"{model_cfg.moe.every} (MoE in every {model_cfg.moe.every}th); give a multiple of it")
    if cfg.layers is not None and cfg.layers % model_cfg.moe.every:
        raise UserError(f"--layers {cfg.layers}: {cfg.model_name} has MoE in every {model_cfg.moe.every}th layer; "
                        f"give a multiple of {model_cfg.moe.every}")


def _validate_mtp(cfg: TrainConfig) -> None:
    cfg.mtp_switch  # noqa: B018  (parsed here)
    if not cfg.mtp_depth:
        if others := changed(cfg, ("mtp_weight", "mtp_weight_later")):
            raise UserError(f"{flag_of(others[0])} applies to multi-token prediction; give --mtp-depth D")
        return
    if cfg.mtp_depth >= cfg.seq:
        raise UserError(f"--mtp-depth {cfg.mtp_depth} predicts beyond --seq {cfg.seq}: give a longer --seq")


def _validate_lora(cfg: TrainConfig, model_cfg) -> None:
    if cfg.adapter and not cfg.init_from:
        raise UserError("--adapter needs --init-from, the base model the adapter was trained on")
    if not cfg.lora_rank:
        if others := changed(cfg, ("lora_alpha", "lora_targets", "lora_dropout", "base_dtype", "adapter")):
            raise UserError(f"{flag_of(others[0])} applies to LoRA runs; give --lora-rank R")
        return
    if not model_cfg.projection_shapes():
        raise UserError(f"--lora-rank: LoRA adapts Llama's projections (q_proj, ...), which {cfg.model_name}'s latent "
                        "attention does not have")
    targets = [t.strip() for t in cfg.lora_targets.split(",")]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not all(targets):
        raise UserError(f"--lora-targets {cfg.lora_targets}: {unknown[0] if unknown else 'an empty name'} is not a "
                        f"projection of {cfg.model_name}; its projections are {', '.join(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise UserError(f"--lora-targets {cfg.lora_targets} names a projection twice")
    mlp = [t for t in targets if t in MLP_TARGETS]
    if mlp and model_cfg.moe is not None:
        raise UserError(f"--lora-targets {mlp[0]}: the MLPs of {cfg.model_name} are experts, which take no adapters; "
                        f"target its attention projections ({', '.join(ATTENTION_TARGETS)})")
    for target in targets:
        inputs, outputs = (math.prod(dims) for dims in model_cfg.projection_shapes()[target])
        if cfg.lora_rank > min(inputs, outputs):
            raise UserError(f"--lora-rank {cfg.lora_rank} is more than {target}'s smaller side ({inputs} -> {outputs} "
                            f"in {cfg.model_name}); give at most {min(inputs, outputs)}")
    if cfg.redundant_experts:
        raise UserError("--redundant-experts and --lora-rank: expert copies move trained experts between devices; "
                        "a LoRA run's experts are frozen")


def check_empty_layers(cfg: TrainConfig, pp: int, needed: int = 0) -> None:
    """Empty layers only even out pipeline stages: a new run would carry more than the
    stages need (`needed`: spmd.parallel.layout.Layout.empty_layers_needed) for nothing.
    (A resumed run keeps those its checkpoint holds, on any mesh; a model served from one
    skips them.)"""
    if cfg.empty_layers and pp == 1:
        raise UserError(f"--empty-layers {cfg.empty_layers} evens out pipeline stages, and the mesh has none (pp=1): "
                        "give a mesh with pp (e.g. --mesh pp=2), or no --empty-layers")
    if cfg.empty_layers > needed:
        raise UserError(f"--empty-layers {cfg.empty_layers} is more than the pp={pp} stages need to even out; give "
                        + (f"--empty-layers {needed}" if needed else "no --empty-layers: the layers divide without"))


def _validate_pipeline(cfg: TrainConfig) -> None:
    if cfg.pp_schedule in REPEATED_SCHEDULES and cfg.pp_repeats < 2:
        # (interleaved-1f1b with one chunk per stage is 1f1b: asked for by its name)
        raise UserError(f"--pp-schedule {cfg.pp_schedule} needs --pp-repeats 2 or more (chunks of layers per stage)"
                        + ("; with one chunk it is --pp-schedule 1f1b" if cfg.pp_schedule != "circular" else ""))
    if cfg.pp_schedule not in REPEATED_SCHEDULES and cfg.pp_repeats != 1:
        raise UserError(f"--pp-repeats applies to --pp-schedule {' and '.join(REPEATED_SCHEDULES)}, not {cfg.pp_schedule}")
