"""`python -m spmd.export`'s library: the checkpoint and `--out` checked, the checkpoint read
onto a mesh, what a Hugging Face directory of it holds beside the weights, and the export
written whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
from pathlib import Path

import jax

from models import hf_layout, model_class
from spmd.base.errors import EXIT_OUTPUT_FAILED, UserError, held_stderr, why_io_failed
from spmd.base.paths import Output, check_writable_dir, claim, regular_file, remove_stale_temporaries, temporary_name
from spmd.base.signals import served
from spmd.formats.hf import GENERATION_CONFIG, TOKENIZER_FILES, companions
from spmd.formats.peft import write_peft
from spmd.parallel.layout import make_layout
from spmd.parallel.skeleton import skeleton_for
from spmd.run.bootstrap import start_devices_and_mesh
from spmd.run.config import TrainConfig
from spmd.run.resolve import validate
from spmd.run.weights import Checkpoint, check_source_flags, checkpoint_config, load_params, source_inputs

# rmtree passes over a temporary a writer may still be filling (10 ms apart: up to ten
# seconds, for a loaded host); it is gone once two passes in a row find nothing.
REMOVE_TRIES = 1000


def restored(cfg, checkpoint: Checkpoint | None, mesh: str | None, cpu_devices: int | None):
    """The checkpoint's parameters (None: --init-from's with --adapter's) on `mesh` (None:
    the default layout of the devices found, spmd.parallel.defaults: what is written does
    not depend on it, so it goes unsaid), with the run's config for that mesh.
    -> (params, config)"""
    cfg = validate(cfg.replace(mesh=mesh))
    cfg, _ = start_devices_and_mesh(cfg, for_training=False, cpu_devices=cpu_devices)  # before Orbax starts JAX
    return load_params(cfg, make_layout(cfg.step, for_training=False), checkpoint), cfg


def merged(params: dict, cfg) -> dict:
    """The parameters of a LoRA run's model with its adapters merged into the weights (as
    PEFT's merge_and_unload); any other model's as they are."""
    skeleton = skeleton_for(cfg.step)
    if not skeleton.lora:
        return params
    model_cfg = skeleton.model_cfg
    return jax.jit(lambda p: model_class(model_cfg).merge_adapters(p, model_cfg, skeleton.lora))(params)


def write_adapter(out: Path, params: dict, cfg, base: str | None, dtype: str) -> list[str]:
    """A LoRA run's adapters as a PEFT adapter directory for the base model `base`."""
    skeleton = skeleton_for(cfg.step)
    return write_peft(out, skeleton.trained(params), skeleton.model_cfg, skeleton.lora, base, dtype,
                      cfg.lora.lora_dropout)


def hf_parts(cfg, meta: dict):
    """The model config of a checkpoint's run, checked to have a Hugging Face layout, and
    the tokenizer files to copy beside it: those of the run's tokenizer.json (its
    directory's tokenizer_config.json and special_tokens_map.json with it), else those
    of the directory the run started from."""
    model_cfg = cfg.model_cfg
    if cfg.moe.router_bias_weight and not model_cfg.moe.selection_bias:  # DeepSeek-V3's layout has one
        raise UserError(f"--format hf: model {cfg.model.name} was trained with --router-bias-rate, and its Hugging "
                        "Face layout has no selection bias; the default format keeps it")
    why_not = hf_layout(model_cfg).supported(model_cfg)
    if why_not:
        raise UserError(f"--format hf: model {cfg.model.name} has no Hugging Face layout ({why_not})")
    config = meta.get("config", {})
    init_from, tokenizer = config.get("init_from"), config.get("tokenizer")
    # Each file copied is checked first (a regular file holding JSON): one that is a
    # directory or damaged is refused, not skipped.
    started = companions(init_from, "the run's --init-from") if init_from else {}
    files = {name: path for name, path in started.items() if name == GENERATION_CONFIG or not tokenizer}
    if tokenizer and tokenizer.endswith(".json"):
        beside = companions(Path(tokenizer).parent, "the run's tokenizer directory")
        files |= {name: path for name, path in beside.items() if name in TOKENIZER_FILES}
        files["tokenizer.json"] = regular_file(tokenizer, "--format hf: the run's tokenizer")
    return model_cfg, files


def checked(args):
    """Everything that can be checked before reading the checkpoint: the flags' ranges,
    the checkpoint (its step and its run's config), and that `--out` can be written and
    is no input. `args`: spmd.export's flags. -> (out, the run's config, the checkpoint)"""
    check_source_flags(args.step, args.cpu_devices)
    if bool(args.checkpoint) == bool(args.init_from):
        raise UserError("give one of --checkpoint RUN and --init-from DIR --adapter ADAPTER")
    if args.init_from:
        if not args.adapter or args.format != "hf":
            raise UserError("--init-from exports a model with a PEFT adapter merged: give --adapter DIR and "
                            "--format hf")
        if args.step is not None:
            raise UserError("--step applies to --checkpoint")
        cfg, checkpoint = validate(TrainConfig.of(init_from=args.init_from, adapter=args.adapter)), None
    else:
        if args.adapter:
            raise UserError("--adapter applies to --init-from; a LoRA run's checkpoint holds its adapters")
        cfg, checkpoint = checkpoint_config(args.checkpoint, args.step)
    if args.format == "peft" and not cfg.lora.lora_rank:
        raise UserError(f"--format peft: {args.checkpoint} was trained without adapters (no --lora-rank); "
                        "export its model with --format hf")

    out = Path(args.out).resolve()
    claim([Output("--out", args.out, directory=True)], source_inputs(args, checkpoint))
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {args.out} is not empty; give a new or empty directory")
    if out.exists():  # the export is written beside it, then renamed over it
        try:
            check_writable_dir(str(out.parent), "--out")
        except UserError:
            raise UserError(f"--out {args.out}: its directory {out.parent} cannot be written (the export is "
                            "written there under a temporary name, then renamed)") from None
    return out, cfg, checkpoint


def write(out: Path, flag_value: str, produce) -> None:
    """Write the export (`produce(directory)`) to a temporary beside `out`, then rename it to `out`. A failure
    (disk full, permission lost) or a signal removes what was written, prints one line and exits:
    Orbax's threads may still hold the failed write, and waiting for them can hang."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # to remove if we fail
    tmp = temporary_name(out)

    def remove() -> None:
        # From the signal thread, the writer (and Orbax's threads) may still add files
        # while the tree goes, or make it again: again until it stays gone.
        gone = 0
        for _ in range(REMOVE_TRIES):
            shutil.rmtree(tmp, ignore_errors=True)
            gone = gone + 1 if not tmp.exists() else 0
            if gone == 2:
                break
            time.sleep(0.01)
        for directory in made:
            with contextlib.suppress(OSError):
                directory.rmdir()

    if served():  # SIGINT/SIGTERM/SIGUSR1 end the command from their own thread: the temporary goes with it
        served().cleanups.append(remove)
    with held_stderr() as stderr:
        try:
            remove_stale_temporaries(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            produce(tmp)
            os.replace(tmp, out)  # over an empty directory too
        except BaseException as exc:  # noqa: BLE001 - whatever the file system or Orbax raised
            if served() and served().stopping.is_set():  # a signal took the temporary: its thread says so and exits
                threading.Event().wait()
            remove()
            if isinstance(exc, KeyboardInterrupt):
                why, code = "interrupted", 130
            elif isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # filled meanwhile
                why, code = f"--out {flag_value} is no longer empty", EXIT_OUTPUT_FAILED
            else:
                why, code = f"writing --out {flag_value} failed ({why_io_failed(exc)})", EXIT_OUTPUT_FAILED
            os.write(stderr, f"error: {why}; nothing was written\n".encode())
            os._exit(code)
