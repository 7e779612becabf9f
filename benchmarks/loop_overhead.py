"""Overhead of the training loop: steady-state step time inside `spmd.train`'s loop
(batches built per step on a background thread, metrics fetched only at log steps)
against the bare compiled step called back to back on one fixed batch. Goal: <= 1.03.

This machine's timings drift by tens of percent between minutes, so the two are measured
in alternating rounds and the median of the per-round ratios is printed.

    python benchmarks/loop_overhead.py [--model tiny --mesh dp=2,fsdp=2,tp=2 --rounds 3]
"""

import argparse
import statistics
import time


def bare_step_seconds(program, layout, cfg, steps: int, in_flight_limit: int) -> float:
    import jax

    from spmd.data.feed import global_batch
    from spmd.data.synthetic import MarkovSource

    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(0))
    step = program.compile_step()
    batch = global_batch(MarkovSource(layout.skeleton.model_cfg.vocab, 0), 0, cfg.training.batch, cfg.training.seq + 1,
                         layout.batch_sharding)
    for warmup in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    in_flight = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        # The same bound on steps in flight as the trainer (XLA:CPU needs it; see spmd.run.loop).
        in_flight.append(metrics["loss"])
        if len(in_flight) > in_flight_limit:
            in_flight.pop(0).block_until_ready()
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--mesh", default="dp=2,fsdp=2,tp=2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from spmd.parallel.mesh import emulate_cpu_devices, parse_mesh

    emulate_cpu_devices(parse_mesh(args.mesh), None)
    from spmd.config import TrainConfig, validate
    from spmd.layout import make_layout
    from spmd.parallel.step import build_program
    from spmd.run.loop import MAX_STEPS_IN_FLIGHT
    from spmd.train import train

    cfg = validate(TrainConfig.of(mesh=args.mesh, model=args.model, batch=args.batch, seq=args.seq,
                               steps=args.steps + args.log_every, log_every=args.log_every))
    layout = make_layout(cfg)
    program = build_program(cfg.step, layout)
    ratios = []
    for round_ in range(args.rounds):
        bare = bare_step_seconds(program, layout, cfg, args.steps, MAX_STEPS_IN_FLIGHT)
        records, _ = train(cfg, layout, log=lambda _: None)
        loop = [r["step_time_s"] for r in records[args.log_every:]]  # the first window warms up
        in_loop = sum(loop) / len(loop)
        ratios.append(in_loop / bare)
        print(f"round {round_}: loop {in_loop * 1e3:.1f} ms/step, bare {bare * 1e3:.1f} ms/step, "
              f"ratio {ratios[-1]:.3f}")
    print(f"{args.model} on {args.mesh}, batch {args.batch}x{args.seq}: "
          f"median ratio loop/bare {statistics.median(ratios):.3f} (goal <= 1.03)")


if __name__ == "__main__":
    main()
