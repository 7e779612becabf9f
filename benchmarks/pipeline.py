"""Pipeline schedules: executed compute against the bubble formula, and each schedule's
activation memory against 1F1B's at m = 4p, and zb-v's rings against 1F1B's.

For each schedule the train step is compiled on p emulated CPU devices (pp only, so
every device runs one stage) and on one device without a pipeline. Executed compute is
the FLOPs of every matrix product inside the compiled step's loops (the stages' ticks and
layer scans), times how often its loop runs (`spmd.planner.hlo.dot_flops`), summed over the p
devices; useful compute is the same count for the one-device step (its layer scan). Their
ratio should be 1 / (1 - bubble) = (v*m + p - 1) / (v*m); zb-v's
((2m+2p-2)(f+b) + 2m w) / (2m(f+b+w)), f, b, w a chunk's forward, input-gradient and
weight-gradient dot FLOPs (spmd.planner.hlo.chunk_dot_flops; zb-v runs with 2 layers a
chunk, 4p layers, so that a chunk's layer scan stays a loop); DualPipe's
((m+p-2)(f+b) + m w) / (m(f+b+w)) with a stage of 2 layers as its chunk, printed beside
DeepSeek's published 1 + (p/2 - 1)(F&B + B - 3W)/(m(F+B+W)) (V3 report, table 2, with
F&B = F + B), which a program of lockstep ticks does not reach (docs/pipelines.md). Left out on both sides: what
runs outside loops (embedding, output head), and 1F1B's head, which sits in a branch that
only the last stage takes.

Memory: XLA's temporaries per device, each schedule's over 1F1B's on the same layout.
`kept`: the activations a stage keeps, in microbatches through all its layers
(spmd.parallel.pipeline.Schedule.kept_microbatches: GPipe m + p - 1, circular (v*m + p - 1)/v,
1F1B 2p - 1, interleaved 1F1B (2vp - 1)/v, zb-v its longest ring, (5p - 2)/2 chunks of the
matmuls' inputs, DualPipe (5p - 4)/2 stages of them, beside its second stage's weights
and their gradient); `+tick`: with the tick's activations,
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

from spmd.planner import hlo  # noqa: E402
from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.parallel.pipeline import Schedule  # noqa: E402
from spmd.parallel.staged import stage_parts  # noqa: E402
from spmd.parallel.step import build_program  # noqa: E402
from spmd.parallel.pipeline.kit import split_vjp  # noqa: E402
from spmd.parallel.pipeline.split import split_backward  # noqa: E402
from spmd.parallel.pipeline.zero_bubble import executed_over_useful, timetable  # noqa: E402
from spmd.planner.hlo import chunk_dot_flops  # noqa: E402

BASE = dict(model="small", layers=8, seq=128, remat="none")


def program(mesh: str, devices: int, **overrides):
    cfg = validate(TrainConfig.of(mesh=mesh, **{**BASE, **overrides}))
    return build_program(cfg.step, make_layout(cfg, jax.devices()[:devices]))


def compiled(mesh: str, devices: int, **overrides):
    return program(mesh, devices, **overrides).compile_step()


def split_formula(p: int, m: int, batch: int, layers: int, dual: bool) -> tuple[float, tuple[float, float, float]]:
    """zb-v's or DualPipe's executed/useful from a chunk's f, b, w (half a stage, or a
    stage), measured on one device."""
    one = program("", 1, batch=batch, layers=layers)
    with jax.set_mesh(one.layout.mesh):
        params = one.init(jax.random.key(0))["params"]
    rows = jax.numpy.zeros((batch // m, BASE["seq"] + 1), jax.numpy.int32)
    with one._annotated():
        parts = stage_parts(one.graphdef, params, rows, one._annotated, "blocks", None)
        chunk = jax.tree.map(lambda w: w[: layers // (p if dual else 2 * p)], params["blocks"])
        f, b, w = chunk_dot_flops(parts.stage, chunk, parts.embedded())
    return executed_over_useful(p, m, f, b, w, dual), (f, b, w)


def published_dualpipe(p: int, m: int, f: float, b: float, w: float) -> float:
    """DeepSeek-V3 report, table 2: DualPipe idles (P/2 - 1)(F&B + B - 3W) per device
    beside its useful m(F + B + W) (F&B taken as F + B: no speed-up from the overlap)."""
    return 1 + (p / 2 - 1) * (f + 2 * b - 3 * w) / (m * (f + b + w))


def loop_flops(step) -> float:
    return hlo.loop_dot_flops(hlo.parse(step.as_text()))


def main() -> None:
    print("executed stage compute (dot FLOPs inside the stage loops, all devices) / useful")
    print(f"{'schedule':<16} {'p':>2} {'v':>2} {'m':>3} {'executed/useful':>16} {'formula':>12} {'ratio':>7}")
    cases = [("gpipe", 2, 1, 2), ("gpipe", 2, 1, 8), ("gpipe", 4, 1, 4), ("gpipe", 4, 1, 16),
             ("circular", 2, 2, 2), ("circular", 4, 2, 4), ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16),
             ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 2, 8)]
    cases += [("zb-v", 2, 2, 4), ("zb-v", 2, 2, 8), ("zb-v", 4, 2, 8), ("zb-v", 4, 2, 16)]
    cases += [("dualpipe", 2, 1, 4), ("dualpipe", 4, 1, 8), ("dualpipe", 4, 1, 16), ("dualpipe", 8, 1, 16)]
    useful_at = {}
    for name, p, v, m in cases:
        split = name in ("zb-v", "dualpipe")  # (two-layer chunks: their layer scans stay loops)
        batch, layers = 4 * m, (4 * p if name == "zb-v" else 2 * p if split else BASE["layers"])
        if (batch, layers) not in useful_at:
            useful_at[batch, layers] = loop_flops(compiled("", 1, batch=batch, layers=layers))
        step = compiled(f"pp={p}", p, batch=batch, layers=layers, pp_schedule=name,
                        pp_repeats=v if name in ("circular", "interleaved-1f1b") else 1, microbatches=m)
        measured = p * loop_flops(step) / useful_at[batch, layers]
        formula, costs = (v * m + p - 1) / (v * m), ""
        if split:
            formula, (f, b, w) = split_formula(p, m, batch, layers, name == "dualpipe")
            costs = f"  f:b:w = 1:{b / f:.2f}:{w / f:.2f}, 1F1B's (m+p-1)/m = {(m + p - 1) / m:.3f}"
            if name == "dualpipe":
                costs += f", DeepSeek's published {published_dualpipe(p, m, f, b, w):.3f}"
        print(f"{name:<16} {p:>2} {v:>2} {m:>3} {measured:>16.3f} {formula:>12.3f} {measured / formula:>7.3f}{costs}")

    print("\nactivation (temporary) memory per device at m = 4p, batch 4m x seq 128, against 1F1B's")
    print(f"{'schedule':<16} {'p':>2} {'v':>2} {'m':>3} {'MiB':>6} {'/1f1b':>6} {'kept':>5} {'+tick':>6} {'/1f1b':>6}")
    for p in (2, 4):
        m = 4 * p
        schedules = [("1f1b", 1), ("gpipe", 1), ("circular", 2), ("interleaved-1f1b", 2), ("zb-v", 2), ("dualpipe", 1)]
        temps = {name: compiled(f"pp={p}", p, batch=4 * m, pp_schedule=name,
                                pp_repeats=v if name in ("circular", "interleaved-1f1b") else 1,
                                microbatches=m).memory_analysis().temp_size_in_bytes for name, v in schedules}
        base = Schedule("1f1b", p, m).kept_microbatches + 1
        for name, v in schedules:
            kept = Schedule(name, p, m, v).kept_microbatches
            print(f"{name:<16} {p:>2} {v:>2} {m:>3} {temps[name] / 2**20:>6.1f} {temps[name] / temps['1f1b']:>6.3f} "
                  f"{kept:>5.1f} {kept + 1 / v:>6.1f} {(kept + 1 / v) / base:>6.3f}")

    print("\nzb-v's rings (slots x a chunk's residuals: what B reads, the matmuls' inputs for W, the cotangents "
          "from B to W) against 1F1B's ring (2p - 1 stages' residuals), from the residuals' shapes")
    for p in (2, 4):
        zb, one_f = ring_bytes(p, 4 * p)
        print(f"p={p} m={4 * p}: zb-v {zb} MiB, 1f1b {one_f:.1f} MiB")


def ring_bytes(p: int, m: int) -> tuple[str, float]:
    one = program("", 1, batch=4 * m)
    with jax.set_mesh(one.layout.mesh):
        params = one.init(jax.random.key(0))["params"]
    rows = jax.numpy.zeros((4, BASE["seq"] + 1), jax.numpy.int32)
    mib = lambda shapes: sum(s.size * s.dtype.itemsize for s in shapes) / 2**20  # noqa: E731
    with one._annotated():
        parts = stage_parts(one.graphdef, params, rows, one._annotated, "blocks", None)
        stage, x = parts.stage, parts.embedded()
        chunk = jax.tree.map(lambda w: w[: BASE["layers"] // (2 * p)], params["blocks"])
        shapes = [mib(s) for s in split_backward(stage, chunk, x)[3]]
        stage_residuals = mib(split_vjp(stage, jax.tree.map(lambda w: w[: BASE["layers"] // p], params["blocks"]), x)[2])
    slots = timetable(p, m)["slots"]
    total = sum(n * s for n, s in zip(slots, shapes))
    return f"{total:.1f} = " + " + ".join(f"{n} x {s:.2f}" for n, s in zip(slots, shapes)), (2 * p - 1) * stage_residuals


if __name__ == "__main__":
    main()
