"""What a run prints before its first step: the layout and what each device holds."""

from __future__ import annotations

import jax

from spmd.base.console import human_bytes
from spmd.parallel import kernels
from spmd.planner.roofline import crosses_nodes


def describe_run(cfg, layout, plan, data: str, compile_s: float) -> list[str]:
    devices = layout.mesh.devices
    kind = devices.flat[0].device_kind
    skel = layout.skeleton
    return [
        f"mesh: {layout.describe()} over {devices.size} x {kind} "
        f"(axes {', '.join(f'{a}={n}' for a, n in layout.shape.items())})",
        f"model: {cfg.model.name}, {skel.num_params:,} parameters{_trained(skel)}, compute {cfg.model.dtype}, "
        f"remat {cfg.model.remat}, "
        f"attention kernel {kernels.describe(cfg.model.attention_kernel, devices.flat[0])}",
        f"batch: {cfg.training.batch} x {cfg.training.seq} tokens, grad-accum {cfg.training.grad_accum}, "
        f"zero {cfg.parallelism.zero}",
        f"data: {data}",
        *plan_summary(plan),
        f"ready in {compile_s:.1f} s (initialize or restore, then compile)",
    ]


def _trained(skeleton) -> str:
    """Which parameters train, when not all do (LoRA)."""
    if not skeleton.lora:
        return ""
    trained = sum(s.size for s in jax.tree.leaves(skeleton.trained(skeleton.shapes)))
    return f" ({trained:,} of them trained: LoRA rank {skeleton.lora.rank} on {', '.join(skeleton.lora.targets)})"


# ----------------------------------------------------------------------------- spmd.plan

_MEMORY_ROWS = (("params", "parameters"), ("opt_state", "optimizer state"), ("gradients", "gradients"),
                ("gathered_weights", "gathered layers"), ("gathered_head", "gathered head"),
                ("activations", "activations kept"), ("working", "a layer's working set"),
                ("logits", "logits"), ("predictions", "multi-token prediction"),
                ("exchange_pool", "ragged exchange's pool"))
_XLA_ROWS = (("argument", "arguments"), ("output", "outputs"), ("alias", "  of which aliased"),
             ("temp", "temporaries"))
_ALL_REDUCE_NOTE = ("* in part or whole compiled as all-reduce + dynamic-slice (XLA:CPU and XLA:TPU; XLA:GPU "
                    "where it combines small sums); the reduce-scatter they amount to is shown")


def _ratio(r) -> str:
    if r.ratio is not None:
        return f"{r.ratio:5.2f}"
    return "unexpected" if r.unexpected else "small"


def plan_table(plan) -> list[str]:
    cfg = plan.cfg
    lines = [f"plan: {cfg.model.name} on {plan.layout.describe()} ({plan.devices} devices; compiled for "
             f"{plan.planned_on}), batch {cfg.training.batch} x {cfg.training.seq}, {cfg.model.dtype}, "
             f"zero {cfg.parallelism.zero}, remat {cfg.model.remat}, grad-accum {cfg.training.grad_accum}", "",
             f"{'memory per device':28}{'theory':>12}{'XLA':>12}"]
    for key, label in _MEMORY_ROWS:
        if key in ("predictions", "exchange_pool") and not plan.theory_memory[key]:
            continue
        lines.append(f"  {label:26}{human_bytes(plan.theory_memory[key]):>12}")
    measured = human_bytes(plan.measured_state) if plan.measured_state is not None else "-"
    lines.append(f"  {'state (params + optimizer)':26}{human_bytes(plan.theory_state):>12}{measured:>12}")
    if plan.full_state is not None:
        lines.append(f"  {'  as a full fine-tune':26}{human_bytes(plan.full_state):>12}"
                     f"{'':>12}  LoRA holds {plan.theory_state / plan.full_state:.1%} of it")
    if plan.xla:
        for key, label in _XLA_ROWS:
            lines.append(f"  {label:26}{'':>12}{human_bytes(plan.xla[key]):>12}")
    lines.append(f"  {'peak':26}{human_bytes(plan.theory_peak):>12}"
                 f"{human_bytes(plan.xla['peak']) if plan.xla else '-':>12}")
    lines.append("    theory's: the state and every part at once (pipeline stages run forwards and backwards "
                 "together), but the higher of a layer's working set and the logits" if plan.layout.schedule
                 else "    theory's: the state and the higher of the loss (kept, logits, head) and the layers' "
                 "backward pass (kept, gradients, a layer's working set, its gathered weights and their unreduced "
                 "gradients)")
    if plan.theory_memory["exchange_pool"]:
        lines[-1] += "; and beside them XLA:GPU's pool for the ragged exchange's results"
    lines.append(verdict(plan))
    overlap = plan.asynchronous  # the compiler scheduled each collective's start and done: show what runs under compute
    lines += ["", f"{'communication per step':30}{'count':>7}{'per device':>13}{'theory':>13}{'ratio':>11}"
              + (f"{'under compute':>15}" if overlap else "")]
    for r in plan.rows:
        star = " *" if r.from_all_reduce else ""
        under = f"{r.overlapped / r.measured:>15.0%}" if overlap and r.measured else ""
        lines.append(f"  {r.op + ' ' + r.axes + star:28}{r.count:>7}{human_bytes(r.measured):>13}"
                     f"{human_bytes(r.theory) if r.theory else '-':>13}{_ratio(r):>11}{under}")
    if not plan.rows:
        lines.append("  none: every device works alone")
    if any(r.from_all_reduce for r in plan.rows):
        lines.append("  " + _ALL_REDUCE_NOTE)
    if any(r.unexpected for r in plan.rows):
        lines.append("  unexpected: collectives the theory of this layout does not account for (see spmd/planner/theory.py)")
    if overlap:
        lines.append("  under compute: of the bytes, those of collectives with compute scheduled between their start "
                     "and done")
    if plan.kernels:
        lines.append("fused kernels in the step: " + ", ".join(f"{n} {t}" for t, n in sorted(plan.kernels.items())))
    if plan.prediction:
        lines += ["", *roofline_lines(plan)]
    return lines


def verdict(plan) -> str:
    if plan.hardware is None:
        return f"peak {human_bytes(plan.peak)}; give --hardware (spmd/base/hardware.toml) to check the fit"
    hw, spare = plan.hardware, plan.usable - plan.peak
    where = f"{hw.name} ({human_bytes(plan.usable)} per device)"
    peak = f"peak {human_bytes(plan.peak)}" + (" (theory: XLA:CPU keeps bf16 temporaries in float32)"
                                               if plan.fit_basis == "theory" and plan.xla else "")
    if spare >= 0:
        return f"fits on {where}: {peak}, {human_bytes(spare)} to spare"
    return f"DOES NOT FIT on {where}: {peak}, over by {human_bytes(-spare)}"


def roofline_lines(plan) -> list[str]:
    p, hw = plan.prediction, plan.hardware
    parts = []
    for axes, seconds in sorted(p.comm_s.items(), key=lambda kv: -kv[1]):
        link = "inter-node" if crosses_nodes(axes, plan.layout.shape, hw.devices_per_node) else "intra-node"
        exposed = p.exposed_by_axes.get(axes, 0.0)
        hidden = ("overlapped" if not exposed else "exposed" if exposed >= seconds
                  else f"{_seconds(exposed)} of it exposed")
        parts.append(f"{axes} {_seconds(seconds)} ({link}, {hidden})")
    return [f"roofline on {hw.description} ({hw.peak_flops(plan.cfg.model.dtype) / 1e12:g} TFLOP/s "
            f"{plan.cfg.model.dtype}): compute {_seconds(p.compute_s)}"
            + (f"; communication {', '.join(parts)}" if parts else ""),
            f"predicted step {_seconds(p.step_s)}, MFU {100 * p.mfu:.1f}% (at peak FLOP/s: an upper bound)"]


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def auto_table(plans) -> list[str]:
    first = plans[0]
    lines = [f"fastest layouts that fit: {first.cfg.model.name} on {first.devices} x {first.hardware.name}, "
             f"batch {first.cfg.training.batch} x {first.cfg.training.seq}, {first.cfg.model.dtype}"]
    for i, plan in enumerate(plans, 1):
        p = plan.prediction
        exposed = f", exposed communication {_seconds(p.exposed_s)}" if p.exposed_s else ""
        lines.append(f"{i}. --mesh {plan.layout.describe()} --zero {plan.cfg.parallelism.zero} "
                     f"--remat {plan.cfg.model.remat}: step {_seconds(p.step_s)}, MFU {100 * p.mfu:.1f}%")
        lines.append(f"   why: peak {human_bytes(plan.peak)} of {human_bytes(plan.usable)}; compute "
                     f"{_seconds(p.compute_s)}, overlapped communication {_seconds(p.overlapped_s)}{exposed}")
    return lines


def plan_summary(plan) -> list[str]:
    """The compact version printed at the start of every training run."""
    mem = plan.theory_memory
    full = "" if plan.full_state is None else f"; a full fine-tune: {human_bytes(plan.full_state)}"
    lines = [f"state per device: params {human_bytes(mem['params'])}, optimizer {human_bytes(mem['opt_state'])} "
             f"(XLA: {human_bytes(plan.measured_state or 0)} in all{full}); {verdict(plan)}"]
    shown = [r for r in plan.rows if r.count and (r.theory or r.unexpected)]
    lines += [f"  {r.op} {r.axes}{' *' if r.from_all_reduce else ''}: {r.count} per step, {human_bytes(r.measured)}"
              f" (theory {human_bytes(r.theory) if r.theory else '-'}, {_ratio(r).strip()})" for r in shown]
    if any(r.from_all_reduce for r in shown):
        lines.append("  " + _ALL_REDUCE_NOTE)
    if plan.prediction:
        lines.append("  " + roofline_lines(plan)[1])
    return lines
