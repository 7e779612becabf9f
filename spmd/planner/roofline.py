"""A roofline estimate of one step on named hardware: compute time from FLOPs and peak,
communication time per mesh axis from bytes and link bandwidth.

- Compute runs at the hardware's peak for the compute dtype, on the FLOPs the step
  executes (the model's, plus the forward recomputed under remat), split evenly over
  the devices. Real steps reach a fraction of peak, so this is an optimistic bound.
- A collective over mesh axes stays inside a node (NVLink, TPU ICI) when the devices of
  one group fit in a node: the mesh puts inner axes on neighbouring devices, so that is
  when the product of the sizes from its outermost axis to `tp` is at most the node's
  device count. Otherwise it crosses nodes (InfiniBand, DCN).
- Weight gathers and gradient reductions over the batch axes overlap with compute (XLA
  schedules them asynchronously, a layer ahead); activation collectives (tp, sp, ep's
  all-to-all) sit on the critical path. Step time = max(compute, overlapped) + exposed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from spmd.base.hardware import Hardware, train_flops_per_token
from spmd.parallel.mesh import AXES
from spmd.parallel.pipeline import Schedule
from spmd.planner.traffic import mesh_axes

OVERLAPPED_AXES = {"dp", "fsdp", "ep"}


@dataclasses.dataclass(frozen=True)
class Prediction:
    compute_s: float
    comm_s: dict[str, float]  # axes label -> seconds on its links
    exposed_by_axes: dict[str, float]  # axes label -> those of its seconds compute cannot hide
    step_s: float
    mfu: float

    @property
    def exposed_s(self) -> float:
        """Communication that compute cannot hide."""
        return sum(self.exposed_by_axes.values())

    @property
    def overlapped_s(self) -> float:
        return sum(self.comm_s.values()) - self.exposed_s

    def as_json(self) -> dict:
        return {"compute_s": self.compute_s, "communication_s": self.comm_s, "exposed_communication_s": self.exposed_s,
                "predicted_step_time_s": self.step_s, "predicted_mfu": self.mfu}


def executed_flops_per_step(cfg, model_cfg) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one step: remat recomputes (part of) the forward."""
    per_token = train_flops_per_token(model_cfg, cfg.training.seq)
    model = per_token * cfg.training.batch * cfg.training.seq
    attention = (6.0 * model_cfg.layers * model_cfg.heads * model_cfg.attention_width()
                 * model_cfg.attended_keys(cfg.training.seq) * cfg.training.batch * cfg.training.seq)
    if cfg.model.remat == "mla":  # DeepSeek-V3's: the up-projections again
        recomputed = up_projection_flops(model_cfg) * cfg.training.batch * cfg.training.seq
    else:
        recomputed = {"none": 0.0, "dots": attention / 3,
                      "full": model / 3}[cfg.model.remat]  # forward = 1/3 of training
    return model, model + recomputed


def up_projection_flops(m) -> float:
    """FLOPs a token's latent attention spends in its up-projections (models.deepseek3), every layer."""
    return 2.0 * m.layers * m.heads * ((m.q_rank or 0) * m.head_dim + m.kv_rank * (m.nope_dim + m.v_dim))


def crosses_nodes(axes: str, shape: Mapping[str, int], devices_per_node: int) -> bool:
    names = [a for a in mesh_axes(axes) if a in shape]
    if not names:
        return True
    outermost = min(AXES.index(a) for a in names)
    return math.prod(shape[a] for a in AXES[outermost:]) > devices_per_node


def predict(cfg, shape: Mapping[str, int], model_cfg, traffic: Iterable[tuple[str, str, float]],
            hardware: Hardware) -> Prediction:
    """`traffic`: (op, axes, bytes per device per step) rows, measured or theoretical."""
    devices = math.prod(shape.values())
    model_flops, executed = executed_flops_per_step(cfg, model_cfg)
    if shape.get("pp", 1) > 1:  # every stage computes in every tick of its schedule, bubbles included
        executed *= Schedule.of(cfg, shape["pp"]).compute_overhead
    compute_s = executed / devices / hardware.peak_flops(cfg.model.dtype)
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    for op, axes, nbytes in traffic:
        link = hardware.inter_gbs if crosses_nodes(axes, shape, hardware.devices_per_node) else hardware.intra_gbs
        seconds = nbytes / (link * 1e9)
        comm[axes] = comm.get(axes, 0.0) + seconds
        exposed[axes] = exposed.get(axes, 0.0) + (0.0 if overlaps(op, axes) else seconds)
    hidden = sum(comm.values()) - sum(exposed.values())
    step_s = max(compute_s, hidden) + sum(exposed.values())
    mfu = model_flops / (devices * hardware.bf16_tflops * 1e12 * step_s) if step_s else 0.0
    return Prediction(compute_s, comm, exposed, step_s, mfu)


def overlaps(op: str, axes: str) -> bool:
    """Whether compute hides the collective: weight and gradient traffic over the batch
    axes does; activations' (and every token all-to-all, even over ep) do not."""
    return op not in ("all-to-all", "ragged-all-to-all") and set(mesh_axes(axes)) <= OVERLAPPED_AXES
