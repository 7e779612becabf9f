"""Pipeline schedules: executed compute against the bubble formula, and GPipe's against
1F1B's activation memory at m = 4p.

For each schedule the train step is compiled on p emulated CPU devices (pp only, so
every device runs one stage) and on one device without a pipeline. Executed compute is
the FLOPs of every matrix product inside the compiled step's loops (the stages' ticks and
layer scans), times how often its loop runs (`spmd.hlo.dot_flops`), summed over the p
devices; useful compute is the same count for the one-device step (its layer scan). Their
ratio should be 1 / (1 - bubble) = (v*m + p - 1) / (v*m). Left out on both sides: what
runs outside loops (embedding, output head), and 1F1B's head, which sits in a branch that
only the last stage takes.

Memory: XLA's temporaries per device. (2p-1)/(m+p-1) is the ratio of the kept
activations alone (1F1B's ring of residuals against GPipe's ticks); the other
temporaries (logits, gradients, the microbatches' copies) are alike in both.

    python benchmarks/pipeline.py            # small model, 8 layers, seq 128
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spmd import hlo  # noqa: E402
from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.step import build_program  # noqa: E402

BASE = dict(model="small", layers=8, seq=128, remat="none")


def compiled(mesh: str, devices: int, **overrides):
    cfg = validate(TrainConfig(mesh=mesh, **{**BASE, **overrides}))
    return build_program(cfg, make_layout(cfg, jax.devices()[:devices])).compile_step()


def loop_flops(step) -> float:
    return hlo.loop_dot_flops(hlo.parse(step.as_text()))


def main() -> None:
    print("executed stage compute (dot FLOPs inside the stage loops, all devices) / useful")
    print(f"{'schedule':<10} {'p':>2} {'v':>2} {'m':>3} {'executed/useful':>16} {'(vm+p-1)/vm':>12} {'ratio':>7}")
    cases = [("gpipe", 2, 1, 2), ("gpipe", 2, 1, 8), ("gpipe", 4, 1, 4), ("gpipe", 4, 1, 16),
             ("circular", 2, 2, 2), ("circular", 4, 2, 4), ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16)]
    useful_at = {}
    for name, p, v, m in cases:
        batch = 4 * m
        if batch not in useful_at:
            useful_at[batch] = loop_flops(compiled("", 1, batch=batch))
        step = compiled(f"pp={p}", p, batch=batch, pp_schedule=name, pp_repeats=v, microbatches=m)
        measured = p * loop_flops(step) / useful_at[batch]
        formula = (v * m + p - 1) / (v * m)
        print(f"{name:<10} {p:>2} {v:>2} {m:>3} {measured:>16.3f} {formula:>12.3f} {measured / formula:>7.3f}")

    print("\nactivation (temporary) memory per device at m = 4p, batch 4m x seq 128")
    print(f"{'p':>2} {'m':>3} {'gpipe MiB':>10} {'1f1b MiB':>9} {'1f1b/gpipe':>11} {'(2p-1)/(m+p-1)':>15}")
    for p in (2, 4):
        m = 4 * p
        temps = {name: compiled(f"pp={p}", p, batch=4 * m, pp_schedule=name, microbatches=m)
                 .memory_analysis().temp_size_in_bytes for name in ("gpipe", "1f1b")}
        print(f"{p:>2} {m:>3} {temps['gpipe'] / 2**20:>10.1f} {temps['1f1b'] / 2**20:>9.1f} "
              f"{temps['1f1b'] / temps['gpipe']:>11.3f} {(2 * p - 1) / (m + p - 1):>15.3f}")


if __name__ == "__main__":
    main()
