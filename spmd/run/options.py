"""The run's options, by section: what each part of the trainer reads.

`TrainConfig` holds one frozen dataclass per section (model, training, optimizer,
parallelism, moe, lora, data, checkpoint, logging, processes), as torchtitan's job config
groups them; each part of the trainer is handed the sections it reads (the step's parts get
`TrainConfig.step`: model, training, optimizer, parallelism, moe and LoRA), never the whole
set. Users
see the options flat: `--lr` on the command line, `lr:` or `optimizer: {lr: ...}` in YAML;
`TrainConfig.of(lr=...)` and `.replace(lr=...)` take the same flat names. A field's option
name is its own, but where the section's name would repeat it (`--model`'s preset, `--data`'s
path).
"""

from __future__ import annotations

import dataclasses
import functools
import re

from models.fp8 import RECIPES as FP8_RECIPES
from models.lora import MAX_ALPHA
from spmd.base.cli import DATA_FLAGS, DTYPES, SEED, SEQ, TOKENS_PER_STEP, parse_integer, shown
from spmd.base.errors import UserError
from spmd.base.schema import Bounds
from spmd.parallel.mesh import MeshSpec
from spmd.parallel.options import StepOptions
from spmd.parallel.pipeline import PP_SCHEDULES
from spmd.parallel.skeleton import REMAT, model_config
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


def _field(default, help: str, at_least=None, above=None, at_most=None, below=None, option=None, **argparse_kwargs):
    bounds = Bounds(at_least, above, at_most, below)
    named = {"option": option} if option else {}
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds, **named, **argparse_kwargs})


def _data_field(name: str):
    """A field defined by spmd.base.cli.DATA_FLAGS, as spmd.corpus and spmd.eval take it too."""
    flag, b = DATA_FLAGS[name], DATA_FLAGS[name].bounds
    return _field(flag.default, flag.help, b.at_least, b.above, b.at_most, b.below,
                  **({"choices": flag.choices} if flag.choices else {}))


def _not_a_flag(default):
    return dataclasses.field(default=default, metadata={"cli": False, "bounds": Bounds()})


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    preset: str | None = _field(None, "model preset (see models.PRESETS; default: tiny, or the model of --init-from, or that of the checkpoint --resume names)", option="model")
    init_from: str | None = _field(None, "start from the weights of a Hugging Face model directory (config.json and safetensors: Llama, Mixtral); the model is the directory's, and its tokenizer.json tokenizes --data")
    layers: int | None = _field(None, "number of layers (default: the preset's)", at_least=1, at_most=MODEL_SIZE)
    empty_layers: int = _field(0, "identity layers after the stacked ones, so that pipeline stages of equal depth hold a depth that does not divide (DeepSeek-V3's 58 MoE layers as 16 x 2 chunks of 2: 6); stages run them (their compute and memory), a step without stages skips them; never trained or exported", at_least=0, at_most=MODEL_SIZE)
    dtype: str = _field("float32", "compute dtype (master weights stay float32)", choices=DTYPES)
    fp8: str | None = _field(None, "FP8 matmuls (forward and backward) for the linear layers inside the blocks, never the embedding, head, router, norms or attention core: tensorwise (a scale per tensor, gradients in E5M2), rowwise (a scale per row, E4M3), blockwise (DeepSeek-V3's 1x128 tiles and 128x128 weight blocks, E4M3); docs/fp8.md", choices=tuple(FP8_RECIPES))
    remat: str = _field("none", "activation checkpointing of each block: none keeps every matmul output, dots those without batch dimensions, full only the block's input; DeepSeek-V3's mla is none but for latent attention's up-projections, made again from their latents", choices=REMAT)
    attention_kernel: str = _field("auto", "attention's kernel: auto (cudnn on NVIDIA GPUs, splash on TPU, chunked elsewhere), xla (scores materialized), cudnn (fused flash attention), splash (Pallas, TPU), chunked (flash-style in plain JAX: memory linear in the sequence)", choices=ATTENTION_KERNELS)
    mtp_depth: int = _field(0, "DeepSeek-V3: multi-token prediction modules after the model (the report's D; DeepSeek trained 1), the k-th predicting the token k + 1 beyond the next; trained with the main loss, left out of exported models", at_least=0, at_most=MODEL_SIZE)
    mtp_weight: float = _field(0.3, "multi-token prediction: the weight of its loss, the mean over its depths (the report's λ)", at_least=0, at_most=LOSS_WEIGHT)
    mtp_weight_later: str | None = _field(None, "multi-token prediction: STEP:WEIGHT, its weight from that optimizer step on (DeepSeek-V3: 0.3, then 0.1 for its last 4.8T of 14.8T tokens)")
    # Not a flag: the model config when it is no preset (--init-from's config.json, or a
    # resumed checkpoint's); saved with the run, so the run can be resumed and exported.
    architecture: object = _not_a_flag(None)

    @property
    def name(self) -> str:
        """The model as the run's messages name it."""
        if self.preset:
            return self.preset
        if self.init_from:
            return f"{self.init_from} (Hugging Face)"
        return "imported" if self.architecture is not None else "tiny"

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


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    steps: int = _field(300, "optimizer steps to run", at_least=0, at_most=STEPS)
    batch: int = _field(32, "global batch size, in sequences", at_least=1, at_most=TOKENS_PER_STEP)
    seq: int = _field(64, "sequence length, in tokens", SEQ.at_least, at_most=SEQ.at_most)
    seed: int = _field(0, "seed of the initial parameters and of the data order", SEED.at_least, at_most=SEED.at_most)
    grad_accum: int = _field(1, "microbatches per step, accumulated in a scan with one gradient reduction", at_least=1,
                             at_most=TOKENS_PER_STEP)
    on_nan: str = _field("stop", "on a non-finite loss, drop that update, then stop (naming the last good checkpoint) or skip and go on", choices=ON_NAN)

    @property
    def microbatch(self) -> int:
        return self.batch // self.grad_accum


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
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


@dataclasses.dataclass(frozen=True)
class ParallelismOptions:
    mesh: str | None = _field(None, "mesh axis sizes, e.g. dp=4,tp=8 (axes pp,dp,fsdp,ep,sp,tp; unnamed = 1; -1 = the remaining devices); none: every device found, laid out by spmd.parallel.defaults: dp=2,fsdp=2,tp=2 on 8 (as many emulated on a CPU-only host set up with none), fsdp over any other number")
    dcn: str | None = _field(None, "the part of the mesh that spans processes or slices over the data-center network, e.g. dp=2 (each named axis's factor; the rest of the mesh stays within a host or slice)")
    cpu_devices: int | None = _field(None, "number of emulated CPU devices (default: what the mesh needs)", at_least=1)
    zero: int = _field(0, "ZeRO stage over dp (and ep, for every weight but the experts): 0 replicas, 1 optimizer state, 2 + gradients, 3 + parameters", choices=(0, 1, 2, 3))
    megatron_sp: bool = _field(False, "Megatron sequence parallelism: norms and residuals split along the sequence over tp too")
    attention: str = _field("ring", "attention across the sp axis: K/V blocks passed around a ring, or all-gathered", choices=ATTENTION)
    pp_schedule: str = _field("gpipe", "pipeline schedule over the pp axis (gpipe, circular with --pp-repeats chunks per stage, 1f1b, interleaved-1f1b: 1f1b on circular's chunks, zb-v: zero bubble, 2 chunks per stage in a V, dualpipe: DeepSeek's two directions, 2 stages per device)", choices=PP_SCHEDULES)
    pp_repeats: int = _field(1, "circular and interleaved-1f1b schedules: chunks of layers per pipeline stage (v)", at_least=1, at_most=MODEL_SIZE)
    microbatches: int | None = _field(None, "pipeline microbatches per step (default: pp; a multiple of pp)", at_least=1,
                                      at_most=TOKENS_PER_STEP)
    hardware: str | None = _field(None, "accelerator the layout is planned for (spmd/base/hardware.toml; default: the one found, if listed)")
    ignore_fit: bool = _field(False, "train even when the plan says the step does not fit the devices' memory")

    @functools.cached_property
    def mesh_spec(self) -> MeshSpec:
        """`mesh` and `dcn`, parsed (spmd.parallel.mesh.MeshSpec): the one place the strings are read."""
        return MeshSpec.parse(self.mesh, self.dcn)


@dataclasses.dataclass(frozen=True)
class MoEOptions:
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
    # Not a flag: a model served from a checkpoint trained with --router-bias-rate keeps the
    # learned selection bias as one of its weights (spmd.run.weights).
    router_bias_weight: bool = _not_a_flag(False)


@dataclasses.dataclass(frozen=True)
class LoRAOptions:
    lora_rank: int | None = _field(None, "train low-rank adapters (LoRA, as PEFT defines them) of this rank on --lora-targets, the base weights frozen (default: a full fine-tune)", at_least=1, at_most=MODEL_SIZE)
    lora_alpha: float = _field(8.0, "LoRA: the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)", above=0,
                               at_most=MAX_ALPHA)
    lora_targets: str = _field("q_proj,k_proj,v_proj,o_proj", "LoRA: the projections adapted, in Hugging Face names (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    lora_dropout: float = _field(0.0, "LoRA: the probability of dropping each element of an adapter's input, in training (PEFT's lora_dropout)", at_least=0, below=1)
    base_dtype: str = _field("float32", "LoRA: the dtype the frozen base weights are stored in", choices=DTYPES)
    adapter: str | None = _field(None, "LoRA: start from a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) on --init-from's model")


@dataclasses.dataclass(frozen=True)
class DataOptions:
    path: str | None = _field(None, "local training data: a text file or folder (.txt/.md, .jsonl, .parquet), fine-tuning records (JSONL, Parquet or a datasets folder of prompt/completion or chat messages), or token files (.npy, .bin); default: the built-in synthetic chain", option="data")
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


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    out: str | None = _field(None, "directory for checkpoints; a run resumes from its latest checkpoint there")
    save_every: int = _field(0, "save a checkpoint every N steps (0: only at the end); needs --out", at_least=0,
                            at_most=STEPS)
    keep: int = _field(3, "checkpoints to keep in --out", at_least=1, at_most=STEPS)
    resume: str | None = _field(None, "resume from this run directory's latest checkpoint, or from one step's directory")
    resume_with_changes: bool = _field(False, "resume although --steps, --batch, --seq, --seed or the learning-rate schedule differ from the checkpoint's run")


@dataclasses.dataclass(frozen=True)
class LoggingOptions:
    log_every: int = _field(10, "print a log line every N steps (metrics are fetched from devices only then)", at_least=1,
                           at_most=STEPS)
    metrics_file: str | None = _field(None, "write one JSON object per step to this .jsonl file (a resumed run keeps the records before its checkpoint)")
    tensorboard: str | None = _field(None, "also write every metric as TensorBoard scalars into this directory (process 0)")
    profile_steps: str | None = _field(None, "capture a profiler trace of steps A to B (A:B, numbered as in the log line, both included)")
    profile_dir: str = _field("profile", "directory of the --profile-steps trace (TensorBoard's profile plugin, xprof, Perfetto)")

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
        return first, last


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
    coordinator: str | None = _field(None, "several processes: process 0's host:port, or 'auto' to let JAX find the cluster (TPU pod, SLURM, Open MPI); default: from the environment, else one process")
    num_processes: int | None = _field(None, "several processes: how many", at_least=1, at_most=MAX_PROCESSES)
    process_id: int | None = _field(None, "several processes: this one's index, 0 to N-1", at_least=0,
                                    at_most=MAX_PROCESSES - 1)
    join_timeout: int = _field(300, "several processes: seconds to wait for all of them to join the run before giving up", at_least=1, at_most=WAIT_S)
    heartbeat_timeout: int = _field(100, "several processes: seconds without a heartbeat before the others give up on a process", at_least=1, at_most=WAIT_S)
    step_timeout: float = _field(300.0, "seconds the host waits for a step before deciding a process died or hangs, and exiting with an error", above=0, at_most=WAIT_S)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The run's options, one object per section."""

    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    training: TrainingOptions = dataclasses.field(default_factory=TrainingOptions)
    optimizer: OptimizerOptions = dataclasses.field(default_factory=OptimizerOptions)
    parallelism: ParallelismOptions = dataclasses.field(default_factory=ParallelismOptions)
    moe: MoEOptions = dataclasses.field(default_factory=MoEOptions)
    lora: LoRAOptions = dataclasses.field(default_factory=LoRAOptions)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    logging: LoggingOptions = dataclasses.field(default_factory=LoggingOptions)
    processes: ProcessOptions = dataclasses.field(default_factory=ProcessOptions)

    @classmethod
    def of(cls, **options) -> TrainConfig:
        """The options given by their flat names (`lr=3e-4`, `model="tiny"`), the rest defaults."""
        return cls().replace(**options)

    def replace(self, **options) -> TrainConfig:
        """A copy with the options given by their flat names changed."""
        by_section: dict[str, dict[str, object]] = {}
        for option, value in options.items():
            if option not in OPTIONS:
                raise TypeError(f"no option named {option!r}")
            section, name = OPTIONS[option]
            by_section.setdefault(section, {})[name] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)
                                            for section, values in by_section.items()})

    def record(self) -> dict[str, object]:
        """Every option by its flat name, as a checkpoint records the run's (a model config
        as a dict)."""
        def recorded(value):
            return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return {option: recorded(getattr(getattr(self, section), name)) for option, (section, name) in OPTIONS.items()}

    @functools.cached_property
    def model_cfg(self):
        """The model this run builds (spmd.parallel.skeleton.model_config): resolved once, here;
        the parts of the run read it from `step`, or from the skeleton built of it."""
        return model_config(self.model, self.moe)

    @functools.cached_property
    def step(self) -> StepOptions:
        """What a training step is built from: the sections the step's parts read (layout,
        checks, program, optimizer, planner) and the model config."""
        return StepOptions(self.model, self.training, self.optimizer, self.parallelism, self.moe, self.lora,
                           self.model_cfg)


def section_fields(cls) -> list[tuple[str, dataclasses.Field]]:
    """The fields of `cls` (TrainConfig or a section) with their option names."""
    return [(f.metadata.get("option", f.name), f) for f in dataclasses.fields(cls)]


# Each option's (section, field) by its flat name: `lr` is ("optimizer", "lr"), `model` ("model", "preset").
OPTIONS: dict[str, tuple[str, str]] = {
    option: (section.name, f.name)
    for section in dataclasses.fields(TrainConfig)
    for option, f in section_fields(section.default_factory)
}
