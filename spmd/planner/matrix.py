"""The layouts of what combines, generated: one small run for each pair and each triple of
FEATURES (spmd.parallel.checks; two devices per axis it names), so that the plan is held
against XLA on every combination (benchmarks/plan_ratios.py, tests/test_plan.py), and a
plan's rows as ratios of measured to theory."""

from __future__ import annotations

import itertools

from spmd.parallel.checks import FEATURES, REFUSED
from spmd.parallel.mesh import AXES
from spmd.planner.counting import SMALL_BYTES

MOE_FEATURES = {"MoE", "capacity", "expert balancing"}


def example(names) -> tuple[dict, int]:
    """TrainConfig fields of a tiny run that uses exactly the features `names`, and its
    device count (2 per mesh axis named)."""
    mesh = [axis for axis in AXES if axis in names]
    fields: dict = {"model": "tiny", "batch": 64, "seq": 32, "mesh": ",".join(f"{a}=2" for a in mesh) or "dp=1"}
    if MOE_FEATURES & set(names):
        fields |= {"model": "moe-tiny", "layers": 4}
    if "expert balancing" in names:
        fields["router_bias_rate"] = 0.001
    if "capacity" in names:
        fields["moe_dispatch"] = "capacity"
    if "grad-accum" in names:
        fields["grad_accum"] = 2
    if "Megatron-SP" in names:
        fields["megatron_sp"] = True
    if "ZeRO" in names:
        fields["zero"] = 1
    if "LoRA" in names:
        fields["lora_rank"] = 4
    return fields, 2 ** len(mesh)


def pairs() -> list[tuple[str, dict, int]]:
    """(name, TrainConfig fields, devices) of every pair of features that combines."""
    return combinations(2)


def triples() -> list[tuple[str, dict, int]]:
    """The same of every triple (of up to 8 devices)."""
    return combinations(3)


def combinations(size: int) -> list[tuple[str, dict, int]]:
    return [("+".join(names), *example(names)) for names in itertools.combinations(FEATURES, size)
            if not any(refused <= frozenset(names) for refused in REFUSED)]


def ratios(plan) -> dict[str, float]:
    """Measured / theory of each collective row the theory expects and of the state;
    an unexpected collective (one the theory has no row for) counts as infinitely off.
    Rows under 1 KiB in all are scalars and vectors (the loss, a norm scale's gradient)
    that XLA folds into whichever reduction comes next: listed by spmd.plan, not held here."""
    out = {f"{r.op} {r.axes}": r.measured / r.theory for r in plan.rows
           if r.theory and max(r.theory, r.measured) >= SMALL_BYTES}
    out |= {f"{r.op} {r.axes} (unexpected)": float("inf") for r in plan.rows if r.unexpected}
    out["state"] = plan.measured_state / plan.theory_state
    return out
