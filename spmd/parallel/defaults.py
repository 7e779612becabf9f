"""The layout a command takes without `--mesh`: every device it finds, laid out as a user of
MaxText, torchtitan or vLLM would lay them out by hand, the first candidate that the run's
checks pass (spmd.parallel.checks) chosen, with why.

Training (spmd.train, spmd.plan): on 8 devices, spmd's 3-D default `dp=2,fsdp=2,tp=2` (the
default run's, on the 8 devices spmd.train emulates on a bare CPU host); on any other count
FSDP over all of them (ZeRO-3: torchtitan's and MaxText's default), then replicas (dp) where
the weights do not split, then tp taking a factor where the batch does not.

Inference (spmd.generate, spmd.eval, spmd.export): tp as wide as the model's heads, kv heads,
MLP and vocabulary divide (the weights split, no weight gathered per token: a serving
stack's tensor parallelism), the devices left over fsdp (the weights stay split rather
than copied); fsdp alone where no tp divides; where the weights do not split over fsdp,
the devices left over are replicas (dp), and all of them where nothing splits.
"""

from __future__ import annotations

from collections.abc import Mapping

from spmd.base.errors import UserError
from spmd.parallel.checks import check_layout
from spmd.parallel.mesh import AXES, DEFAULT_CPU_DEVICES, format_mesh

THREE_D = {"dp": 2, "fsdp": 2, "tp": 2}  # spmd.train's default on DEFAULT_CPU_DEVICES devices


def default_layout(cfg, devices: int, serving: bool = False, for_training: bool = True
                   ) -> tuple[dict[str, int], str]:
    """The first layout of `devices` devices that holds the run (`serving`: a model's, for
    inference), and why it was chosen; its batch checked too if `for_training` (spmd.eval's
    is). -> (all six axes' sizes, why)"""
    candidates = inference_layouts(devices) if serving else training_layouts(devices)
    refusals = []
    for sizes, why in candidates:
        shape = {axis: sizes.get(axis, 1) for axis in AXES}
        try:
            check_layout(cfg, shape, for_training)
        except UserError as exc:
            refusals.append((shape, exc))
            continue
        return shape, why
    # Why the replicas, which ask least of the model, do not hold it (the batch, mostly).
    shape, exc = next(((shape, exc) for shape, exc in refusals if shape["dp"] == devices), refusals[0])
    raise UserError(f"without --mesh, no layout of the {devices} devices holds the run ({format_mesh(shape)}: {exc}); "
                    "give --mesh")


def mesh_flag(shape: Mapping[str, int]) -> str:
    """A mesh's sizes as --mesh takes them (one device: dp=1)."""
    return ",".join(f"{axis}={shape[axis]}" for axis in AXES if shape[axis] > 1) or "dp=1"


def training_layouts(n: int) -> list[tuple[dict[str, int], str]]:
    if n == 1:
        return [({}, "nothing to split")]
    first = [(THREE_D, f"spmd's default on {n}: replicas, fully sharded data parallel and tensor parallel")
             ] if n == DEFAULT_CPU_DEVICES else []
    tp_mixes = [({"fsdp": n // t, "tp": t}, f"fully sharded data parallel with tp={t}: the batch does not split "
                 f"{n} ways") for t in _divisors(n)[1:-1]]
    return first + [
        ({"fsdp": n}, "fully sharded data parallel (ZeRO-3) over all of them, as torchtitan and MaxText default to"),
        ({"dp": n}, f"data parallel replicas: the weights do not split {n} ways"),
        *tp_mixes,
        ({"tp": n}, f"tensor parallel: the batch does not split {n} ways"),
    ]


def inference_layouts(n: int) -> list[tuple[dict[str, int], str]]:
    if n == 1:
        return [({}, "nothing to split")]
    widths = list(reversed(_divisors(n)[1:-1]))  # the tp that leave other devices, widest first
    return [
        ({"tp": n}, "tensor parallel over all of them: the model's heads, MLP and vocabulary split"),
        *(({"tp": t, "fsdp": n // t}, f"tensor parallel as wide as the model's heads allow (tp={t}), the rest fully "
           f"sharded (fsdp={n // t}): no weight copied") for t in widths),
        ({"fsdp": n}, "fully sharded: no tp divides the model's heads, but its weights split"),
        *(({"tp": t, "dp": n // t}, f"tensor parallel as wide as the model's heads allow (tp={t}), replicated over the "
           f"rest (dp={n // t}): its weights split no further") for t in widths),
        ({"dp": n}, f"replicas: the model's weights do not split {n} ways, a copy on each device"),
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
