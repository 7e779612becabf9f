"""`python -m spmd.export`'s library: a run's checkpoint read onto a mesh, and what a Hugging
Face directory of it holds beside the weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from models import hf_layout
from spmd.base.errors import UserError
from spmd.formats.hf import GENERATION_CONFIG, TOKENIZER_FILES, companions
from spmd.parallel.layout import make_layout
from spmd.parallel.skeleton import model_config
from spmd.run.bootstrap import start_devices
from spmd.run.resolve import validate
from spmd.run.weights import Checkpoint, restore_params


def restored(cfg, checkpoint: Checkpoint, mesh: str | None, cpu_devices: int | None):
    """The checkpoint's parameters on `mesh` (None: the mesh that wrote them), with the
    run's config for that mesh. -> (params, config)"""
    cfg = validate(dataclasses.replace(cfg, mesh=mesh or cfg.mesh))
    start_devices(cfg, cpu_devices=cpu_devices)  # before Orbax starts JAX
    return restore_params(checkpoint, cfg, make_layout(cfg, for_training=False)), cfg


def hf_parts(cfg, meta: dict):
    """The model config of a checkpoint's run, checked to have a Hugging Face layout, and
    the tokenizer files to copy beside it: those of the run's tokenizer.json (its
    directory's tokenizer_config.json and special_tokens_map.json with it), else those
    of the directory the run started from."""
    model_cfg = model_config(cfg)
    if cfg.router_bias_weight:
        raise UserError(f"--format hf: model {cfg.model_name} was trained with --router-bias-rate, and the Hugging "
                        "Face Mixtral layout has no selection bias; the default format keeps it")
    why_not = hf_layout(model_cfg).supported(model_cfg)
    if why_not:
        raise UserError(f"--format hf: model {cfg.model_name} has no Hugging Face layout ({why_not})")
    config = meta.get("config", {})
    init_from, tokenizer = config.get("init_from"), config.get("tokenizer")
    # Each file copied is checked first (a regular file holding JSON): one that is a
    # directory or damaged is refused, not skipped.
    started = companions(init_from, "the run's --init-from") if init_from else {}
    files = {name: path for name, path in started.items() if name == GENERATION_CONFIG or not tokenizer}
    if tokenizer and tokenizer.endswith(".json"):
        beside = companions(Path(tokenizer).parent, "the run's tokenizer directory")
        files |= {name: path for name, path in beside.items() if name in TOKENIZER_FILES}
        files["tokenizer.json"] = Path(tokenizer)
    return model_cfg, files
