"""Pipeline schedules: executed compute against the bubble formula, and each schedule's
activation memory against 1F1B's at m = 4p.

For each schedule the train step is compiled on p emulated CPU devices (pp only, so
every device runs one stage) and on one device without a pipeline. Executed compute is
the FLOPs of every matrix product inside the compiled step's loops (the stages' ticks and
layer scans), times how often its loop runs (`spmd.hlo.dot_flops`), summed over the p
devices; useful compute is the same count for the one-device step (its layer scan). Their
ratio should be 1 / (1 - bubble) = (v*m + p - 1) / (v*m). Left out on both sides: what
runs outside loops (embedding, output head), and 1F1B's head, which sits in a branch that
only the last stage takes.

Memory: XLA's temporaries per device, each schedule's over 1F1B's on the same layout.
`kept`: the activations a stage keeps, in microbatches through all its layers
(spmd.pipeline.Schedule.kept_microbatches: GPipe m + p - 1, circular (v*m + p - 1)/v,
1F1B 2p - 1, interleaved 1F1B (2vp - 1)/v); `+tick`: with the tick's activations,
built apart before they are filed (1/v more), and its ratio to 1F1B's: the ratio of the
activations alone; the other temporaries (logits, gradients, the microbatches' copies)
are alike.

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
from spmd.pipeline import Schedule  # noqa: E402
from spmd.step import build_program  # noqa: E402

BASE = dict(model="small", layers=8, seq=128, remat="none")


def compiled(mesh: str, devices: int, **overrides):
    cfg = validate(TrainConfig(mesh=mesh, **{**BASE, **overrides}))
    return build_program(cfg, make_layout(cfg, jax.devices()[:devices])).compile_step()


def loop_flops(step) -> float:
    return hlo.loop_dot_flops(hlo.parse(step.as_text()))


def main() -> None:
    print("executed stage compute (dot FLOPs inside the stage loops, all devices) / useful")
    print(f"{'schedule':<16} {'p':>2} {'v':>2} {'m':>3} {'executed/useful':>16} {'(vm+p-1)/vm':>12} {'ratio':>7}")
    cases = [("gpipe", 2, 1, 2), ("gpipe", 2, 1, 8), ("gpipe", 4, 1, 4), ("gpipe", 4, 1, 16),
             ("circular", 2, 2, 2), ("circular", 4, 2, 4), ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16),
             ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 2, 8)]
    useful_at = {}
    for name, p, v, m in cases:
        batch = 4 * m
        if batch not in useful_at:
            useful_at[batch] = loop_flops(compiled("", 1, batch=batch))
        step = compiled(f"pp={p}", p, batch=batch, pp_schedule=name, pp_repeats=v, microbatches=m)
        measured = p * loop_flops(step) / useful_at[batch]
        formula = (v * m + p - 1) / (v * m)
        print(f"{name:<16} {p:>2} {v:>2} {m:>3} {measured:>16.3f} {formula:>12.3f} {measured / formula:>7.3f}")

    print("\nactivation (temporary) memory per device at m = 4p, batch 4m x seq 128, against 1F1B's")
    print(f"{'schedule':<16} {'p':>2} {'v':>2} {'m':>3} {'MiB':>6} {'/1f1b':>6} {'kept':>5} {'+tick':>6} {'/1f1b':>6}")
    for p in (2, 4):
        m = 4 * p
        schedules = [("1f1b", 1), ("gpipe", 1), ("circular", 2), ("interleaved-1f1b", 2)]
        temps = {name: compiled(f"pp={p}", p, batch=4 * m, pp_schedule=name, pp_repeats=v, microbatches=m)
                 .memory_analysis().temp_size_in_bytes for name, v in schedules}
        base = Schedule("1f1b", p, m).kept_microbatches + 1
        for name, v in schedules:
            kept = Schedule(name, p, m, v).kept_microbatches
            print(f"{name:<16} {p:>2} {v:>2} {m:>3} {temps[name] / 2**20:>6.1f} {temps[name] / temps['1f1b']:>6.3f} "
                  f"{kept:>5.1f} {kept + 1 / v:>6.1f} {(kept + 1 / v) / base:>6.3f}")


if __name__ == "__main__":
    main()
