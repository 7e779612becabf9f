"""What a training step is built from: the sections of the run's options (spmd.run.options)
that the step's parts read, and the model config resolved from them.

The layout and its checks, the program and the planner take this, never the whole option
set: the data's, checkpoint's, logging's and processes' sections are handed to their own
parts by spmd.run.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepOptions:
    model: object  # spmd.run.options.ModelOptions: preset, dtype, remat, attention kernel, MTP
    training: object  # TrainingOptions: steps, batch, seq, seed, grad_accum
    optimizer: object  # OptimizerOptions: AdamW and its schedule
    parallelism: object  # ParallelismOptions: mesh, zero, Megatron-SP, attention, pipeline
    moe: object  # MoEOptions: experts, dispatch, balancing
    lora: object  # LoRAOptions: rank, alpha, targets
    model_cfg: object  # the model config (models.LlamaConfig or a family's), resolved once


def step_options(options) -> StepOptions:
    """`options`, checked to be a step's (`TrainConfig.step`): the layout, the program and
    the planner are handed no more of the run's options than these sections."""
    if not isinstance(options, StepOptions):
        raise TypeError(f"takes a step's options (spmd.run.options.TrainConfig.step), not {type(options).__name__}")
    return options
