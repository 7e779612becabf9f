"""What each command does between its flags and the library: the devices first.

JAX reads XLA's flags and the number of CPU devices to emulate once, when it starts its
backend, so `start_devices` runs before anything touches a device (importing JAX does
not start it); the layout (spmd.parallel.layout) and the weights (spmd.run.weights) follow.
"""

from __future__ import annotations

from spmd.parallel.checks import check_before_devices
from spmd.parallel.mesh import emulate_cpu_devices
from spmd.parallel.skeleton import model_config
from spmd.run import xla_flags
from spmd.run.distributed import Processes


def start_devices(cfg, processes: Processes | None = None, cpu_devices: int | None = None) -> list[str]:
    """Before JAX starts: a training run's checks that need no devices and XLA's flags for
    its model (`processes` given), and the CPU devices the mesh needs where the host has
    too few. -> the lines that name the flags set"""
    flag_lines = []
    if processes is not None:
        check_before_devices(cfg, processes.count)
        flag_lines = xla_flags.configure(xla_flags.backend_before_start(), model_config(cfg), cfg.dtype)
    emulate_cpu_devices(cfg.mesh_spec.sizes, cfg.cpu_devices if cpu_devices is None else cpu_devices,
                        processes.count if processes is not None else 1)
    return flag_lines
