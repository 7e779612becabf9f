"""`python -m spmd.train`: train a model on a named device mesh (the trainer: spmd.run.trainer)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from spmd.base.console import emit
from spmd.base.errors import (EXIT_OUTPUT_FAILED, OutputFailed, UserError, first_line, one_line_errors,
                              quiet_library_threads)
from spmd.base.paths import LOCK_NAME, DirectoryLock, Output, claim
from spmd.base.signals import serve as serve_signals


def __getattr__(name: str):
    """`train` and `prepare`, this module's names for the Python API, imported on first use (see main)."""
    if name in ("train", "prepare"):
        from spmd.run import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


EXIT_NON_FINITE = 1
EXIT_PEER_FAILED = 4


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg == "--target" or arg.startswith("--target=") for arg in argv):
        # A compile-only dry run for an accelerator not at hand (as MaxText's train_compile.py):
        # the run's step compiled by that accelerator's compiler, and its plan; nothing is
        # trained or written.
        serve_signals("stopped; nothing was written")
        from spmd.run.target import dry_run

        return dry_run(argv, prog="python -m spmd.train")
    serve_signals()  # first: every thread started from here on leaves SIGINT/SIGTERM/SIGUSR1 to it
    quiet_library_threads()
    with one_line_errors():
        # The library is imported once signals are served (numpy starts threads when
        # imported), the trainer's only once the flags are read (bad ones answer sooner).
        from spmd.run.config import find_config
        from spmd.run.resolve import parse_args

        cfg = parse_args(argv)
        check_outputs(cfg, find_config(argv))
        import jax

        from spmd.parallel.layout import make_layout
        from spmd.run.bootstrap import start_devices, with_mesh
        from spmd.run.distributed import initialize, processes

        procs = processes(cfg)
        flag_lines = start_devices(cfg, procs)
    with one_line_errors(hold_stderr=False):  # a native abort while joining must still show its message
        initialize(procs, cfg.processes.heartbeat_timeout, cfg.processes.join_timeout)
    with one_line_errors():
        cfg, layout_line = with_mesh(cfg)  # (no --mesh: the default layout of the devices found)
        layout = make_layout(cfg.step)
        log = _first_saying(layout_line, emit) if jax.process_index() == 0 else _silent
        for line in flag_lines:
            log(line)
        from spmd.run.trainer import prepare  # Orbax and the planner, once the layout holds

        run = prepare(cfg, layout, log=log)
    try:
        return 0 if run.loop().ok else EXIT_NON_FINITE
    except OutputFailed as exc:
        # Exit at once: Orbax's threads may still hold the failed save, and waiting for them can hang.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_OUTPUT_FAILED)
    except UserError as exc:  # the data failed mid-run (a bad record, a data worker that died); the loop has saved
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # as one_line_errors does: the data's worker processes end with this one
    except Exception as exc:
        if jax.process_count() == 1:
            raise
        # A collective failed: most likely another process died. Exit now, without the
        # shutdown barrier, which would wait for the dead process until its heartbeat times out.
        print(f"error: process {jax.process_index()} of {jax.process_count()} stops: {first_line(exc)} "
              f"(did another process die? see its log)", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)


def check_outputs(cfg, config_file: str | None = None) -> None:
    """Before anything runs: each output can be written, none is an input (a metrics
    file equal to --data would overwrite the training data; see run_inputs), and none is
    another's."""
    from spmd.formats.checkpoint import locate  # (imported by main, after signals)

    resumed_run = str(locate(cfg.checkpoint.resume)[0]) if cfg.checkpoint.resume else None
    out = Path(cfg.checkpoint.out).resolve() if cfg.checkpoint.out else None
    writes_on = bool(out and resumed_run) and out == Path(resumed_run).resolve()
    metrics_in_out = bool(out and cfg.logging.metrics_file) and Path(cfg.logging.metrics_file).resolve().parent == out
    if metrics_in_out and Path(cfg.logging.metrics_file).name == LOCK_NAME:
        raise UserError(f"--metrics-file {cfg.logging.metrics_file} is the lock file of --out {cfg.checkpoint.out}; "
                        "choose another name")
    claim(
        [Output("--out", cfg.checkpoint.out, directory=True, holds="checkpoints"),
         # Written beside the checkpoints when it sits in --out, made with it.
         Output("--metrics-file", cfg.logging.metrics_file, parents=metrics_in_out, reopened=True),
         Output("--tensorboard", cfg.logging.tensorboard, directory=True),
         Output("--profile-dir", cfg.logging.profile_dir if cfg.logging.profile_steps else None, directory=True)],
        run_inputs(cfg, config_file, resumed_run),
        # A run may write on into the directory it resumes (the metrics file with it); a
        # trace may go with the scalars (TensorBoard's layout: DIR/plugins/profile).
        allowed={("--profile-dir", "--tensorboard"), *([("--out", "--resume"), ("--metrics-file", "--resume")]
                                                        if writes_on else []),
                 *([("--metrics-file", "--out")] if metrics_in_out else [])})
    if cfg.checkpoint.out:
        DirectoryLock(cfg.checkpoint.out).check()


def run_inputs(cfg, config_file: str | None, resumed_run: str | None) -> dict:
    """Every input of a run, by flag, for claim: the config file, the data, the directory
    it starts from and the adapter, the checkpoint it resumes (`resumed_run`'s directory)
    and the base a resumed LoRA run reads again, the tokenizer with its directory's files.
    (A tokenizer taken from --init-from is named after it: that name comes first.)"""
    from spmd.data.tokenizer import tokenizer_inputs  # (imported by main, after signals)

    return {"--config": config_file, "--data": cfg.data.path, "--init-from": cfg.model.init_from,
            "--adapter": cfg.lora.adapter, "--resume": resumed_run, "the resumed run's --init-from": _resumed_base(cfg),
            **tokenizer_inputs(cfg.data.tokenizer, "--tokenizer")}


def _resumed_base(cfg) -> str | None:
    """The directory whose weights a resumed LoRA run reads again as its frozen base when
    --init-from names none: the one its checkpoint started from (spmd.run.trainer)."""
    from spmd.formats.checkpoint import finalized_steps, saved_config  # (imported by main, after signals)

    resumed = cfg.checkpoint.resume or (
        cfg.checkpoint.out if cfg.checkpoint.out and finalized_steps(Path(cfg.checkpoint.out)) else None)
    if not cfg.lora.lora_rank or cfg.model.init_from or not resumed:
        return None
    return saved_config(resumed).get("init_from")


def _silent(line: str) -> None:
    """The log of processes other than 0: process 0 speaks for the run."""


def _first_saying(first: str | None, log):
    """`log`, saying `first` (if any) before its first line: the run's first line, yet none
    on a run refused before it says anything."""
    pending = [first] if first else []

    def say(line: str) -> None:
        while pending:
            log(pending.pop())
        log(line)
    return say


if __name__ == "__main__":
    sys.exit(main())
