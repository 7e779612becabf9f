"""How long a checkpoint blocks the training loop: Orbax async save (the loop waits only
for the copy off the devices) against a blocking save of the same state.

    python benchmarks/checkpoint_save.py [--mesh fsdp=2] [--dir /tmp/spmd-ckpt-bench]

The model (~100M parameters, 1.2 GB of fp32 state with Adam) is large enough that the
write, not Orbax's bookkeeping, dominates on this machine.
"""

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="fsdp=2")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from spmd.parallel.mesh import emulate_cpu_devices, parse_mesh

    emulate_cpu_devices(parse_mesh(args.mesh), None)
    import jax

    from models import PRESETS
    from spmd.formats.checkpoint import Checkpoints, make_meta
    from spmd.config import TrainConfig, validate
    from spmd.layout import make_layout
    from spmd.parallel.step import build_program

    PRESETS["bench-100m"] = dataclasses.replace(PRESETS["small"], vocab=32000, embed=768, layers=6, heads=12,
                                                kv_heads=4, head_dim=64, mlp=3072)
    cfg = validate(TrainConfig.of(mesh=args.mesh, model="bench-100m", batch=8, seq=64))
    layout = make_layout(cfg)
    program = build_program(cfg.step, layout)
    with jax.set_mesh(layout.mesh):
        state = jax.block_until_ready(program.init(jax.random.key(0)))
    size = sum(x.nbytes for x in jax.tree.leaves(state))
    root = Path(args.dir or tempfile.mkdtemp(prefix="spmd-ckpt-bench-"))
    meta = make_meta(cfg.record(), cfg.model.name, 0, state["params"])
    results = {}
    for async_save in (True, False):
        blocked, total = [], []
        for r in range(args.repeats):
            where = root / f"{'async' if async_save else 'sync'}-{r}"
            shutil.rmtree(where, ignore_errors=True)
            checkpoints = Checkpoints(where, async_save=async_save)
            start = time.perf_counter()
            checkpoints.save(1, state, meta)
            blocked.append(time.perf_counter() - start)
            checkpoints.wait()
            total.append(time.perf_counter() - start)
            checkpoints.close()
            shutil.rmtree(where, ignore_errors=True)
        results[async_save] = (min(blocked), min(total))
        print(f"{'async   ' if async_save else 'blocking'} save of {size / 2**30:.2f} GiB: "
              f"loop blocked {min(blocked):.2f} s, written in {min(total):.2f} s")
    print(f"loop blocked by an async save / by a blocking save: {results[True][0] / results[False][0]:.3f}")


if __name__ == "__main__":
    main()
