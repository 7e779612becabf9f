"""`python -m spmd.export`: write a checkpoint's parameters only, for inference or
fine-tuning elsewhere.

    python -m spmd.export --checkpoint runs/a [--step N] --out exported/ [--mesh fsdp=8]

The parameters are read straight into the layout of `--mesh` (default: the mesh that
wrote them) and saved as one Orbax PyTree, `OUT/params`, beside `OUT/model.json` (model
name, step, parameter shapes). Reading them back needs no optimizer state.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from spmd.errors import UserError, one_line_errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run directory (latest step) or one step's directory")
    parser.add_argument("--step", type=int, help="which step of a run directory (default: the latest)")
    parser.add_argument("--out", required=True, help="new or empty directory to write")
    parser.add_argument("--mesh", help="mesh to restore onto (default: the one that wrote the checkpoint)")
    parser.add_argument("--cpu-devices", type=int, help="emulated CPU devices (default: what the mesh needs)")
    args = parser.parse_args(argv)
    with one_line_errors():
        export(args)
    return 0


def export(args) -> Path:
    from spmd.checkpoint import Checkpoints, check_compatible, export_params, finalized_steps, locate, read_meta
    from spmd.config import TrainConfig, validate
    from spmd.mesh import emulate_cpu_devices, parse_mesh

    run_dir, step = locate(args.checkpoint)
    step = args.step if step is None else step
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty")
    steps = finalized_steps(run_dir)
    step = (steps[-1] if steps else None) if step is None else step
    if step is None or step not in steps:
        raise UserError(f"no spmd checkpoint {'' if step is None else f'at step {step} '}in {run_dir}")
    meta = read_meta(run_dir, step)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in meta.get("config", {}).items() if k in fields})
    # Exported as the model has them: stacked layers in order, whatever pipeline wrote them.
    cfg = validate(dataclasses.replace(cfg, mesh=args.mesh or cfg.mesh, pp_schedule="gpipe", pp_repeats=1,
                                       microbatches=None))
    emulate_cpu_devices(parse_mesh(cfg.mesh), args.cpu_devices)  # before Orbax starts JAX

    from spmd.layout import make_layout
    from spmd.step import build_program

    abstract = build_program(cfg, make_layout(cfg, for_training=False)).abstract_state
    check_compatible(meta, cfg, abstract["params"], run_dir / str(step))
    source = Checkpoints(run_dir)
    try:
        params = source.restore(step, abstract, items=("params",))["params"]
    finally:
        source.close()
    export_params(out, params, meta)
    print(f"exported the parameters of {run_dir / str(step)} ({cfg.model}) to {out.absolute()}")
    return out


if __name__ == "__main__":
    sys.exit(main())
