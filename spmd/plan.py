"""`python -m spmd.plan`: before launch, what each device holds and what crosses the wire
(the planner: spmd.planner)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from spmd.base.cli import integer, nonempty
from spmd.base.errors import UserError
from spmd.base.signals import serve as serve_signals


def __getattr__(name: str):
    """`make_plan`, this module's name for the Python API, imported on first use (see main)."""
    if name == "make_plan":
        from spmd.planner.plan import make_plan

        return make_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--auto", action="store_true",
                        help="search dp/fsdp/tp meshes, ZeRO stage and remat for the fastest layouts that fit")
    parser.add_argument("--devices", type=integer, default=None,
                        help="device count for --auto, or for the default layout without --mesh (default: the product "
                        "of --mesh, or 8 without one: spmd.train's default run)")
    from spmd.planner.targets import TARGET_HELP  # (light: no JAX)

    parser.add_argument("--target", type=nonempty, default=None, metavar="NAME", help=TARGET_HELP)


def main(argv: Sequence[str] | None = None) -> int:
    serve_signals("stopped; nothing was written")
    try:
        # The library is imported once signals are served (numpy starts threads when
        # imported), the planner's only once the flags are read (bad ones answer sooner).
        from spmd.run.resolve import parse_with_extras

        cfg, extras = parse_with_extras(argv, prog="python -m spmd.plan", add_extras=plan_flags,
                                        description="Show per-device memory, collectives and a step-time "
                                                    "estimate of a layout, before launch (trains nothing).")
        from spmd.parallel.layout import make_layout
        from spmd.parallel.mesh import (DEFAULT_CPU_DEVICES, MAX_EMULATED_DEVICES, accelerator_present,
                                        check_dcn)
        from spmd.planner import report
        from spmd.planner.plan import auto, default_hardware, make_plan, plan_devices
        from spmd.run.bootstrap import with_mesh
        from spmd.run.config import check_empty_layers
        from spmd.run.target import json_only

        if extras.target:
            if extras.auto or extras.devices is not None:
                raise UserError("--target names its devices: give it without --auto and --devices")
            from spmd.run.target import plan_target

            return plan_target(cfg, extras.target, extras.json)
        spec = cfg.parallelism.mesh_spec
        count = (extras.devices if extras.devices is not None else
                 spec.devices if cfg.parallelism.mesh else DEFAULT_CPU_DEVICES)
        if count < 1:
            raise UserError(f"--devices must be positive, got {count}")
        if count > MAX_EMULATED_DEVICES and not accelerator_present():
            raise UserError(f"planning for {count:,} devices would emulate them on the CPU; at most "
                            f"{MAX_EMULATED_DEVICES} can be emulated")
        if spec.has_remaining and not extras.devices and not extras.auto:
            raise UserError("a mesh axis of -1 needs --devices N to plan for")
        devices, planned_on = plan_devices(count)
        hardware = default_hardware(cfg.parallelism, devices)
        layout_line = None
        if not extras.auto:  # (no --mesh: spmd.train's default layout of the devices planned for)
            cfg, layout_line = with_mesh(cfg, devices=count)
        if cfg.parallelism.dcn:
            # The emulated devices are one process: plan the mesh; which devices span DCN changes no bytes.
            if cfg.parallelism.mesh is not None:  # (--auto searches the meshes)
                check_dcn(cfg.parallelism.mesh_spec.resolve(count), cfg.parallelism.mesh_spec.dcn)
            cfg = cfg.replace(dcn=None)
        if extras.auto:
            check_empty_layers(cfg, pp=1)  # (it searches meshes without stages)
            if hardware is None:
                raise UserError("--auto needs --hardware (one of the entries in spmd/base/hardware.toml)")
            with json_only(extras.json):
                plans, searched = auto(cfg.step, devices, hardware, planned_on)
            print(json.dumps([p.as_json() for p in plans], indent=2) if extras.json
                  else "\n".join([*report.auto_table(plans), searched]))
            return 0

        layout = make_layout(cfg.step, devices)
        check_empty_layers(cfg, layout.shape["pp"], layout.empty_layers_needed)
        with json_only(extras.json):
            plan = make_plan(cfg.step, layout, hardware=hardware, planned_on=planned_on)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(plan.as_json(), indent=2) if extras.json
          else "\n".join(([layout_line] if layout_line else []) + report.plan_table(plan)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
