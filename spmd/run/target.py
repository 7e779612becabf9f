"""`--target NAME` of spmd.plan and spmd.train: the run's step compiled by an accelerator's
own compiler (libtpu, XLA:GPU) for its devices, none of which is here, and the plan set
against that compiler's figures (spmd.planner.targets). spmd.train's is a compile-only
dry run, as MaxText's train_compile.py: nothing is trained or written."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence

import jax

from spmd.base import hardware
from spmd.base.cli import nonempty
from spmd.base.errors import UserError
from spmd.parallel.layout import make_layout
from spmd.planner import report, targets
from spmd.planner.targets import TARGET_HELP
from spmd.planner.plan import make_plan
from spmd.run import xla_flags
from spmd.run.bootstrap import with_mesh
from spmd.run.config import check_empty_layers
from spmd.run.resolve import parse_with_extras



def dry_run(argv: Sequence[str], prog: str) -> int:
    """A command's `--target`: its flags read as spmd.plan reads them, then `plan_target`
    (the caller serves signals first, as every command does)."""

    def extras(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--target", type=nonempty, required=True, metavar="NAME", help=TARGET_HELP)
        parser.add_argument("--json", action="store_true", help="print the plan as JSON")

    try:
        cfg, flags = parse_with_extras(argv, prog=prog, add_extras=extras,
                                       description="Compile the step for an accelerator not at hand (trains nothing).")
        return plan_target(cfg, flags.target, flags.json)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


def json_only(as_json: bool):
    """With --json, stdout holds the JSON alone: what building the step prints (a kernel
    that falls back, say) goes to stderr meanwhile."""
    return contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()


def plan_target(cfg, name: str, as_json: bool) -> int:
    """The plan of `cfg`'s step compiled for the target `name`, printed (or as JSON)."""
    target = targets.parse(name)
    backend = "tpu" if target.platform == "tpu" else "gpu"
    # The flags spmd.train sets on that accelerator, set before its compiler starts.
    flag_lines = xla_flags.configure(backend, cfg.model_cfg, cfg.model.dtype, accelerator_type=target.accelerator_type,
                                     double_buffered=xla_flags.double_buffers(cfg))
    with json_only(as_json):
        lines, plan, seconds = compiled_for(cfg, target)
    print(json.dumps({**plan.as_json(), "target": target.name, "compile_s": round(seconds, 1),
                      "flags": flag_lines}, indent=2)
          if as_json else "\n".join(flag_lines + lines + report.plan_table(plan)
                                    + [f"compiled for {target.name} in {seconds:.1f} s"]))
    return 0


def compiled_for(cfg, target: targets.Target):
    """The step compiled for `target`: (lines to print before the plan, the plan, compile seconds)."""
    try:
        devices = targets.devices(target)
    except jax.errors.JaxRuntimeError as exc:  # the plugin refused (a flag of yours in LIBTPU_INIT_ARGS, say)
        raise UserError(f"--target {target.name}: the compiler would not start: {str(exc).splitlines()[0]}") from None
    cfg, layout_line = with_mesh(cfg, devices=len(devices))
    lines = [layout_line] if layout_line else []
    if target.slices > 1:  # TPU multislice: the mesh is built over the slices (a hybrid mesh)
        if not cfg.parallelism.dcn:
            cfg = cfg.replace(dcn=spanning_axis(cfg.parallelism.mesh_spec.resolve(len(devices)), target.slices))
            lines.append(f"multislice: --dcn {cfg.parallelism.dcn} spans the {target.slices} slices "
                         "(give --dcn to choose)")
        lines.append("multislice: libtpu compiles one slice's program; the collectives between slices (over "
                     f"{cfg.parallelism.dcn}) are not in it, so their rows read 0")
    elif cfg.parallelism.dcn:
        # GPU nodes: which mesh axes span them changes no bytes, and the devices are one process here.
        cfg = cfg.replace(dcn=None)
    layout = make_layout(cfg.step, devices)
    check_empty_layers(cfg, layout.shape["pp"], layout.empty_layers_needed)
    kind = devices[0].device_kind
    start = time.perf_counter()
    try:
        plan = make_plan(cfg.step, layout, hardware=hardware.get(target.hardware),
                         planned_on=f"{target.name}: {len(devices)} x {kind}, compiled ahead of time",
                         program_shape=(one_slice(layout.shape, cfg.parallelism.mesh_spec.dcn) if target.slices > 1
                                        else None))
    except jax.errors.JaxRuntimeError as exc:
        raise UserError(f"--target {target.name}: the compiler refused the step: {str(exc).splitlines()[0]}") from None
    seconds = time.perf_counter() - start
    return lines, plan, seconds


def spanning_axis(shape, slices: int) -> str:
    """--dcn for a multislice target given none: the first of dp, fsdp, pp and ep that the
    slices divide spans them (data parallelism over the data-center network, as MaxText's
    multislice configurations do)."""
    for axis in ("dp", "fsdp", "pp", "ep"):
        if shape[axis] % slices == 0:
            return f"{axis}={slices}"
    raise UserError(f"no mesh axis of dp, fsdp, pp or ep divides into the {slices} slices; give --dcn AXIS={slices}")


def one_slice(shape, dcn) -> dict[str, int]:
    """The mesh of one slice: each axis without its factor across slices."""
    return {axis: n // dcn.get(axis, 1) for axis, n in shape.items()}
