"""spmd.plan against theory: measured / theoretical collective bytes and state bytes.

For each layout the real train step is compiled for abstract shapes on emulated CPU
devices (nothing is allocated); its optimized HLO gives the collectives' bytes per
device per step, XLA's memory analysis the state each device holds. Theory comes from
shapes, dtypes and shardings alone (spmd/planner/theory.py, DESIGN.md section 8).
Goal: every ratio between 0.95 and 1.05.

    python benchmarks/plan_ratios.py
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 64)

from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.parallel.layout import make_layout  # noqa: E402
from spmd.planner.plan import make_plan  # noqa: E402

TINY = dict(model="tiny", batch=32, seq=32)
LAYOUTS = [
    # (name, devices, config)
    ("DP", 8, dict(TINY, mesh="dp=8")),
    ("ZeRO-1", 8, dict(TINY, mesh="dp=8", zero=1)),
    ("ZeRO-3 (dp)", 8, dict(TINY, mesh="dp=8", zero=3)),
    ("FSDP", 8, dict(TINY, mesh="fsdp=8")),
    ("TP", 4, dict(TINY, mesh="tp=4")),
    ("HSDP", 8, dict(TINY, mesh="dp=2,fsdp=4")),
    ("HSDP + ZeRO-1", 8, dict(TINY, mesh="dp=4,fsdp=2", zero=1)),
    ("3-D dp,fsdp,tp", 8, dict(TINY, mesh="dp=2,fsdp=2,tp=2")),
    ("3-D + grad-accum 4", 8, dict(TINY, mesh="dp=2,fsdp=2,tp=2", grad_accum=4)),
    ("FSDP+TP, remat full", 8, dict(TINY, mesh="fsdp=4,tp=2", remat="full")),
    ("3-D, bf16", 8, dict(TINY, mesh="dp=2,fsdp=2,tp=2", dtype="bfloat16")),
    ("sp=4 ring", 4, dict(TINY, mesh="sp=4")),
    ("sp=4 all-gather", 4, dict(TINY, mesh="sp=4", attention="all-gather")),
    ("dp,fsdp,sp ring", 8, dict(TINY, mesh="dp=2,fsdp=2,sp=2")),
    ("Megatron-SP tp=2", 2, dict(TINY, mesh="tp=2", megatron_sp=True)),
    ("Megatron-SP sp=2,tp=2", 4, dict(TINY, mesh="sp=2,tp=2", megatron_sp=True)),
    ("sp=2 + grad-accum 2", 4, dict(TINY, mesh="dp=2,sp=2", grad_accum=2)),
    ("tp=8 > 4 kv heads", 8, dict(TINY, mesh="tp=8")),
    ("fsdp=2,tp=8 > kv, accum 2", 16, dict(TINY, mesh="fsdp=2,tp=8", grad_accum=2)),
    ("MoE ep=2 + grad-accum 2", 2, dict(TINY, model="moe-tiny", mesh="ep=2", grad_accum=2)),
    ("MoE sp=2,ep=2 capacity", 4, dict(TINY, model="moe-tiny", mesh="sp=2,ep=2", moe_dispatch="capacity")),
    ("pp=2,ep=2 MoE", 4, dict(TINY, model="moe-tiny", layers=4, mesh="pp=2,ep=2")),
    ("pp=2,ep=2,dp=2 ZeRO-1 MoE", 8, dict(TINY, model="moe-tiny", layers=4, mesh="pp=2,ep=2,dp=2", zero=1)),
    ("pp=2,sp=2", 4, dict(TINY, mesh="pp=2,sp=2")),
    ("pp=2,tp=2 Megatron-SP", 4, dict(TINY, mesh="pp=2,tp=2", megatron_sp=True)),
    ("llama3-8b fsdp=8,tp=8 bf16", 64,
     dict(model="llama3-8b", batch=64, seq=2048, mesh="fsdp=8,tp=8", dtype="bfloat16", remat="full")),
    ("llama3-8b HSDP+ZeRO-1 bf16", 8,
     dict(model="llama3-8b", batch=16, seq=2048, mesh="dp=4,fsdp=2", zero=1, dtype="bfloat16", remat="dots")),
]
OPS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def main() -> int:
    names = [name for name, _, _ in LAYOUTS if len(sys.argv) < 2 or any(a in name for a in sys.argv[1:])]
    header = f"{'layout':30}{'collectives':>12}" + "".join(f"{op:>20}" for op in OPS) + f"{'state':>8}  unexpected"
    print("measured / theory, bytes per device per step\n" + header)
    worst = 0.0
    for name, devices, overrides in LAYOUTS:
        if name not in names:
            continue
        cfg = validate(TrainConfig(**overrides))
        plan = make_plan(cfg, make_layout(cfg, jax.devices()[:devices]))
        measured = sum(r.measured for r in plan.rows if r.theory)
        theory = sum(r.theory for r in plan.rows)
        per_op = []
        for op in OPS:
            m = sum(r.measured for r in plan.rows if r.op == op and r.theory)
            t = sum(r.theory for r in plan.rows if r.op == op)
            per_op.append(f"{m / t:20.3f}" if t else f"{'-':>20}")
            worst = max(worst, abs(m / t - 1) if t else 0.0)
        state = plan.measured_state / plan.theory_state
        worst = max(worst, abs(measured / theory - 1) if theory else 0.0, abs(state - 1))
        unexpected = ", ".join(f"{r.op} {r.axes}" for r in plan.rows if r.unexpected) or "none"
        total = f"{measured / theory:12.3f}" if theory else f"{'-':>12}"
        print(f"{name:30}{total}{''.join(per_op)}{state:8.3f}  {unexpected}")
    print(f"\nlargest deviation from 1: {worst:.4f} (goal: within 0.05)")
    print("collectives counts only rows the theory expects; scalar reductions (loss, norms) under 1 KiB are "
          "listed by spmd.plan, not counted here")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
