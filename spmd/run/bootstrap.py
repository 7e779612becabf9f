"""What each command does between its flags and the library: the devices first, then the mesh.

JAX reads XLA's flags and the number of CPU devices to emulate once, when it starts its
backend, so `start_devices` runs before anything touches a device (importing JAX does
not start it); `with_mesh` then settles the mesh on the devices found, and the layout
(spmd.parallel.layout) and the weights (spmd.run.weights) follow.
"""

from __future__ import annotations


import jax

from spmd.parallel.checks import check_before_devices
from spmd.parallel.defaults import default_layout, mesh_flag
from spmd.parallel.mesh import emulate_cpu_devices, format_mesh
from spmd.run import xla_flags
from spmd.run.distributed import Processes


def start_devices(cfg, processes: Processes | None = None, cpu_devices: int | None = None) -> list[str]:
    """Before JAX starts: a training run's checks that need no devices and XLA's flags for
    its model (`processes` given), and the CPU devices the mesh needs where the host has
    too few (without --mesh: those the host is set up with, or spmd.train's 8 on a bare
    CPU host). -> the lines that name the flags set"""
    flag_lines = []
    if processes is not None:
        check_before_devices(cfg.step, processes.count)
        flag_lines = xla_flags.configure(xla_flags.backend_before_start(), cfg.model_cfg, cfg.model.dtype,
                                         double_buffered=xla_flags.double_buffers(cfg))
    emulate_cpu_devices(None if cfg.parallelism.mesh is None else cfg.parallelism.mesh_spec.sizes,
                        cfg.parallelism.cpu_devices if cpu_devices is None else cpu_devices,
                        processes.count if processes is not None else 1, trains=processes is not None)
    return flag_lines


def with_mesh(cfg, serving: bool = False, for_training: bool = True, devices: int | None = None):
    """`cfg` on its mesh: --mesh's, or without one the default layout of every device found
    (or of `devices` devices) for training or `serving` a model (spmd.parallel.defaults),
    written into the config (a checkpoint records it), with the line that says which and
    why. -> (config, that line or None)"""
    if cfg.parallelism.mesh is not None:
        return cfg, None
    count = jax.device_count() if devices is None else devices
    shape, why = default_layout(cfg.step, count, serving, for_training)
    which = f"the {count} devices found" if devices is None else f"the {count} devices planned for"
    line = f"layout without --mesh: {format_mesh(shape)} on {which if count > 1 else 'the one device'}: {why}"
    return cfg.replace(mesh=mesh_flag(shape)), line


def start_devices_and_mesh(cfg, for_training: bool = True, cpu_devices: int | None = None):
    """The devices, then the mesh, of a command that serves a model (spmd.eval, and without
    `for_training`'s batch checks spmd.generate and spmd.export): `start_devices`, then
    `with_mesh`. -> (config, line or None)"""
    start_devices(cfg, cpu_devices=cpu_devices)
    return with_mesh(cfg, serving=True, for_training=for_training)
