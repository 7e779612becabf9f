"""Expert parallelism: all-to-all bytes per device against theory, and the step-time cost
of dropless against capacity dispatch.

1. For several layouts the train step is compiled (nothing runs); the optimized HLO gives
   the bytes each device sends by all-to-all over ep per step, set next to
   - theory (spmd/planner/theory.py): the buffers spmd.parallel.experts exchanges (capacity slots, or
     dropless blocks padded per destination, plus their expert indices);
   - GPU/TPU: the theory of what those backends send, where dropless uses
     `jax.lax.ragged_all_to_all`: the routed tokens x top-k with their indices, (ep-1)/ep
     leaving, 2 exchanges forward + 2 backward (+2 forward again under remat).
   Goal: measured / theory = 1.000; CPU / GPU shows the padding XLA:CPU pays.
2. A small MoE model trains on 8 emulated devices (ep=4, dp=2) in both modes, timed in
   alternating rounds (this machine drifts by tens of percent between minutes); printed:
   the median of dropless / capacity step time.

    python benchmarks/experts.py [--rounds 3 --steps 20]
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 64)

from models import PRESETS, MoEConfig  # noqa: E402
from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.planner.plan import make_plan  # noqa: E402
from spmd.base.console import human_bytes  # noqa: E402
from spmd.planner.activations import expert_exchange  # noqa: E402

# For the timing: big enough that the experts' matmuls, not overheads, set the step time.
PRESETS["bench-moe"] = dataclasses.replace(
    PRESETS["small"], moe=MoEConfig(experts=8, top_k=2, expert_mlp=512, shared_experts=0, every=1))

LAYOUTS = [  # (model, mesh, devices, dtype, overrides)
    ("moe-tiny", "ep=2", 2, "float32", {}),
    ("moe-tiny", "ep=4", 4, "float32", {}),
    ("moe-tiny", "ep=8", 8, "float32", {}),
    ("moe-tiny", "ep=2,fsdp=2,tp=2", 8, "float32", {}),
    ("mixtral-8x7b", "fsdp=8,ep=8", 64, "bfloat16", {"batch": 64, "seq": 4096, "remat": "full"}),
    ("deepseek-moe-16b-like", "fsdp=8,ep=8", 64, "bfloat16", {"batch": 64, "seq": 4096, "remat": "full"}),
]


def bytes_table() -> None:
    print("all-to-all bytes per device per step (compiled HLO, one run)\n")
    print(f"{'model':24}{'mesh':18}{'dispatch':10}{'measured':>11}{'theory':>11}{'ratio':>7}"
          f"{'GPU/TPU':>11}{'CPU / GPU':>10}")
    for model, mesh, devices, dtype, extra in LAYOUTS:
        for dispatch in ("capacity", "dropless"):
            cfg = validate(TrainConfig.of(**{"model": model, "mesh": mesh, "dtype": dtype, "moe_dispatch": dispatch,
                                          "batch": 32, "seq": 32, **extra}))
            layout = make_layout(cfg, jax.devices()[:devices])
            rows = [r for r in make_plan(cfg.step, layout).rows if r.op == "all-to-all"]
            measured, theory = sum(r.measured for r in rows), sum(r.theory for r in rows)
            # What a GPU or TPU sends: dropless by ragged all-to-all, the rows there are.
            accelerator = sum(e.bytes_per_device for e in expert_exchange(
                cfg, layout, 2 if dtype == "bfloat16" else 4, ragged=dispatch == "dropless"))
            print(f"{model:24}{mesh:18}{dispatch:10}{human_bytes(measured):>11}{human_bytes(theory):>11}"
                  f"{measured / theory:7.3f}{human_bytes(accelerator):>11}{measured / accelerator:10.2f}")


def step_seconds(cfg, steps: int) -> float:
    from spmd.data.feed import global_batch
    from spmd.data.synthetic import MarkovSource
    from spmd.parallel.step import build_program

    layout = make_layout(cfg, jax.devices()[:8])
    program = build_program(cfg.step, layout)
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(0))
    step = program.compile_step()
    batch = global_batch(MarkovSource(layout.skeleton.model_cfg.vocab, 0), 0, cfg.training.batch, cfg.training.seq + 1,
                         layout.batch_sharding)
    state, metrics = step(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)  # one at a time: XLA:CPU's emulated collectives dislike deep queues
    return (time.perf_counter() - start) / steps


def timing(rounds: int, steps: int) -> None:
    print("\nstep time, bench-moe (embed 256, 4 layers, 8 experts of 512, top-2), dp=2,ep=4, batch 16 x 256, float32")
    ratios = []
    for i in range(rounds):
        times = {d: step_seconds(validate(TrainConfig.of(model="bench-moe", mesh="dp=2,ep=4", batch=16, seq=256,
                                                      moe_dispatch=d)), steps) for d in ("capacity", "dropless")}
        ratios.append(times["dropless"] / times["capacity"])
        print(f"round {i}: capacity {times['capacity'] * 1e3:.1f} ms, dropless {times['dropless'] * 1e3:.1f} ms, "
              f"ratio {ratios[-1]:.3f}")
    print(f"median dropless / capacity (factor 1.25): {statistics.median(ratios):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    bytes_table()
    timing(args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
