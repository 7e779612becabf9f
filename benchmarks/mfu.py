"""Model FLOP utilization of the train step: achieved model FLOP/s per device over a peak.

On a GPU or TPU the peak is the device's dense bf16 peak (spmd/base/hardware.toml): the MFU.
On the CPU there is no datasheet to trust, so the peak is measured: a plain matmul of the
step's largest per-device shape (its largest weight matrix, split over tp as the step
splits it, times each device's tokens of a microbatch), in the same dtype, run on every
device of the mesh at once (emulated devices share the host's cores, as in the step) and
timed in the same process. That ratio is a roofline fraction.

FLOPs are the log line's (spmd.base.hardware.train_flops_per_token): 6 x the parameters a token
multiplies with + causal attention 6 x layers x heads x head_dim x seq; recomputation
(--remat) is not counted. Only steady-state steps are timed: after compiling and
--warmup-steps steps, --steps steps are dispatched back to back and waited for once at the
end. Rounds of step and matmul windows alternate (this machine's speed drifts), and the
median ratio is printed.

The run is built as spmd.train builds it (options are the trainer's; the XLA flags of
spmd.run.xla_flags are set as the trainer sets them, --no-xla-flags to leave them out):

    python benchmarks/mfu.py --model llama3.2-1b --seq 2048 --batch 16 --dtype bfloat16
    python benchmarks/mfu.py --model small --mesh fsdp=2,tp=2 --seq 256 --batch 8 --steps 5

Defaults here: --mesh dp=1 on the CPU (dp=-1 elsewhere), --steps 10. Keep --steps modest on
emulated CPU devices: a deep queue of steps in flight has deadlocked XLA:CPU's collectives
(see spmd.run.loop.MAX_STEPS_IN_FLIGHT), at about 200.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time


def add_extras(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed windows; the median is printed")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps run before timing (after compiling)")
    parser.add_argument("--no-xla-flags", action="store_true", help="do not set spmd.run.xla_flags' flags")


def with_defaults(argv: list[str], backend: str) -> list[str]:
    """The benchmark's defaults for --mesh and --steps, unless given (or a --config gives them)."""
    from spmd.config import find_config

    if find_config(argv):
        return argv
    given = {arg.split("=", 1)[0] for arg in argv}
    defaults = {"--mesh": "dp=1" if backend == "cpu" else "dp=-1", "--steps": "10"}
    return [item for flag, value in defaults.items() if flag not in given for item in (flag, value)] + argv


def largest_matmul(cfg, layout) -> tuple[str, int, int, int]:
    """(what, M, K, N): the step's largest weight matrix (embed x its widest output, split
    over tp) times the tokens one device multiplies it with in one microbatch."""
    c, shape = layout.skeleton.model_cfg, layout.shape
    outputs = {"mlp": c.mlp, "attention q/o": c.heads * c.head_dim, "head": c.vocab}
    if c.moe is not None:
        outputs["expert mlp"] = c.moe.expert_mlp
    what, width = max(outputs.items(), key=lambda item: item[1])
    rows = cfg.training.batch // cfg.training.grad_accum // layout.batch_shards
    if layout.schedule:
        rows //= cfg.parallelism.microbatches or shape["pp"]
    tokens = max(1, rows * cfg.training.seq // shape["sp"])
    return what, tokens, c.embed, -(-width // shape["tp"])


def matmul_seconds(layout, m: int, k: int, n: int, dtype, seconds: float) -> tuple[float, int]:
    """Seconds per call of (m, k) @ (k, n) on every device at once (rows split over all
    axes, the weight replicated), over a window of about `seconds`; and the calls timed."""
    import jax
    import jax.numpy as jnp

    mesh = layout.mesh
    devices = mesh.devices.size
    rows = jax.NamedSharding(mesh, jax.P(tuple(mesh.axis_names), None))
    x = jax.jit(lambda key: jax.random.normal(key, (devices * m, k), dtype), out_shardings=rows)(jax.random.key(1))
    w = jax.jit(lambda key: jax.random.normal(key, (k, n), dtype) / math.sqrt(k),
                out_shardings=jax.NamedSharding(mesh, jax.P()))(jax.random.key(2))
    matmul = jax.jit(jnp.matmul, out_shardings=rows).lower(x, w).compile()
    for _ in range(2):
        out = matmul(x, w)
    out.block_until_ready()
    start = time.perf_counter()
    matmul(x, w).block_until_ready()
    one = time.perf_counter() - start
    calls = max(3, min(2000, round(seconds / max(one, 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        out = matmul(x, w)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls, calls


def step_seconds(step, state, batches, steps: int):
    """Seconds per step over `steps` steps dispatched back to back, waited for once."""
    import jax

    start = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / steps, state, metrics


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from spmd.run import xla_flags
    from spmd.config import parse_with_extras
    from spmd.base.errors import one_line_errors
    from spmd.parallel.mesh import emulate_cpu_devices

    backend = xla_flags.backend_before_start()
    with one_line_errors():
        cfg, extras = parse_with_extras(with_defaults(argv, backend), prog="python benchmarks/mfu.py",
                                        description=__doc__.splitlines()[0], add_extras=add_extras)
        # Before anything starts JAX's backend, as the trainer does.
        flag_lines = [] if extras.no_xla_flags else xla_flags.configure(
            backend, cfg.model_cfg, cfg.model.dtype, double_buffered=xla_flags.double_buffers(cfg))
        emulate_cpu_devices(cfg.parallelism.mesh_spec.sizes, cfg.parallelism.cpu_devices)
        import jax

        from spmd.parallel import kernels
        from spmd.data.feed import global_batch, make_source
        from spmd.base.hardware import detect, train_flops_per_token
        from spmd.layout import make_layout
        from spmd.parallel.skeleton import DTYPES
        from spmd.parallel.step import build_program

        layout = make_layout(cfg)
    model_cfg = layout.skeleton.model_cfg
    devices = layout.mesh.devices.size
    device = layout.mesh.devices.flat[0]
    on_cpu = device.platform == "cpu"
    for line in flag_lines:
        print(line)
    if extras.no_xla_flags:
        print("XLA flags of spmd.run.xla_flags: not set (--no-xla-flags)")
    print(f"model {cfg.model.name} ({model_cfg.num_params() / 1e6:,.1f}M parameters), batch {cfg.training.batch} x seq "
          f"{cfg.training.seq}, {cfg.model.dtype}, remat {cfg.model.remat}, attention kernel "
          f"{kernels.describe(cfg.model.attention_kernel, device)}; mesh "
          f"{layout.describe()} on {devices} {device.platform} device(s) ({device.device_kind}); jax {jax.__version__}")
    per_token = train_flops_per_token(model_cfg, cfg.training.seq)
    per_step_device = per_token * cfg.training.batch * cfg.training.seq / devices
    print(f"model FLOPs per token {per_token:.4g} = 6 x matmul parameters + causal attention 6 x layers x heads x "
          f"head_dim x seq, recomputation excluded (spmd.base.hardware.train_flops_per_token, as the log line); "
          f"{per_step_device:.4g} per step per device")

    started = time.perf_counter()
    program = build_program(cfg.step, layout)
    step = program.compile_step()
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(cfg.training.seed))
    source = make_source(cfg.data, cfg.training, model_cfg.vocab)
    batches = [global_batch(source, k, cfg.training.batch, cfg.training.seq + 1, layout.batch_sharding)
               for k in range(2)]
    _, state, metrics = step_seconds(step, state, batches, extras.warmup_steps)
    print(f"compiled and warmed up in {time.perf_counter() - started:.1f} s (loss {float(metrics['loss']):.4f})")

    hardware = None if on_cpu else detect(device.device_kind)
    matmul = largest_matmul(cfg, layout) if on_cpu else None
    ratios = []
    for round_ in range(extras.rounds):
        seconds, state, metrics = step_seconds(step, state, batches, cfg.training.steps)
        achieved = per_step_device / seconds
        line = (f"round {round_}: step {seconds * 1e3:.1f} ms, "
                f"{cfg.training.batch * cfg.training.seq / seconds / devices:,.0f} tokens/s and "
                f"{achieved / 1e12:.4g} TFLOP/s per device")
        if on_cpu:
            what, m, k, n = matmul
            per_call, calls = matmul_seconds(layout, m, k, n, DTYPES[cfg.model.dtype], seconds * cfg.training.steps)
            peak = 2 * m * k * n / per_call
            ratios.append(achieved / peak)
            line += (f"; matmul ({m}x{k} @ {k}x{n}, {what}, {cfg.model.dtype}, x{calls}) {peak / 1e12:.4g} TFLOP/s per "
                     f"device: roofline fraction {ratios[-1]:.3f}")
        elif hardware is not None:
            ratios.append(achieved / (hardware.bf16_tflops * 1e12))
            line += f": MFU {ratios[-1]:.1%}"
        print(line)
    stats = None if on_cpu else device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        print(f"peak device memory {stats['peak_bytes_in_use'] / 2**30:.1f} GiB of {stats.get('bytes_limit', 0) / 2**30:.1f}")
    if (xla := step.memory_analysis()) is not None:  # what the compiler planned, beside what the device held
        planned = xla.argument_size_in_bytes + xla.output_size_in_bytes - xla.alias_size_in_bytes + xla.temp_size_in_bytes
        print(f"XLA's own peak for the step {planned / 2**30:.1f} GiB (arguments + outputs - aliased + "
              f"temporaries {xla.temp_size_in_bytes / 2**30:.1f} GiB)")
    if not math.isfinite(float(metrics["loss"])):
        print(f"warning: the loss is {float(metrics['loss'])}")
    if on_cpu:
        print(f"roofline fraction (train step / a plain matmul of its largest per-device shape, both per device, "
              f"measured here): median {statistics.median(ratios):.3f}")
    elif hardware is not None:
        print(f"MFU (model FLOP/s per device / {hardware.description}'s {hardware.bf16_tflops:g} TFLOP/s dense "
              f"bf16 peak): median {statistics.median(ratios):.1%}")
    else:
        print(f"no peak known for {device.device_kind!r} (spmd/base/hardware.toml): achieved FLOP/s only")


if __name__ == "__main__":
    main()
