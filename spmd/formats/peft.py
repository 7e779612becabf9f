"""PEFT LoRA adapter directories in and out: `adapter_config.json` and
`adapter_model.safetensors`, as `peft` saves them and as transformers, vLLM and TGI load them.

An adapter's tensors are named after the projections they adapt, under PEFT's prefix:
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` (rank, inputs) and
`...lora_B.weight` (outputs, rank) (models.llama.hf.adapter_tensors). Reading checks the
config against the kinds of adapter spmd computes exactly (LoRA, no DoRA, no biases, one
rank and alpha for every projection), then the file's tensors against the base model's
shapes, before anything is placed on the devices.
"""

from __future__ import annotations

import json
from pathlib import Path

from flax import traverse_util

from models import adapter_tensors
from models.lora import MAX_ALPHA, TARGETS, LoRA
from spmd.base.errors import UserError, file_kind
from spmd.base.schema import (ANY, BOOLEAN, INTEGER, MAPPING, NUMBER, REGULAR, STRING, Bounds, Field, Invalid, check,
                              list_of, not_a_file, read_json)
from spmd.formats.hf import TensorFiles, gathered, what_directory
from spmd.formats.safetensors import Writer

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# What adapter_config.json must say for spmd to compute the adapter exactly; the fields not
# named here (task_type, inference_mode, revision, ...) change nothing it computes.
FIELDS = (
    Field("peft_type", STRING, choices=("LORA",)),
    Field("r", INTEGER, Bounds(above=0)),
    Field("lora_alpha", NUMBER, Bounds(above=0, at_most=MAX_ALPHA)),
    Field("target_modules", list_of(STRING, "module names")),
    Field("base_model_name_or_path", STRING, default=None, nullable=True),
    Field("lora_dropout", NUMBER, Bounds(at_least=0, below=1), default=0.0),
    Field("bias", STRING, choices=("none",), default="none"),
    Field("use_rslora", BOOLEAN, choices=(False,), default=False),
    Field("use_dora", BOOLEAN, choices=(False,), default=False),
    Field("lora_bias", BOOLEAN, choices=(False,), default=False),
    Field("fan_in_fan_out", BOOLEAN, choices=(False,), default=False),
    Field("rank_pattern", MAPPING, choices=({},), default={}, nullable=True),
    Field("alpha_pattern", MAPPING, choices=({},), default={}, nullable=True),
    Field("use_qalora", BOOLEAN, choices=(False,), default=False),
    # Variants that change what is computed (an adapter on other modules, layers or
    # parameters, activated by tokens, ...): only their "off".
    *(Field(name, ANY, choices=(None,), default=None) for name in (
        "modules_to_save", "layers_to_transform", "layer_replication", "target_parameters", "trainable_token_indices",
        "exclude_modules", "alora_invocation_tokens", "arrow_config", "use_bdlora", "kasa_config", "velora_config",
        "monteclora_config")),
)


def read_adapter_config(directory: str, what: str = "--adapter") -> tuple[LoRA, dict]:
    """The LoRA of a PEFT adapter directory's adapter_config.json (checked), and its values."""
    where = what_directory(directory, what)
    path = Path(directory) / CONFIG
    if file_kind(path) == "missing":
        raise UserError(f"{where} has no {CONFIG} (give a PEFT adapter directory)")
    try:
        values = check(read_json(path, MAX_CONFIG_BYTES), FIELDS, others=None)
    except Invalid as exc:
        raise UserError(f"{where}: {CONFIG} {exc}") from None
    targets = values["target_modules"]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        why = f"{unknown[0]!r} is not a projection spmd adapts" if unknown else "must name each projection once"
        raise UserError(f"{where}: {CONFIG} target_modules: {why} ({', '.join(TARGETS)})")
    ordered = tuple(t for t in TARGETS if t in targets)
    return LoRA(values["r"], float(values["lora_alpha"]), ordered), values


class AdapterFiles(TensorFiles):
    """A PEFT adapter directory for a base model (`model_cfg`) and `lora`, checked whole:
    its file holds exactly the adapter's tensors, each of the shape the base model makes it."""

    single = WEIGHTS
    described_by = f"the adapter of {CONFIG}"

    def __init__(self, directory: str | Path, model_cfg, lora: LoRA, what: str = "--adapter",
                 base: str = "the base model"):
        self.path, self.what, self.files = Path(directory), f"{what} {directory}", {}
        self.shaped_by = base
        kind = file_kind(self.path / WEIGHTS)
        if kind != REGULAR:
            raise UserError(f"{self.what} has no {WEIGHTS}" if kind == "missing" else
                            f"{self.what}: {WEIGHTS} {not_a_file(kind)}")
        held = dict.fromkeys(self._open(WEIGHTS, "the adapter").names(), WEIGHTS)
        self.tensors = adapter_tensors(model_cfg, lora.targets, lora.rank)
        self.where = self._locate(held, {})
        self._check_shapes()


def write_peft(out: Path, adapters: dict, model_cfg, lora: LoRA, base: str | None, dtype: str = "float32",
               dropout: float = 0.0) -> list[str]:
    """Write `adapters` (a LoRA run's trained parameters, on any mesh) as a PEFT adapter
    directory in `out`, for the base model `base` (a path or hub name, as PEFT records it);
    `dropout`: the run's, recorded as PEFT does (it applies in training only).
    -> the files written"""
    flat = traverse_util.flatten_dict(adapters)
    order = [(t, i) for t in adapter_tensors(model_cfg, lora.targets, lora.rank) for i in range(t.stacked or 1)]
    writer = Writer(out / WEIGHTS, [(name, shape) for t, i in order for name, shape in zip(t.names(i), t.shapes)],
                    dtype)
    for t, i in order:
        for name, array in zip(t.names(i), t.to_hf(gathered(flat[t.ours], i if t.stacked else None))):
            writer.write(name, array)
    writer.close()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": dropout, "target_modules": list(lora.targets), "bias": "none",
              "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
              "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [WEIGHTS, CONFIG]
