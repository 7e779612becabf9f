"""`python -m spmd.train`: train a model on a named device mesh.

The loop does not wait for the step it just dispatched: metrics stay on the devices and
are fetched together every `--log-every` steps, and the host only ever waits for a step
that is already `MAX_STEPS_IN_FLIGHT` behind.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Sequence

from spmd.config import TrainConfig, parse_args
from spmd.errors import UserError
from spmd.mesh import emulate_cpu_devices, parse_mesh

# The host may run this many steps ahead of the devices. Enough to keep them busy while
# the next batch is built; bounded because a deep queue of in-flight executions
# deadlocked XLA:CPU's collectives on emulated devices (seen at ~200 queued steps).
MAX_STEPS_IN_FLIGHT = 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        emulate_cpu_devices(parse_mesh(cfg.mesh), cfg.cpu_devices)
        from spmd.layout import make_layout

        layout = make_layout(cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train(cfg, layout)
    return 0


def train(cfg: TrainConfig, layout, log=print) -> tuple[list[dict], dict]:
    """Run `cfg.steps` steps; returns the per-step records and the final state."""
    import jax
    import numpy as np

    from spmd.data import MarkovSource, Prefetcher, global_batch
    from spmd.hardware import peak_tflops, train_flops_per_token
    from spmd.report import describe_run
    from spmd.step import build_program

    program = build_program(cfg, layout)
    source = MarkovSource(layout.skeleton.model_cfg.vocab, cfg.seed)
    floor = source.entropy_floor(cfg.seq)

    started = time.perf_counter()
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(cfg.seed))
    step_fn = program.compile_step()
    compile_s = time.perf_counter() - started

    devices = layout.mesh.devices.size
    tokens = cfg.batch * cfg.seq
    flops = train_flops_per_token(layout.skeleton.model_cfg, cfg.seq) * tokens
    peak = peak_tflops(layout.mesh.devices.flat[0].device_kind)
    for line in describe_run(cfg, layout, program, floor, compile_s):
        log(line)

    metrics_file = open(cfg.metrics_file, "w") if cfg.metrics_file else None
    records: list[dict] = []
    pending: list[dict] = []
    in_flight: deque = deque()
    window_start = time.perf_counter()
    batches = Prefetcher(lambda k: global_batch(source, k, cfg.batch, cfg.seq + 1, layout.batch_sharding),
                         0, cfg.steps)
    try:
        for step in range(cfg.steps):
            state, metrics = step_fn(state, batches.next())
            pending.append(metrics)
            in_flight.append(metrics["loss"])
            if len(in_flight) > MAX_STEPS_IN_FLIGHT:
                in_flight.popleft().block_until_ready()  # a step already behind: no stall
            if (step + 1) % cfg.log_every and step + 1 != cfg.steps:
                continue
            fetched = jax.device_get(pending)
            now = time.perf_counter()
            step_time = (now - window_start) / len(fetched)
            first = step + 1 - len(fetched)
            for i, m in enumerate(fetched):
                record = {
                    "step": first + i,
                    "loss": float(m["loss"]),
                    "grad_norm": float(m["grad_norm"]),
                    "lr": float(m["lr"]),
                    "step_time_s": step_time,
                    "tokens_per_sec": tokens / step_time,
                    "tflops_per_device": flops / step_time / devices / 1e12,
                }
                if peak:
                    record["mfu"] = record["tflops_per_device"] / peak
                records.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
            if metrics_file:
                metrics_file.flush()
            log(_log_line(records[-1], cfg.steps, np.mean([r["loss"] for r in records[first:]])))
            pending, window_start = [], now
    finally:
        batches.close()
        if metrics_file:
            metrics_file.close()

    if records:
        last = np.mean([r["loss"] for r in records[-min(cfg.log_every, len(records)):]])
        log(f"done: final loss {last:.4f} nats/token (mean of the last log window); "
            f"synthetic floor {floor:.4f}; gap {last - floor:+.4f}")
    return records, state


def _log_line(r: dict, steps: int, window_loss: float) -> str:
    done = r["step"] + 1
    mfu = f"  mfu {r['mfu']:.1%}" if "mfu" in r else ""
    return (f"[{done:>{len(str(steps))}}/{steps} {done / steps:4.0%}] loss {window_loss:.4f}  "
            f"grad_norm {r['grad_norm']:.3f}  lr {r['lr']:.2e}  {r['tokens_per_sec']:,.0f} tok/s  "
            f"{r['step_time_s'] * 1e3:.1f} ms/step  {r['tflops_per_device']:.3f} TFLOP/s/device{mfu}")


if __name__ == "__main__":
    sys.exit(main())
