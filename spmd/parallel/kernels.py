"""Which attention kernel a run uses (`--attention-kernel`, models.attention.KERNELS), and
how it runs on a mesh.

`auto` is cuDNN's fused flash attention on NVIDIA GPUs, Pallas splash attention on TPUs,
and the chunked (flash-style, plain JAX) kernel elsewhere. The plain-JAX kernels (xla,
chunked) are partitioned by XLA like the rest of the model. The fused ones are custom
calls that XLA's partitioner cannot split, so they run in a map manual over every mesh
axis (each device attends with its own rows and heads), as ring attention does. Every axis,
size-1 ones included: an axis left automatic asks the partitioner to split the call, which
Mosaic (splash) and cuDNN refuse when compiled for a real TPU or GPU.
"""

from __future__ import annotations

import jax

from models.attention import KERNELS, Mask, kernel_attention
from spmd.base.errors import UserError
from spmd.parallel.mesh import BATCH_AXES, inside_map, still_automatic

FUSED = ("cudnn", "splash")  # custom calls: run per device, in a map
HEADS_AXIS = "tp"  # splits the kv slots of q, k and v (the rules table's kv_heads / heads)


def resolve(requested: str, device) -> str:
    """The kernel `requested` names on `device`'s platform; refuses one that cannot run there."""
    nvidia = device.platform == "gpu" and "nvidia" in device.device_kind.lower()
    if requested == "auto":
        return "cudnn" if nvidia else "splash" if device.platform == "tpu" else "chunked"
    if requested == "cudnn" and not nvidia:
        raise UserError(f"--attention-kernel cudnn needs an NVIDIA GPU; this run's devices are "
                        f"{device.platform} ({device.device_kind}); use auto, chunked or xla")
    if requested == "splash" and device.platform != "tpu":
        raise UserError(f"--attention-kernel splash needs a TPU; this run's devices are "
                        f"{device.platform} ({device.device_kind}); use auto, chunked or xla")
    return requested


def describe(requested: str, device) -> str:
    chosen = resolve(requested, device)
    return f"{chosen} (auto)" if requested == "auto" else chosen


def make_kernel(mesh: jax.sharding.Mesh, name: str, batch_axes: tuple[str, ...] = BATCH_AXES, kernel=None):
    """attend(q, k, v, positions, segments=None, window=None) with kernel `name` (or the callable `kernel`, of
    KERNELS' form) on `mesh`: a fused kernel in a map over the row and head axes."""
    kernel = kernel or KERNELS[name]
    if name not in FUSED or mesh.devices.size == 1:
        return kernel_attention(kernel)
    # q (batch, seq, kv slots, per slot, head_dim); k, v (batch, seq, kv slots, head_dim).
    split = jax.P(batch_axes or None, None, HEADS_AXIS)  # the same for all three

    def attention(q, k, v, positions, segments=None, window=None):
        def local(q, k, v, segments):
            return kernel(q, k, v, Mask(positions, positions, segments, segments, window))

        rows = jax.P(batch_axes or None)  # segment ids (batch, seq): a device's own rows
        return jax.shard_map(local, mesh=inside_map(mesh), in_specs=(split, split, split, rows), out_specs=split,
                             axis_names=still_automatic(mesh.axis_names), check_vma=False)(q, k, v, segments)

    return attention
