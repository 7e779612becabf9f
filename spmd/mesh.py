"""The device mesh, at the import path of the Python API (`parse_mesh`,
`emulate_cpu_devices`); the code lives in spmd.parallel.mesh."""

from spmd.parallel.mesh import MeshSpec, emulate_cpu_devices, parse_mesh

__all__ = ["MeshSpec", "emulate_cpu_devices", "parse_mesh"]
