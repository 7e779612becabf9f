"""`python -m spmd.train`: train a model on a named device mesh.

The loop does not wait for the step it just dispatched: metrics stay on the devices and
are fetched together every `--log-every` steps, and the host only ever waits for a step
that is already `spmd.loop.MAX_STEPS_IN_FLIGHT` behind (or for a checkpoint's copy off the
devices).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from spmd import xla_flags
from spmd.config import TrainConfig, find_config, model_config, parse_args
from spmd.distributed import initialize, processes
from spmd.errors import EXIT_OUTPUT_FAILED, OutputFailed, UserError, first_line, one_line_errors, quiet_library_threads
from spmd.mesh import emulate_cpu_devices
from spmd.paths import LOCK_NAME, DirectoryLock, Output, claim
from spmd.signals import serve as serve_signals
from spmd.signals import served

EXIT_NON_FINITE = 1
EXIT_PEER_FAILED = 4


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_signals()  # first: every thread started from here on leaves SIGINT/SIGTERM to it
    quiet_library_threads()
    with one_line_errors():
        cfg = parse_args(argv)
        check_outputs(cfg, find_config(argv))
        procs = processes(cfg)
        from spmd.checks import check_before_devices

        check_before_devices(cfg, procs.count)
        # Before JAX starts its backend, which reads them (spmd.xla_flags).
        flag_lines = xla_flags.configure(xla_flags.backend_before_start(), model_config(cfg), cfg.dtype)
        emulate_cpu_devices(cfg.mesh_spec.sizes, cfg.cpu_devices, procs.count)
    with one_line_errors(hold_stderr=False):  # a native abort while joining must still show its message
        initialize(procs, cfg.heartbeat_timeout, cfg.join_timeout)
    with one_line_errors():
        import jax

        from spmd.layout import make_layout

        layout = make_layout(cfg)
        from spmd.report import emit

        log = emit if jax.process_index() == 0 else _silent
        for line in flag_lines:
            log(line)
        run = prepare(cfg, layout, log=log)
    try:
        return 0 if run.loop().ok else EXIT_NON_FINITE
    except OutputFailed as exc:
        # Exit at once: Orbax's threads may still hold the failed save, and waiting for them can hang.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_OUTPUT_FAILED)
    except Exception as exc:
        if jax.process_count() == 1:
            raise
        # A collective failed: most likely another process died. Exit now, without the
        # shutdown barrier, which would wait for the dead process until its heartbeat times out.
        print(f"error: process {jax.process_index()} of {jax.process_count()} stops: {first_line(exc)} "
              f"(did another process die? see its log)", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)


def check_outputs(cfg: TrainConfig, config_file: str | None = None) -> None:
    """Before anything runs: each output can be written, none is an input (a metrics
    file equal to --data would overwrite the training data), and none is another's."""
    from spmd.checkpoint import locate

    resumed_run = str(locate(cfg.resume)[0]) if cfg.resume else None
    out = Path(cfg.out).resolve() if cfg.out else None
    writes_on = bool(out and resumed_run) and out == Path(resumed_run).resolve()
    metrics_in_out = bool(out and cfg.metrics_file) and Path(cfg.metrics_file).resolve().parent == out
    if metrics_in_out and Path(cfg.metrics_file).name == LOCK_NAME:
        raise UserError(f"--metrics-file {cfg.metrics_file} is the lock file of --out {cfg.out}; choose another name")
    claim(
        [Output("--out", cfg.out, directory=True, holds="checkpoints"),
         # Written beside the checkpoints when it sits in --out, made with it.
         Output("--metrics-file", cfg.metrics_file, parents=metrics_in_out, reopened=True),
         Output("--tensorboard", cfg.tensorboard, directory=True),
         Output("--profile-dir", cfg.profile_dir if cfg.profile_steps else None, directory=True)],
        {"--data": cfg.data, "--tokenizer": cfg.tokenizer, "--config": config_file, "--resume": resumed_run,
         "--init-from": cfg.init_from},
        # A run may write on into the directory it resumes (the metrics file with it); a
        # trace may go with the scalars (TensorBoard's layout: DIR/plugins/profile).
        allowed={("--profile-dir", "--tensorboard"), *([("--out", "--resume"), ("--metrics-file", "--resume")]
                                                        if writes_on else []),
                 *([("--metrics-file", "--out")] if metrics_in_out else [])})
    if cfg.out:
        DirectoryLock(cfg.out).check()


def _silent(line: str) -> None:
    """The log of processes other than 0: process 0 speaks for the run."""


def train(cfg: TrainConfig, layout, log=print) -> tuple[list[dict], dict]:
    """Run `cfg.steps` steps (resuming if a checkpoint says so); returns the records and final state."""
    run = prepare(cfg, layout, log)
    result = run.loop()
    return result.records, result.state


def prepare(cfg: TrainConfig, layout, log=print):
    """Everything before the first step: build, restore or initialize, compile.

    All checks of the user's input (checkpoints included) happen here, before anything
    is written.
    """
    import jax

    from spmd.checkpoint import Checkpoints, finalized_steps
    from spmd.data import make_source
    from spmd.loop import Run
    from spmd.plan import default_hardware, make_plan
    from spmd.step import build_program

    program = build_program(cfg, layout)
    started = time.perf_counter()
    data = make_source(cfg, layout.skeleton.model_cfg.vocab)
    # One run per directory: taken before --out is read, so that a second run is refused
    # before it looks at checkpoints the first is writing. One lock per run: process 0's.
    lock = DirectoryLock(cfg.out) if cfg.out and jax.process_index() == 0 else None
    if lock:
        lock.take()
    source_dir, step, meta = _resume_source(cfg, program)
    step_fn = program.compile_step()
    # What each device holds and what crosses the wire, read from the compiled step.
    plan = make_plan(cfg, layout, compiled=step_fn, program=program,
                     hardware=default_hardware(cfg, list(layout.mesh.devices.flat)))
    if not cfg.ignore_fit:
        check_fit(plan)
    if source_dir is not None:
        source = Checkpoints(source_dir, keep=cfg.keep)
        try:
            state = _restore(source, step, meta, program)
        finally:
            source.close()
        log(f"resumed from {source_dir / str(step)} (written on mesh {meta['config']['mesh']})")
        later = [s for s in finalized_steps(source_dir) if s > step]
        if later and cfg.out and Path(cfg.out).resolve() == source_dir.resolve():
            log(f"the later checkpoints of {source_dir} ({', '.join(map(str, later))}) are replaced as this run "
                "reaches their steps")
    elif cfg.init_from:
        from spmd.hf import Directory, load_params

        state = program.start(load_params(Directory(cfg.init_from), layout))
        log(f"started from {cfg.init_from}")
    else:
        with jax.set_mesh(layout.mesh):
            state = program.init(jax.random.key(cfg.seed))
    eval_fn = program.compile_eval() if cfg.eval_every else None
    out = None
    if lock:
        lock.hold()
        if served():
            served().cleanups.append(lock.release)
    if cfg.out:
        out = Checkpoints(cfg.out, keep=cfg.keep)
    setup_s = time.perf_counter() - started
    return Run(cfg, layout, plan, step_fn, state, step, out, setup_s, data, eval_fn,
               skipped=meta.get("skipped_updates", 0), log=log, lock=lock, resumed=source_dir is not None,
               rebalance=program.rebalance if program.copies else None)


def _restore(source, step: int, meta: dict, program) -> dict:
    """The checkpoint's state for `program`. A run that turns bias balancing on resumes a
    checkpoint without router state: its router starts as a fresh model's."""
    import jax

    from spmd.balance import initial
    from spmd.checkpoint import keeps_router

    abstract, layout = program.abstract_state, program.layout
    if "routing" in abstract and not keeps_router(meta.get("config", {})):
        state = source.restore(step, abstract, items=("params", "opt_state"), repeats=layout.repeats)
        sharding = jax.tree.map(lambda s: s.sharding, abstract["routing"])
        return state | {"routing": jax.device_put(initial(layout.skeleton.router_shapes), sharding)}
    return source.restore(step, abstract, repeats=layout.repeats)


def check_fit(plan) -> None:
    """Refuse a step that will not fit the memory of the devices that run it (emulated
    CPU devices share the host's), rather than run into an out-of-memory error. Their
    peak is XLA's for them; `--hardware` plans for other devices and decides nothing here."""
    from spmd.hardware import device_memory
    from spmd.report import human_bytes

    memory = device_memory(plan.layout.mesh.local_devices)
    peak = plan.xla["peak"] if plan.xla else sum(plan.theory_memory.values())
    if memory is not None and peak > memory[0]:
        raise UserError(f"the step needs {human_bytes(peak)} per device at its peak, more than the "
                        f"{human_bytes(memory[0])} of {memory[1]}; use more devices, a smaller --batch or --seq, "
                        "--grad-accum or --remat full (or --ignore-fit to try anyway)")


def _resume_source(cfg, program) -> tuple[Path | None, int, dict]:
    """Where to resume from (`--resume`, else `--out` if it holds checkpoints, else
    nowhere), checked against this run. -> (run directory, step, its meta)"""
    from spmd.checkpoint import check_compatible, check_resumable, finalized_steps, locate, read_meta

    source_dir, step = None, None
    if cfg.out and (foreign := _foreign_files(Path(cfg.out), cfg.metrics_file)):
        raise UserError(f"--out {cfg.out} holds files that are not spmd checkpoints ({foreign[0]}); "
                        "use a new or empty directory")
    if cfg.resume:
        source_dir, step = locate(cfg.resume)
    elif cfg.out and finalized_steps(Path(cfg.out)):
        source_dir = Path(cfg.out)
    if source_dir is None:
        return None, 0, {}
    if step is None:
        steps = finalized_steps(source_dir)
        if not steps:
            raise UserError(f"no spmd checkpoint in {source_dir}")
        step = steps[-1]
    meta = read_meta(source_dir, step)
    where = source_dir / str(step)
    check_compatible(meta, cfg, program.abstract_state["params"], where)
    check_resumable(meta, cfg, where)
    if step > cfg.steps:
        raise UserError(f"the checkpoint is at step {step}, beyond --steps {cfg.steps}")
    return source_dir, step, meta


def _foreign_files(out: Path, metrics_file: str | None) -> list[str]:
    """What in `--out` is not this run's: anything but checkpoints (whole, or Orbax's
    temporaries), the run's lock and its own metrics file."""
    if not out.is_dir():
        return []
    own = {LOCK_NAME} | ({Path(metrics_file).name} if metrics_file and
                         Path(metrics_file).resolve().parent == out.resolve() else set())
    return sorted(p.name for p in out.iterdir() if not (
        p.name in own or p.is_dir() and (p.name.isdigit() or ".orbax-checkpoint-tmp" in p.name)))


if __name__ == "__main__":
    sys.exit(main())
