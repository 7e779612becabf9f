"""spmd.plan against theory on every pair and triple of features and the seeds' layouts: measured /
theoretical collective bytes per (collective, mesh axes) row, and state bytes.

For each layout the real train step is compiled for abstract shapes on emulated CPU
devices (nothing is allocated); its optimized HLO gives the collectives' bytes per
device per step, XLA's memory analysis the state each device holds. Theory comes from
shapes, dtypes and shardings alone (spmd/planner/theory.py, DESIGN.md section 8).
The layouts: one tiny run per pair and per triple of spmd.parallel.checks.FEATURES (spmd.planner.matrix),
then the hand-written ones below (3-D, pipelines with MoE, DeepSeek's, llama3-8b).
Goal: every row between 0.95 and 1.05, and no collective the theory does not expect.

    python benchmarks/plan_ratios.py [NAME ...]   # only layouts whose name contains a NAME
    python benchmarks/plan_ratios.py --target h100 [NAME ...]  # compiled by XLA:GPU for H100s (or h200, v5p,
                                                               # v5e, v6e: spmd.plan --target's compilers)

With --target the step is compiled ahead of time for as many accelerators of that kind as
the layout has devices (`spmd.planner.targets.named_for`; a layout no slice holds is
skipped), with the flags spmd.train sets there, and XLA's peak is printed beside the
theory's.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 64)

from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.planner import matrix  # noqa: E402
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
    ("pp=2,fsdp=2 1f1b", 4, dict(TINY, mesh="pp=2,fsdp=2", pp_schedule="1f1b")),
    ("pp=2,ep=2 1f1b MoE", 4, dict(TINY, model="moe-tiny", layers=4, mesh="pp=2,ep=2", pp_schedule="1f1b")),
    ("pp=2,dp=2 1f1b MoE, accum 2", 4, dict(TINY, model="moe-tiny", layers=4, mesh="pp=2,dp=2", pp_schedule="1f1b",
                                             grad_accum=2)),
    ("MoE fsdp=2,ep=2 + grad-accum 2", 4, dict(TINY, model="moe-tiny", mesh="fsdp=2,ep=2", grad_accum=2)),
    ("MoE sp=2,ep=2 + grad-accum 2", 4, dict(TINY, model="moe-tiny", mesh="sp=2,ep=2", grad_accum=2)),
    ("Megatron-SP dp=2,sp=2,tp=2", 8, dict(TINY, mesh="dp=2,sp=2,tp=2", megatron_sp=True)),
    ("llama3-8b fsdp=8,tp=8 bf16", 64,
     dict(model="llama3-8b", batch=64, seq=2048, mesh="fsdp=8,tp=8", dtype="bfloat16", remat="full")),
    ("llama3-8b HSDP+ZeRO-1 bf16", 8,
     dict(model="llama3-8b", batch=16, seq=2048, mesh="dp=4,fsdp=2", zero=1, dtype="bfloat16", remat="dots")),
]
LAYOUTS = [(name, devices, fields) for name, fields, devices in matrix.pairs() + matrix.triples()] + LAYOUTS


def plan_of(cfg, devices: int, kind: str | None):
    """The plan of `cfg` on `devices` emulated CPU devices, or compiled for that many of the
    accelerator `kind` (None: no target holds that many)."""
    if kind is None:
        return make_plan(cfg.step, make_layout(cfg, jax.devices()[:devices]))
    from spmd.planner import targets
    from spmd.run import xla_flags
    from spmd.run.target import compiled_for

    name = targets.named_for(kind, devices)
    if name is None:
        return None
    target = targets.parse(name)
    xla_flags.configure("tpu" if target.platform == "tpu" else "gpu", cfg.model_cfg, cfg.model.dtype,
                        accelerator_type=target.accelerator_type)
    return compiled_for(cfg.replace(hardware=None), target)[1]


def main() -> int:
    args = sys.argv[1:]
    kind = args[args.index("--target") + 1] if "--target" in args else None
    names = [a for i, a in enumerate(args) if a != "--target" and (i == 0 or args[i - 1] != "--target")]
    chosen = [(name, devices, fields) for name, devices, fields in LAYOUTS
              if not names or any(a in name for a in names)]
    print("measured / theory of each row off 0.95-1.05 (bytes per device per step); state: XLA's arguments less "
          "the batch / theory\n")
    rows = worst = 0
    worst_row = None
    for name, devices, fields in chosen:
        cfg = validate(TrainConfig.of(**fields))
        plan = plan_of(cfg, devices, kind)
        if plan is None:
            print(f"{name:34}no {kind} target of {devices} devices", flush=True)
            continue
        ratios = matrix.ratios(plan)
        if kind is not None:
            off_peak = f"  XLA's peak {plan.xla['peak'] / 2**20:.1f} MiB, theory's {plan.theory_peak / 2**20:.1f}"
        else:
            off_peak = ""
        rows += len(ratios)
        off = {row: ratio for row, ratio in ratios.items() if not 0.95 <= ratio <= 1.05}
        for row, ratio in ratios.items():
            if abs(ratio - 1) > worst:
                worst, worst_row = abs(ratio - 1), f"{name}: {row} {ratio:.3f}"
        print(f"{name:34}{len(ratios):3} rows  " + (", ".join(f"{r} {v:.3f}" for r, v in off.items()) or "all 1.00 +- 0.05")
              + off_peak, flush=True)
    print(f"\n{len(chosen)} layouts, {rows} rows; largest deviation from 1: {worst:.4f} ({worst_row}); goal: within 0.05")
    print("rows count collectives the theory expects and any it does not; scalar reductions (loss, norms) under "
          "1 KiB each are listed by spmd.plan, not counted here")
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
