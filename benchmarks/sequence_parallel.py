"""Sequence parallelism at a long sequence: activation memory per device and K/V traffic.

For sp = 1, 2, 4, 8 the train step of the small model is compiled (nothing runs) for one
8k-token sequence; XLA's memory analysis gives the temporaries per device (the saved
activations and the step's working set), the optimized HLO the K/V bytes that attention
moves over sp, next to their theory (spmd/planner/theory.py). Goal: temporaries close to 1/sp
of sp=1's; K/V bytes equal to theory.

    python benchmarks/sequence_parallel.py [--seq 8192]
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.planner.plan import make_plan  # noqa: E402
from spmd.base.console import human_bytes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--model", default="small")
    args = parser.parse_args()
    print(f"{args.model}, 1 sequence of {args.seq} tokens, float32, remat none\n")
    print(f"{'attention':12}{'sp':>4}{'temporaries':>14}{'/ sp=1':>9}{'1/sp':>7}{'K/V bytes':>12}"
          f"{'theory':>12}{'ratio':>7}")
    base = None
    for mode in ("ring", "all-gather"):
        for sp in (1, 2, 4, 8):
            if mode == "all-gather" and sp == 1:
                continue
            cfg = validate(TrainConfig.of(model=args.model, mesh=f"sp={sp}", batch=1, seq=args.seq, attention=mode))
            plan = make_plan(cfg.step, make_layout(cfg, jax.devices()[:sp]))
            temp = plan.xla["temp"]
            base = base or temp
            kv = [r for r in plan.rows if r.axes == "sp" and r.op != "all-reduce"]
            measured, theory = sum(r.measured for r in kv), sum(r.theory for r in kv)
            ratio = f"{measured / theory:7.3f}" if theory else f"{'-':>7}"
            print(f"{mode:12}{sp:>4}{human_bytes(temp):>14}{temp / base:9.3f}{1 / sp:7.3f}"
                  f"{human_bytes(measured):>12}{human_bytes(theory):>12}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
