"""The plan of a layout (`python -m spmd.plan`): before launch, what each device holds and
what crosses the wire.

It trains nothing and allocates no arrays: it compiles the real train step for abstract
shapes on the requested mesh (on emulated CPU devices when the machine has fewer) and
sets XLA's memory analysis and the collectives of the optimized HLO next to the theory
of `spmd.planner.theory`. With a hardware entry it predicts the step time (`spmd.planner.roofline`);
`--auto` searches the layouts of a device count for the fastest that fit.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from models import model_class

from spmd.base import hardware
from spmd.base.errors import UserError
from spmd.parallel.layout import make_layout
from spmd.parallel.mesh import accelerator_present, keep_unused_plugins_out
from spmd.parallel.options import step_options
from spmd.parallel.step import build_program
from spmd.planner import footprint, hlo, theory, traffic
from spmd.planner.counting import SMALL_BYTES, by_op_and_axes
from spmd.planner.roofline import predict

AUTO_SHOWN = 5
AUTO_MAX_COMPILES = 12


@dataclasses.dataclass(frozen=True)
class Row:
    """One (collective, mesh axes) line: measured next to theory."""

    op: str
    axes: str
    count: int
    measured: float
    theory: float
    from_all_reduce: bool
    overlapped: float = 0.0  # of measured: bytes of asynchronous collectives with compute scheduled under them

    @property
    def ratio(self) -> float | None:
        return self.measured / self.theory if self.theory else None

    @property
    def unexpected(self) -> bool:
        return not self.theory and self.measured >= SMALL_BYTES * max(self.count, 1)


@dataclasses.dataclass
class Plan:
    cfg: object
    layout: object
    planned_on: str  # what XLA compiled for
    hardware: object | None
    theory_memory: dict[str, float]
    xla: dict[str, int] | None  # argument, output, alias, temp, peak bytes per device
    batch_bytes: int  # the batch's share of the arguments
    rows: list[Row]
    prediction: object | None
    full_state: float | None = None  # a LoRA run's: the state of a full fine-tune of its model on its mesh
    asynchronous: bool = False  # the compiler split collectives into start and done (XLA:GPU)
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # fused kernels' custom calls, per target

    @property
    def devices(self) -> int:
        return math.prod(self.layout.shape.values())

    @property
    def theory_state(self) -> float:
        return self.theory_memory["params"] + self.theory_memory["opt_state"]

    @property
    def measured_state(self) -> float | None:
        return self.xla["argument"] - self.batch_bytes if self.xla else None

    @property
    def fit_basis(self) -> str:
        """Which peak the verdict trusts: XLA's, except for a bf16 step compiled on CPU
        for an accelerator (XLA:CPU keeps bf16 temporaries in float32, measured at
        about the same size as a float32 step's), or when XLA reports none."""
        on_cpu = self.layout.mesh.devices.flat[0].platform == "cpu"
        targets_accelerator = self.hardware is not None and self.hardware.name != "cpu"
        if self.xla is None or (on_cpu and targets_accelerator and self.cfg.model.dtype == "bfloat16"):
            return "theory"
        return "xla"

    @property
    def theory_peak(self) -> float:
        return footprint.peak(self.cfg, self.layout, self.theory_memory)

    @property
    def peak(self) -> float:
        return self.xla["peak"] if self.fit_basis == "xla" else self.theory_peak

    @property
    def usable(self) -> float | None:
        return self.hardware.memory_bytes(self.devices) if self.hardware else None

    @property
    def fits(self) -> bool | None:
        return None if self.hardware is None else self.peak <= self.usable

    def theory_by_op(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.rows:
            out[r.op] = out.get(r.op, 0.0) + r.theory
        return {op: round(b) for op, b in out.items() if b}

    def as_json(self) -> dict:
        cfg = self.cfg
        return {
            "model": cfg.model.name, "mesh": self.layout.describe(), "devices": self.devices,
            "batch": cfg.training.batch, "seq": cfg.training.seq, "dtype": cfg.model.dtype,
            "zero": cfg.parallelism.zero, "remat": cfg.model.remat,
            "grad_accum": cfg.training.grad_accum, "planned_on": self.planned_on,
            "hardware": self.hardware.name if self.hardware else None,
            "per_device": {
                "state_bytes": round(self.theory_state),
                "full_fine_tune_state_bytes": None if self.full_state is None else round(self.full_state),
                "measured_state_bytes": self.measured_state,
                "theory": {k: round(v) for k, v in self.theory_memory.items()},
                "theory_peak_bytes": round(self.theory_peak),
                "xla": {f"{k}_bytes": v for k, v in self.xla.items()} if self.xla else None,
                "peak_bytes": round(self.peak),
                "peak_from": self.fit_basis,
                "usable_bytes": round(self.usable) if self.usable else None,
            },
            "fused_kernel_calls": self.kernels,
            "collectives": [{"op": r.op, "axis": r.axes, "count": r.count, "bytes_per_device": round(r.measured),
                             "theory_bytes_per_device": round(r.theory),
                             **({"under_compute_bytes": round(r.overlapped)} if self.asynchronous else {}),
                             **({"from_all_reduce_and_slice": True} if r.from_all_reduce else {}),
                             **({"unexpected": True} if r.unexpected else {})}
                            for r in self.rows if r.count],
            "theory": {"collective_bytes_per_device": self.theory_by_op(),
                       "collectives": [{"op": r.op, "axis": r.axes, "bytes_per_device": round(r.theory)}
                                       for r in self.rows if r.theory]},
            "fits": self.fits,
            "predicted_step_time_s": self.prediction.step_s if self.prediction else None,
            "predicted_mfu": self.prediction.mfu if self.prediction else None,
            "roofline": self.prediction.as_json() if self.prediction else None,
        }


def compare(measured, expected) -> list[Row]:
    """Measured traffic (spmd.planner.traffic) and theory (spmd.planner.theory) side by side, per (op, axes),
    the largest first."""
    theory = by_op_and_axes(expected)
    rows = {key: Row(*key, 0, 0.0, bytes_, False) for key, bytes_ in theory.items()}
    for t in measured:
        row = rows.get((t.op, t.axes)) or Row(t.op, t.axes, 0, 0.0, 0.0, False)
        rows[(t.op, t.axes)] = dataclasses.replace(row, count=row.count + t.count,
                                                   measured=row.measured + t.bytes_per_device,
                                                   from_all_reduce=row.from_all_reduce or t.from_all_reduce,
                                                   overlapped=row.overlapped + t.overlapped)
    return sorted(rows.values(), key=lambda r: (-max(r.measured, r.theory), r.op, r.axes))


def make_plan(cfg, layout, compiled=None, hardware=None, planned_on: str | None = None, program=None,
              program_shape=None) -> Plan:
    """Compile the step for abstract shapes (unless given the compiled step) and compare.
    `program_shape`: the mesh the compiled program's device ids span, where it is not the
    whole mesh (a TPU multislice program is one slice's)."""
    program = program or build_program(step_options(cfg), layout)
    if compiled is None:
        compiled = program.compile_step()
    xla = xla_memory(compiled.memory_analysis(), layout.mesh.devices.flat[0].platform)
    module = hlo.parse(compiled.as_text())
    measured = traffic.step_traffic(module, program_shape or layout.shape)
    rows = compare(measured, theory.collectives(cfg, layout))
    # The batch's arrays (tokens; of packed rows also segment ids and loss masks), per device.
    batch_bytes = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                      for a in jax.tree.leaves(program.batch_struct))
    prediction = None
    if hardware is not None:
        prediction = predict(cfg, layout.shape, layout.skeleton.model_cfg,
                             [(r.op, r.axes, r.measured) for r in rows], hardware)
    kind = layout.mesh.devices.flat[0].device_kind
    return Plan(cfg, layout, planned_on or kind, hardware, footprint.memory(cfg, layout), xla, batch_bytes,
                rows, prediction, full_fine_tune_state(cfg, layout), hlo.is_async(module), hlo.fused_kernels(module))


def xla_memory(stats, platform: str) -> dict | None:
    """XLA's memory figures of a compiled step (None where it gives none), with its peak.
    XLA:TPU's peak is its own (`peak_memory_in_bytes`, the heap of arguments and
    temporaries), as its temporaries' size also counts the values that reuse the
    arguments' memory (llama3-8b on v5p-32: peak 16.6 GiB, arguments 5.6 + temporaries
    14.9). Elsewhere the sizes are summed: XLA:GPU's own peak leaves out the pool of the
    ragged exchange's results, a memory space of its own (3.4 GiB on Qwen3-30B-A3B's
    preset), and XLA:CPU's counts the arguments alone."""
    if stats is None:
        return None
    xla = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
           "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
    summed = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    xla["peak"] = stats.peak_memory_in_bytes if platform == "tpu" else summed
    return xla


def full_fine_tune_state(cfg, layout) -> float | None:
    """What a LoRA run's state would be per device as a full fine-tune of the same model on
    the same mesh (theory); None for a full fine-tune."""
    if not layout.skeleton.lora:
        return None
    full = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, lora_rank=None))
    memory = footprint.memory(full, make_layout(full, list(layout.mesh.devices.flat), for_training=False))
    return memory["params"] + memory["opt_state"]


# ----------------------------------------------------------------------------- devices

def plan_devices(count: int):
    """`count` devices to compile for: the real accelerators if there are enough, else
    emulated CPU devices (set up before JAX starts its backends). -> (devices, label)"""
    keep_unused_plugins_out()
    try:
        jax.config.update("jax_num_cpu_devices", max(count, 1))
    except RuntimeError:  # JAX already started (a notebook): use what it has
        pass
    if accelerator_present():
        real = jax.devices()
        if len(real) >= count and real[0].platform != "cpu":
            return real[:count], real[0].device_kind
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise UserError(f"planning needs {count} devices, but JAX already started with {len(cpus)} CPU devices; "
                        "set the device count before using JAX")
    return cpus[:count], f"{count} emulated CPU devices"


def default_hardware(parallelism, devices):
    """--hardware's accelerator (the parallelism section's), else the one `devices` are."""
    if parallelism.hardware:
        return hardware.get(parallelism.hardware)
    return hardware.detect(devices[0].device_kind)


# ----------------------------------------------------------------------------- --auto

def candidates(cfg, count: int, devices_per_node: int):
    """Meshes over dp, fsdp and tp (tp inside a node), ZeRO 0 or 1 where dp > 1, each remat
    of the model's."""
    for tp in (d for d in range(1, count + 1) if count % d == 0 and d <= devices_per_node):
        for fsdp in (d for d in range(1, count // tp + 1) if (count // tp) % d == 0):
            dp = count // (tp * fsdp)
            mesh = ",".join(f"{a}={n}" for a, n in (("dp", dp), ("fsdp", fsdp), ("tp", tp)) if n > 1)
            for zero in ((0, 1) if dp > 1 else (0,)):
                for remat in model_class(cfg.model_cfg).REMAT:
                    yield dataclasses.replace(cfg,
                                              parallelism=dataclasses.replace(cfg.parallelism, mesh=mesh, zero=zero),
                                              model=dataclasses.replace(cfg.model, remat=remat))


def auto(cfg, devices, hardware, planned_on: str) -> tuple[list[Plan], str]:
    """Rank every candidate layout by its theoretical step time among those whose
    theoretical peak fits, then compile the best until five are confirmed by XLA.
    -> (plans, a line saying what was searched)"""
    ranked, indivisible, too_big = [], 0, 0
    for c in candidates(cfg, len(devices), hardware.devices_per_node):
        try:
            layout = make_layout(c, devices)
        except UserError:
            indivisible += 1
            continue
        if footprint.peak(c, layout, footprint.memory(c, layout)) > hardware.memory_bytes(len(devices)):
            too_big += 1
            continue
        expected = [(e.op, e.axes, e.bytes_per_device) for e in theory.collectives(c, layout)]
        ranked.append((predict(c, layout.shape, layout.skeleton.model_cfg, expected, hardware).step_s, c, layout))
    ranked.sort(key=lambda r: r[0])
    confirmed, compiled = [], 0
    for _, c, layout in ranked[:AUTO_MAX_COMPILES]:
        plan = make_plan(c, layout, hardware=hardware, planned_on=planned_on)
        compiled += 1
        if plan.fits:
            confirmed.append(plan)
        if len(confirmed) == AUTO_SHOWN:
            break
    searched = (f"searched {len(ranked) + indivisible + too_big} layouts: {indivisible} do not divide the model "
                f"or batch, {too_big} do not fit in theory, {compiled} of the fastest others compiled, "
                f"{len(confirmed)} fit")
    if not confirmed:
        raise UserError(f"model {cfg.model.name} does not fit on {len(devices)} x {hardware.name} in any layout "
                        f"(dp/fsdp/tp, ZeRO 0-1, every remat) at batch {cfg.training.batch} x {cfg.training.seq}; "
                        "use more devices, a smaller batch or --grad-accum")
    return sorted(confirmed, key=lambda p: p.prediction.step_s), searched
