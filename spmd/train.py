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

from spmd.config import TrainConfig, parse_args
from spmd.distributed import initialize, processes
from spmd.errors import UserError, first_line, one_line_errors
from spmd.mesh import emulate_cpu_devices, parse_mesh

EXIT_NON_FINITE = 1
EXIT_PEER_FAILED = 4


def main(argv: Sequence[str] | None = None) -> int:
    with one_line_errors():
        cfg = parse_args(argv)
        procs = processes(cfg)
        emulate_cpu_devices(parse_mesh(cfg.mesh), cfg.cpu_devices, procs.count)
        initialize(procs, cfg.heartbeat_timeout)
        import jax

        from spmd.layout import make_layout

        layout = make_layout(cfg)
        from spmd.report import emit

        run = prepare(cfg, layout, log=emit if jax.process_index() == 0 else _silent)
    try:
        return 0 if run.loop().ok else EXIT_NON_FINITE
    except Exception as exc:
        if jax.process_count() == 1:
            raise
        # A collective failed: most likely another process died. Exit now, without the
        # shutdown barrier, which would wait for the dead process until its heartbeat times out.
        print(f"error: process {jax.process_index()} of {jax.process_count()} stops: {first_line(exc)} "
              f"(did another process die? see its log)", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)


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

    from spmd.checkpoint import Checkpoints, check_compatible
    from spmd.data import make_source
    from spmd.loop import Run
    from spmd.plan import default_hardware, make_plan
    from spmd.step import build_program

    program = build_program(cfg, layout)
    started = time.perf_counter()
    data = make_source(cfg, layout.skeleton.model_cfg.vocab)
    source_dir, source_step = _resume_source(cfg)
    if source_dir is not None:
        source = Checkpoints(source_dir, keep=cfg.keep)
        try:
            step = source.latest_step() if source_step is None else source_step
            if step is None:
                raise UserError(f"no spmd checkpoint in {source_dir}")
            meta = source.meta(step)
            check_compatible(meta, cfg, program.abstract_state["params"], source_dir / str(step))
            state = source.restore(step, program.abstract_state, repeats=layout.repeats)
        finally:
            source.close()
        log(f"resumed from {source_dir / str(step)} (written on mesh {meta['config']['mesh']})")
    else:
        step, meta = 0, {}
        with jax.set_mesh(layout.mesh):
            state = program.init(jax.random.key(cfg.seed))
    if step > cfg.steps:
        raise UserError(f"the checkpoint is at step {step}, beyond --steps {cfg.steps}")
    step_fn = program.compile_step()
    eval_fn = program.compile_eval() if cfg.eval_every else None
    out = Checkpoints(cfg.out, keep=cfg.keep) if cfg.out else None
    setup_s = time.perf_counter() - started
    # What each device holds and what crosses the wire, read from the compiled step.
    plan = make_plan(cfg, layout, compiled=step_fn, program=program,
                     hardware=default_hardware(cfg, list(layout.mesh.devices.flat)))
    return Run(cfg, layout, plan, step_fn, state, step, out, setup_s, data, eval_fn,
               skipped=meta.get("skipped_updates", 0), log=log)


def _resume_source(cfg) -> tuple[Path | None, int | None]:
    """Where to resume from: `--resume`, else `--out` if it holds checkpoints, else nowhere."""
    from spmd.checkpoint import finalized_steps, is_empty_or_run_dir, locate

    if cfg.resume:
        return locate(cfg.resume)
    if cfg.out:
        out = Path(cfg.out)
        if not is_empty_or_run_dir(out):
            raise UserError(f"--out {out} holds files that are not spmd checkpoints; use a new or empty directory")
        if finalized_steps(out):
            return out, None
    return None, None


if __name__ == "__main__":
    sys.exit(main())
