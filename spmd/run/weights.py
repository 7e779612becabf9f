"""One way to stand a model's parameters up on a mesh, shared by export, generate and eval:
from a run's checkpoint (read straight into the layout's shardings, no optimizer state) or
from a Hugging Face directory (spmd.formats.hf).

    cfg, checkpoint = checkpoint_config("runs/a", step=None)   # before JAX starts
    layout = make_layout(cfg.replace(mesh=...).step, for_training=False)
    params = restore_params(checkpoint, cfg, layout)
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax

from models import config_from_dict
from models.lora import joined
from spmd.base.errors import UserError
from spmd.data.tokenizer import tokenizer_inputs
from spmd.formats.checkpoint import (Checkpoints, check_compatible, finalized_steps, has_bias, keeps_router, locate,
                                     read_meta)
from spmd.formats.hf import Directory
from spmd.formats.hf import load_params as load_hf
from spmd.formats.peft import AdapterFiles
from spmd.parallel import balance
from spmd.parallel.rules import spec_for
from spmd.parallel.skeleton import is_names, skeleton_for
from spmd.parallel.step import initial_params
from spmd.run.options import OPTIONS, TrainConfig
from spmd.run.resolve import validate


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    run_dir: Path
    step: int
    meta: dict

    @property
    def where(self) -> Path:
        return self.run_dir / str(self.step)


def check_source_flags(step: int | None, cpu_devices: int | None) -> None:
    """The ranges of --step and --cpu-devices, which every command reading a checkpoint takes."""
    if step is not None and step < 0:
        raise UserError(f"--step must be at least 0, got {step}")
    if cpu_devices is not None and cpu_devices < 1:
        raise UserError(f"--cpu-devices must be positive, got {cpu_devices}")


def checkpoint_config(path: str, step: int | None = None, flag: str = "--checkpoint"):
    """The config of the run whose checkpoint `path` names (a run directory: its latest
    step, or `step`; or one step's directory), with the checkpoint found. Its model is
    the one saved with it, with no need of the directory it started from; the layers are
    read in the model's order, whatever pipeline wrote them. -> (config, Checkpoint)"""
    where = Path(path)
    if not where.exists():
        raise UserError(f"{flag} {path} does not exist")
    if not where.is_dir():
        raise UserError(f"{flag} {path} is a file, not a run's or a step's directory")
    run_dir, named = locate(where)
    if named is not None and step is not None and step != named:
        raise UserError(f"--step {step} disagrees with {flag} {path}, the checkpoint of step {named}; give the "
                        "run's directory with --step, or the step's directory alone")
    step = named if step is None else step
    steps = finalized_steps(run_dir)
    if not steps:
        raise UserError(f"{flag} {path}: no spmd checkpoint in {run_dir}")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UserError(f"--step {step}: no checkpoint of that step in {run_dir}; it has step(s) "
                        f"{', '.join(map(str, steps))}")
    meta = read_meta(run_dir, step)
    # Served as the model it trained: expert copies become one expert each, and a learned
    # selection bias one of its weights (restore_params).

    cfg = run_config(meta).replace(pp_schedule="gpipe", pp_repeats=1, microbatches=None,
                              redundant_experts=0, rebalance_every=None, router_bias_rate=0.0,
                              router_bias_weight=has_bias(meta.get("config", {})))
    return validate(cfg), Checkpoint(run_dir, step, meta)


def source_inputs(args, checkpoint: Checkpoint | None) -> dict:
    """What standing the model up reads, by flag, for spmd.base.paths.claim's inputs (the
    commands that take spmd.base.cli.add_model_source's flags): --init-from's directory (its
    tokenizer inside) and --adapter's; or the checkpoint's run, the directory it started
    from (a LoRA run's base is read from it again) and its tokenizer."""
    if checkpoint is None:
        return {"--init-from": args.init_from, "--adapter": args.adapter}
    config = checkpoint.meta.get("config", {})
    return {"--checkpoint": checkpoint.run_dir, "the run's --init-from": config.get("init_from"),
            **tokenizer_inputs(config.get("tokenizer"), "the run's tokenizer")}


def run_config(meta: dict):
    """The config of the run that wrote a checkpoint, without its inputs (data, the
    directory and adapter it started from, the checkpoint it resumed) and its host's
    share of data workers (bounded by the CPUs of the host it ran on, not this one's)."""
    config = {k: v for k, v in meta.get("config", {}).items() if k in OPTIONS}
    if isinstance(config.get("architecture"), dict):  # a model that is no preset, saved as data
        config["architecture"] = config_from_dict(config["architecture"])
    return TrainConfig.of(**config | {"init_from": None, "resume": None, "data": None, "tokenizer": None,
                                      "adapter": None, "data_workers": None})


def abstract_params(layout) -> dict:
    """The parameters' shapes and dtypes, carrying their shardings in `layout`."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        layout.skeleton.shapes, layout.shardings(layout.rules.params))


def restore_params(checkpoint: Checkpoint, cfg, layout) -> dict:
    """The checkpoint's parameters, read straight into `layout`'s shardings (checked against
    their checksums). A run that balanced its experts (spmd.parallel.balance) saved them in slots,
    with its router state: its copies are read whole, and each expert's first one kept;
    its selection bias becomes the served model's weight. A LoRA run saved its adapters:
    they come with the base it names (its --init-from, or its seed's initialization)."""
    abstract = abstract_params(layout)
    trained = run_config(checkpoint.meta)
    if layout.skeleton.lora:
        base = cfg.replace(init_from=checkpoint.meta["config"].get("init_from"), adapter=None)
        return joined(base_params(base, layout), _restored(checkpoint, cfg, layout.skeleton.trained(abstract)))
    saved = {"params": abstract}
    if keeps_router(trained.record()):
        saved = _as_trained(trained, layout)
    state = _restored(checkpoint, cfg, saved["params"], saved)
    if "routing" not in state:
        return state["params"]
    served = jax.jit(functools.partial(_served, trained, layout), out_shardings=jax.tree.map(lambda a: a.sharding, abstract))
    return served(state["params"], state["routing"])


def _restored(checkpoint: Checkpoint, cfg, params, saved: dict | None = None) -> dict:
    """The checkpoint's items `saved` (default: {"params": params}, returning the params),
    checked to hold `params`."""
    check_compatible(checkpoint.meta, cfg.record(), cfg.model.name, params, checkpoint.where)
    source = Checkpoints(checkpoint.run_dir)
    try:
        state = source.restore(checkpoint.step, saved or {"params": params})
    finally:
        source.close()
    return state if saved else state["params"]


def base_params(cfg, layout) -> dict:
    """The frozen base of a LoRA run on `layout`: --init-from's weights, or the model its
    --seed initializes (as the run's program draws it: the same base)."""
    if cfg.model.init_from:
        return layout.skeleton.frozen(load_hf(Directory(cfg.model.init_from), layout))
    with jax.set_mesh(layout.mesh):
        return layout.skeleton.frozen(initial_params(cfg.step, layout)(jax.random.key(cfg.training.seed)))


def _as_trained(trained, layout) -> dict:
    """The abstract parameters and router state of a run with a router state, on `layout`,
    the slots of its experts whole on every device (their number may not split over ep)."""
    skeleton = skeleton_for(trained.replace(router_bias_weight=False).step)
    names = jax.tree.map(lambda n: tuple(None if a == balance.EXPERTS else a for a in n), skeleton.names, is_leaf=is_names)
    sharded = lambda s, n: jax.ShapeDtypeStruct(  # noqa: E731
        s.shape, s.dtype, sharding=layout.named(spec_for(n, layout.rules.params)))
    return {"params": jax.tree.map(sharded, skeleton.shapes, names, is_leaf=lambda x: is_names(x) or hasattr(x, "shape")),
            "routing": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.replicated),
                                    skeleton.router_shapes)}


def _served(trained, layout, params: dict, router: dict) -> dict:
    """A trained run's params and router state -> the served model's params."""
    state = balance.states(router)[0]
    if trained.moe.redundant_experts:
        dims = balance.expert_dims(skeleton_for(trained.step).names)
        params = balance.first_copies(params, dims, state["placement"], layout.skeleton.model_cfg.moe.experts)
    moe = layout.skeleton.model_cfg.moe
    if not moe or not (trained.moe.router_bias_rate or moe.selection_bias):  # (DeepSeek's router has one, moved or not)
        return params
    return balance.with_bias(params, router)


def load_params(cfg, layout, checkpoint: Checkpoint | None) -> dict:
    """The parameters of `checkpoint`, or of `cfg.model.init_from` (a Hugging Face directory),
    with `cfg.lora.adapter`'s (a PEFT adapter directory) if given."""
    if checkpoint is not None:
        return restore_params(checkpoint, cfg, layout)
    params = load_hf(Directory(cfg.model.init_from), layout)
    if cfg.lora.adapter:
        skeleton = layout.skeleton
        params = joined(params, load_hf(AdapterFiles(cfg.lora.adapter, skeleton.model_cfg, skeleton.lora), layout))
    return params
