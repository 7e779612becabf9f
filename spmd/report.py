"""What a run prints before its first step: the layout and what each device holds."""

from __future__ import annotations

from spmd.layout import bytes_per_device


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def state_bytes_per_device(program) -> dict[str, int]:
    state = program.abstract_state
    return {
        "params": bytes_per_device(state["params"]),
        "opt_state": bytes_per_device(state["opt_state"]),
    }


def describe_run(cfg, layout, program, floor: float, compile_s: float) -> list[str]:
    devices = layout.mesh.devices
    kind = devices.flat[0].device_kind
    held = state_bytes_per_device(program)
    skel = layout.skeleton
    return [
        f"mesh: {layout.describe()} over {devices.size} x {kind} "
        f"(axes {', '.join(f'{a}={n}' for a, n in layout.shape.items())})",
        f"model: {cfg.model}, {skel.num_params:,} parameters, compute {cfg.dtype}, remat {cfg.remat}",
        f"batch: {cfg.batch} x {cfg.seq} tokens, grad-accum {cfg.grad_accum}, zero {cfg.zero}",
        f"state per device: params {human_bytes(held['params'])}, optimizer {human_bytes(held['opt_state'])}, "
        f"total {human_bytes(sum(held.values()))}",
        f"data: synthetic Markov chain (seed {cfg.seed}), floor {floor:.4f} nats/token",
        f"ready in {compile_s:.1f} s (initialize or restore, then compile)",
    ]
