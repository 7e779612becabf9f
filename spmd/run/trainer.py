"""The trainer: everything before the first step (build, restore or initialize, compile,
check the fit), then the loop (spmd.run.loop).

The loop does not wait for the step it just dispatched: metrics stay on the devices and
are fetched together every `--log-every` steps, and the host only ever waits for a step
that is already `spmd.run.loop.MAX_STEPS_IN_FLIGHT` behind (or for a checkpoint's copy off the
devices).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
from flax import traverse_util

from models.lora import joined
from spmd.base.console import human_bytes
from spmd.base.errors import UserError
from spmd.base.hardware import device_memory
from spmd.base.paths import LOCK_NAME, DirectoryLock
from spmd.base.signals import served
from spmd.data.feed import make_source
from spmd.formats.checkpoint import (Checkpoints, check_compatible, check_resumable, finalized_steps, keeps_router,
                                     locate, read_meta)
from spmd.formats.hf import Directory, load_params
from spmd.formats.peft import AdapterFiles
from spmd.parallel.balance import initial
from spmd.parallel.defaults import mesh_flag
from spmd.parallel.step import build_program, with_fresh_predictions
from spmd.planner.plan import default_hardware, make_plan
from spmd.run.config import TrainConfig, check_empty_layers
from spmd.run.loop import Run, RunSetup


def train(cfg: TrainConfig, layout, log=print) -> tuple[list[dict], dict]:
    """Run `cfg.training.steps` steps (resuming if a checkpoint says so); returns the records and final state."""
    run = prepare(cfg, layout, log)
    try:
        result = run.loop()
    finally:
        run.source.close()  # its worker processes
    return result.records, result.state


def prepare(cfg: TrainConfig, layout, log=print):
    """Everything before the first step: build, restore or initialize, compile.

    All checks of the user's input (checkpoints included) happen here, before anything
    is written.
    """
    started = time.perf_counter()
    if cfg.parallelism.mesh is None:  # (the Python API's default layout: its checkpoints record the mesh it chose)
        cfg = cfg.replace(mesh=mesh_flag(layout.shape))
    data = make_source(cfg.data, cfg.training, layout.skeleton.model_cfg.vocab)
    program = build_program(cfg.step, layout, data.packed)
    # One run per directory: taken before --out is read, so that a second run is refused
    # before it looks at checkpoints the first is writing. One lock per run: process 0's.
    lock = DirectoryLock(cfg.checkpoint.out) if cfg.checkpoint.out and jax.process_index() == 0 else None
    if lock:
        lock.take()
    source_dir, step, meta = _resume_source(cfg, program)
    if source_dir is None:
        check_empty_layers(cfg, layout.shape["pp"], layout.empty_layers_needed)
    if data.finite and cfg.data.eval_every and not data.has_rows(0, "eval"):
        raise UserError(f"--data {cfg.data.path}: no target tokens in the held-out examples (--eval-fraction)")
    if source_dir is not None and not data.resume(meta.get("data")) and step:
        log(f"data: the checkpoint holds no position in {cfg.data.path} for this run's rows; they are found by "
            f"packing the records of its {step:,} steps again")
    step_fn = program.compile_step()
    # What each device holds and what crosses the wire, read from the compiled step.
    plan = make_plan(cfg.step, layout, compiled=step_fn, program=program,
                     hardware=default_hardware(cfg.parallelism, list(layout.mesh.devices.flat)))
    if not cfg.parallelism.ignore_fit:
        check_fit(plan)
    if source_dir is not None:
        source = Checkpoints(source_dir, keep=cfg.checkpoint.keep)
        try:
            state = _restore(source, step, meta, program)
        finally:
            source.close()
        if layout.skeleton.lora:  # the checkpoint holds the adapters; the base is read again
            base = cfg.model.init_from or meta["config"].get("init_from")
            state["frozen"] = fresh_state(cfg.replace(init_from=base, adapter=None), program)["frozen"]
        log(f"resumed from {source_dir / str(step)} (written on mesh {meta['config']['mesh']})")
        later = [s for s in finalized_steps(source_dir) if s > step]
        if later and cfg.checkpoint.out and Path(cfg.checkpoint.out).resolve() == source_dir.resolve():
            log(f"the later checkpoints of {source_dir} ({', '.join(map(str, later))}) are replaced as this run "
                "reaches their steps")
    else:
        state = fresh_state(cfg, program, log)
        if cfg.model.init_from:
            log(f"started from {cfg.model.init_from}"
                + (f" with the adapter {cfg.lora.adapter}" if cfg.lora.adapter else ""))
    eval_fn = program.compile_eval() if cfg.data.eval_every else None
    out = None
    if lock:
        lock.hold()
        if served():
            served().cleanups.append(lock.release)
    if cfg.checkpoint.out:
        out = Checkpoints(cfg.checkpoint.out, keep=cfg.checkpoint.keep)
    setup_s = time.perf_counter() - started
    return Run(RunSetup(cfg, layout, plan, step_fn, state, step, out, setup_s, data, eval_fn,
                        skipped=meta.get("skipped_updates", 0), log=log, lock=lock, resumed=source_dir is not None,
                        rebalance=program.rebalance if program.copies else None))


def fresh_state(cfg, program, log=print) -> dict:
    """The state a run starts from: --init-from's weights (with LoRA: and fresh adapters, or
    those of --adapter; with --mtp-depth: the directory's prediction layers, and fresh
    modules where it holds none), or the model initialized from --seed."""
    layout = program.layout
    with jax.set_mesh(layout.mesh):
        if not cfg.model.init_from:
            return program.init(jax.random.key(cfg.training.seed))
        router = {}  # a selection bias the checkpoint has, which the run's router state takes
        directory = Directory(cfg.model.init_from)
        params = load_params(directory, layout, router)
        if cfg.model.mtp_depth:
            params = with_fresh_predictions(cfg.step, layout, params, jax.random.key(cfg.training.seed))
            read = min(cfg.model.mtp_depth, len(directory.predictions))
            rest = ", the rest fresh" if read < cfg.model.mtp_depth else ""
            log(f"multi-token prediction: {read} of the {cfg.model.mtp_depth} modules read from "
                f"{cfg.model.init_from}'s prediction layers (layer {directory.cfg.layers} on){rest}")
        if layout.skeleton.lora:
            adapters = (load_params(AdapterFiles(cfg.lora.adapter, layout.skeleton.model_cfg, layout.skeleton.lora),
                                    layout)
                        if cfg.lora.adapter else program.new_adapters(jax.random.key(cfg.training.seed)))
            params = joined(params, adapters)
        state = program.start(params)
        if router:
            kept = traverse_util.flatten_dict(state["routing"])
            state["routing"] = traverse_util.unflatten_dict(kept | {
                path: jax.device_put(value.astype(kept[path].dtype), kept[path].sharding) for path, value in router.items()})
        return state


def _restore(source, step: int, meta: dict, program) -> dict:
    """The checkpoint's state for `program`. A run that turns bias balancing on resumes a
    checkpoint without router state: its router starts as a fresh model's."""
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
    memory = device_memory(plan.layout.mesh.local_devices)
    peak = plan.xla["peak"] if plan.xla else plan.theory_peak
    if memory is not None and peak > memory[0]:
        raise UserError(f"the step needs {human_bytes(peak)} per device at its peak, more than the "
                        f"{human_bytes(memory[0])} of {memory[1]}; use more devices, a smaller --batch or --seq, "
                        "--grad-accum or --remat full (or --ignore-fit to try anyway)")


def _resume_source(cfg, program) -> tuple[Path | None, int, dict]:
    """Where to resume from (`--resume`, else `--out` if it holds checkpoints, else
    nowhere), checked against this run. -> (run directory, step, its meta)"""
    source_dir, step = None, None
    if cfg.checkpoint.out and (foreign := _foreign_files(Path(cfg.checkpoint.out), cfg.logging.metrics_file)):
        raise UserError(f"--out {cfg.checkpoint.out} holds files that are not spmd checkpoints ({foreign[0]}); "
                        "use a new or empty directory")
    if cfg.checkpoint.resume:
        source_dir, step = locate(cfg.checkpoint.resume)
    elif cfg.checkpoint.out and finalized_steps(Path(cfg.checkpoint.out)):
        source_dir = Path(cfg.checkpoint.out)
    if source_dir is None:
        return None, 0, {}
    if step is None:
        steps = finalized_steps(source_dir)
        if not steps:
            raise UserError(f"no spmd checkpoint in {source_dir}")
        step = steps[-1]
    meta = read_meta(source_dir, step)
    where = source_dir / str(step)
    check_compatible(meta, cfg.record(), cfg.model.name, program.abstract_state["params"], where)
    check_resumable(meta, cfg.record(), where)
    if step > cfg.training.steps:
        raise UserError(f"the checkpoint is at step {step}, beyond --steps {cfg.training.steps}")
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

