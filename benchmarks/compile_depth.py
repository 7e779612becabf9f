"""Compile time of the train step with 32 scanned layers against 2 (goal: ratio <= 1.3).

Layers are stacked and run with a scan, so XLA compiles one layer body whatever the depth.
Prints the seconds for each depth and the ratio, measured in this one run.

    python benchmarks/compile_depth.py [--mesh dp=2,fsdp=2,tp=2]
"""

import argparse
import dataclasses
import time

import jax


def compile_seconds(mesh: str, layers: int) -> float:
    from models import PRESETS
    from spmd.config import TrainConfig, validate
    from spmd.layout import make_layout
    from spmd.parallel.step import build_program

    name = f"tiny-{layers}-layers"
    PRESETS[name] = dataclasses.replace(PRESETS["tiny"], layers=layers)
    cfg = validate(TrainConfig.of(mesh=mesh, model=name, batch=16, seq=64))
    start = time.perf_counter()
    program = build_program(cfg.step, make_layout(cfg))
    program.compile_step()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=2,fsdp=2,tp=2")
    args = parser.parse_args()
    from spmd.parallel.mesh import emulate_cpu_devices, parse_mesh

    emulate_cpu_devices(parse_mesh(args.mesh), None)
    jax.config.update("jax_enable_compilation_cache", False)
    compile_seconds(args.mesh, 1)  # warm up tracing machinery and the backend
    shallow = compile_seconds(args.mesh, 2)
    deep = compile_seconds(args.mesh, 32)
    print(f"mesh {args.mesh}: compile 2 layers {shallow:.2f} s, 32 layers {deep:.2f} s")
    print(f"ratio 32/2 layers: {deep / shallow:.3f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
