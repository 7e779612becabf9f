"""Which model a run uses: a preset (--model), a Hugging Face directory's config.json
(--init-from), the model of the checkpoint --resume names, or the default preset; then the
run's options checked against that model."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from models import config_from_dict
from spmd.base.cli import flag_of
from spmd.base.errors import UserError
from spmd.formats.hf import Directory, tokenizer_of
from spmd.formats.peft import CONFIG as ADAPTER_CONFIG
from spmd.formats.peft import AdapterFiles, read_adapter_config
from spmd.run.config import TrainConfig, check, parse


def validate(cfg: TrainConfig) -> TrainConfig:
    """The options with their model found, every file it comes from read and checked, and
    every check that needs no devices passed."""
    return check(resolve_model(cfg))


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    return parse_with_extras(argv)[0]


def parse_with_extras(argv: Sequence[str] | None = None, prog: str = "python -m spmd.train",
                      description: str = "Train a model on a named device mesh.",
                      add_extras: Callable[[argparse.ArgumentParser], None] | None = None,
                      ) -> tuple[TrainConfig, argparse.Namespace]:
    """The run's validated options, plus the values of any flags `add_extras` adds (for
    other commands that take a run's options, like spmd.plan)."""
    cfg, ns = parse(list(sys.argv[1:] if argv is None else argv), prog, description, add_extras)
    return validate(cfg), ns


def with_adapter(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the LoRA of its --adapter's adapter_config.json (rank, alpha, targets)."""
    if not cfg.lora.adapter:
        return cfg
    lora, _ = read_adapter_config(cfg.lora.adapter)
    theirs = {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_targets": ",".join(lora.targets)}
    differ = [name for name, value in theirs.items() if getattr(cfg.lora, name) not in (DEFAULTS[name], value)]
    if differ:
        raise UserError(f"{flag_of(differ[0])} {getattr(cfg.lora, differ[0])} and --adapter: the adapter's rank, alpha "
                        f"and targets are those of its {ADAPTER_CONFIG} ({flag_of(differ[0])} {theirs[differ[0]]})")
    cfg = cfg.replace(**theirs)
    AdapterFiles(cfg.lora.adapter, cfg.model.architecture, lora,
                 base="--init-from's config.json")  # its tensors checked now
    return cfg


DEFAULTS = TrainConfig().record()


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its model: `architecture` read from --init-from's config.json or the
    checkpoint's record, or `model` the default preset."""
    if cfg.model.init_from:
        if cfg.model.preset:
            raise UserError("--model and --init-from: the model is the one in --init-from's config.json; give one")
        if cfg.checkpoint.resume:
            raise UserError("--init-from and --resume: a run starts from a Hugging Face directory or resumes "
                            "a checkpoint; give one (a run with --out resumes from --out by itself)")
        for name in ("layers", "experts", "top_k"):
            if cfg.record()[name] is not None:
                raise UserError(f"{flag_of(name)} and --init-from: the model's shape is --init-from's config.json")
        read = Directory(cfg.model.init_from).cfg  # every file checked, before anything is allocated
        tokenizer = cfg.data.tokenizer or (
            tokenizer_of(cfg.model.init_from) if cfg.data.path else None)  # the checkpoint's
        return with_adapter(cfg.replace(architecture=read, tokenizer=tokenizer))
    if isinstance(cfg.model.architecture, dict):  # a saved run's
        return cfg.replace(architecture=config_from_dict(cfg.model.architecture))
    if cfg.model.architecture is None and cfg.model.preset is None:
        if cfg.checkpoint.resume:
            # Imported here for start-up time: Orbax takes 0.3 s to import, and only a resume reads a checkpoint.
            from spmd.formats.checkpoint import model_of_checkpoint

            model, architecture = model_of_checkpoint(cfg.checkpoint.resume)
            return cfg.replace(model=model, architecture=architecture and config_from_dict(architecture))
        return cfg.replace(model="tiny")
    return cfg
