"""The device mesh: six named axes, parsed from `--mesh`, checked, then built.

Axes go outer to inner, so the innermost (`tp`) gets neighbouring devices, which share the
fastest links. Nothing here touches a JAX backend until `build_mesh`, so the CPU device
count can still be chosen (`emulate_cpu_devices`) after parsing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence

import jax
from jax.experimental import mesh_utils

from spmd.base import accelerators
from spmd.base.cli import parse_integer
from spmd.base.errors import UserError
from spmd.base.schema import Bounds

AXES = ("pp", "dp", "fsdp", "ep", "sp", "tp")
BATCH_AXES = ("dp", "fsdp", "ep")  # the axes that split the batch
REMAINING = -1
# The devices spmd.train emulates on a CPU-only host set up to emulate none, without --mesh
# (its default layout, spmd.parallel.defaults), or for a mesh with a -1 axis.
DEFAULT_CPU_DEVICES = 8
DEFAULT_CPU_DEVICES_FOR_REMAINING = DEFAULT_CPU_DEVICES
# How a host is set up to emulate CPU devices before JAX starts (JAX_NUM_CPU_DEVICES, read
# into jax_num_cpu_devices, wins over it).
FORCED_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=([0-9]+)")
# Emulated devices are cheap to create (2048 took 1 s and 0.4 GB here), but a typo like
# dp=1000000 would build a million before anything else is checked. The presets plan
# at most 128; this leaves room for planning large clusters.
MAX_EMULATED_DEVICES = 4096
# One axis's size: -1 (the rest) or up to 2**20 devices, far beyond any cluster built.
AXIS_SIZE = Bounds(at_least=REMAINING, at_most=2**20)


def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """`"dp=4,tp=8"` (or a mapping from YAML) -> sizes of the named axes, `-1` kept."""
    if spec is None or spec == "":
        return {}
    items = spec.items() if isinstance(spec, Mapping) else _split_pairs(str(spec))
    sizes: dict[str, int] = {}
    for axis, size in items:
        if axis not in AXES:
            raise UserError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
        if axis in sizes:
            raise UserError(f"mesh axis {axis!r} is given twice")
        sizes[axis] = _parse_size(axis, size)
    if list(sizes.values()).count(REMAINING) > 1:
        raise UserError("only one mesh axis may be -1 (the remaining devices)")
    return sizes


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """`--mesh` and `--dcn`, parsed once (`TrainConfig.mesh_spec`): the size given to each
    named axis (-1: the remaining devices) and the factor of each that spans the data-center
    network."""

    sizes: Mapping[str, int]
    dcn: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, mesh: str | Mapping[str, int] | None, dcn: str | Mapping[str, int] | None = None) -> MeshSpec:
        return cls(parse_mesh(mesh), parse_mesh(dcn))

    def resolve(self, num_devices: int) -> dict[str, int]:
        """All six axes for `num_devices` devices (see `resolve_mesh`)."""
        return resolve_mesh(self.sizes, num_devices)

    @property
    def devices(self) -> int:
        """The devices the named sizes ask for (without the -1 axis)."""
        return explicit_product(self.sizes)

    @property
    def has_remaining(self) -> bool:
        return REMAINING in self.sizes.values()


def _split_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for part in text.split(","):
        part = part.strip()
        if "=" not in part:
            raise UserError(f"mesh entry {part!r} is not of the form axis=size (e.g. dp=4,tp=2)")
        axis, size = part.split("=", 1)
        pairs.append((axis.strip(), size.strip()))
    return pairs


def _parse_size(axis: str, size: object) -> int:
    if isinstance(size, bool):  # (YAML's true is no size)
        raise UserError(f"mesh axis {axis} must be an integer, got {size!r}")
    value = parse_integer(str(size), f"mesh axis {axis}", AXIS_SIZE)
    if value == 0:
        raise UserError(f"mesh axis {axis}={value}: the size must be positive (or -1 for the rest)")
    return value


def explicit_product(sizes: Mapping[str, int]) -> int:
    return math.prod(v for v in sizes.values() if v != REMAINING)


def resolve_mesh(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """All six axes, in order, with `-1` filled in; the product must be the device count."""
    known = explicit_product(sizes)
    shape = {axis: sizes.get(axis, 1) for axis in AXES}
    for axis, size in shape.items():
        if size == REMAINING:
            if num_devices % known:
                raise UserError(
                    f"mesh axis {axis}=-1: {num_devices} devices do not divide by the other axes' product {known}"
                )
            shape[axis] = num_devices // known
    if math.prod(shape.values()) != num_devices:
        given = ",".join(f"{axis}={size}" for axis, size in sizes.items()) or "of one device"
        needs = math.prod(shape.values())
        raise UserError(f"mesh {given} needs {needs} device{'s' * (needs != 1)}, but {num_devices} are available")
    return shape


def inside_map(mesh):
    """The mesh a `jax.shard_map` is written against here: inside another map (a
    pipeline stage), the context's abstract mesh, which marks the axes already manual;
    else `mesh`."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh


def still_automatic(axes) -> frozenset:
    """Of `axes`, those a `jax.shard_map` here may make manual: not those a surrounding
    map already made manual."""
    return frozenset(axes) - set(jax.sharding.get_abstract_mesh().manual_axes)


def format_mesh(shape: Mapping[str, int]) -> str:
    named = [f"{a}={shape[a]}" for a in AXES if shape.get(a, 1) != 1]
    return ",".join(named) or "single device"


def accelerator_present() -> bool:
    """Whether JAX will run on a GPU or TPU (decided without starting a backend: a plugin
    installed and its device shown, spmd.base.accelerators)."""
    return accelerators.backend() != "cpu"


def keep_unused_plugins_out() -> None:
    """Where a plugin is installed for a device the host lacks (`.[aot-tpu]`, to compile for
    TPUs), run on the CPU without JAX trying the plugin first. Before a backend starts."""
    if accelerators.unused_plugins():
        os.environ["JAX_PLATFORMS"] = "cpu"  # (and data workers, which inherit it)
        try:
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:  # JAX already started (a notebook): it chose already
            pass


def preset_cpu_devices() -> int | None:
    """The CPU devices this host is set up to emulate before JAX starts: jax_num_cpu_devices
    (JAX_NUM_CPU_DEVICES, or set by the caller), else XLA_FLAGS' forced device count; None
    when neither says."""
    if jax.config.jax_num_cpu_devices > 0:
        return jax.config.jax_num_cpu_devices
    forced = FORCED_DEVICE_COUNT.findall(os.environ.get("XLA_FLAGS", ""))
    if not forced:
        return None
    # (XLA reads the last one given; 0 would leave JAX no device to start with)
    return parse_integer(forced[-1], "XLA_FLAGS' --xla_force_host_platform_device_count",
                         Bounds(at_least=1, at_most=MAX_EMULATED_DEVICES))


def emulated_device_count(sizes: Mapping[str, int] | None, cpu_devices: int | None, processes: int = 1,
                          trains: bool = True) -> int | None:
    """How many CPU devices this process will emulate for the mesh (its share when the
    run has several processes); None on a machine with an accelerator plugin, or where the
    devices are what the host is set up with: no --mesh (`sizes` None) and no --cpu-devices,
    on a host set up to emulate some, or for inference (`trains` False), which uses JAX's
    own (one CPU device, unless the host says otherwise)."""
    if accelerator_present():
        return None
    preset = preset_cpu_devices()  # (read and checked here, whatever else decides the count)
    wanted = cpu_devices
    if wanted is None and sizes is None and (not trains or preset is not None):
        return None
    if wanted is None:
        if sizes is None:  # spmd.train's default on a bare CPU host: its 3-D mesh's 8 devices
            wanted = DEFAULT_CPU_DEVICES
        else:
            has_rest = REMAINING in sizes.values()
            wanted = max(explicit_product(sizes), DEFAULT_CPU_DEVICES_FOR_REMAINING if has_rest else 1)
        if processes > 1:
            if wanted % processes:
                raise UserError(f"the mesh's {wanted} devices do not divide among {processes} processes")
            wanted //= processes
    if wanted < 1:
        raise UserError(f"--cpu-devices must be positive, got {wanted}")
    return wanted


def emulate_cpu_devices(sizes: Mapping[str, int] | None, cpu_devices: int | None, processes: int = 1,
                        trains: bool = True) -> None:
    """On a CPU-only machine, create as many emulated devices as the mesh asks of this
    process (its share when the run has several processes); `sizes` None: no --mesh, see
    `emulated_device_count`.

    Must run before anything starts a JAX backend. On a machine with an accelerator this
    does nothing: the mesh is checked against the real devices later. A plugin installed
    for a device the host lacks (`.[aot-tpu]` to compile for TPUs) is kept out of JAX's way.
    """
    keep_unused_plugins_out()
    wanted = emulated_device_count(sizes, cpu_devices, processes, trains)
    if wanted is None:
        return
    if wanted > MAX_EMULATED_DEVICES:
        raise UserError(f"the mesh asks for {wanted:,} emulated CPU devices; at most {MAX_EMULATED_DEVICES} can be "
                        "emulated (check the mesh's sizes)")

    try:
        jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError:  # JAX already started (e.g. in a notebook): use what it has
        if len(jax.devices()) < wanted:
            raise UserError(f"the mesh needs {wanted} devices, but JAX already started with "
                            f"{len(jax.devices())}; set the device count before using JAX") from None


def check_dcn(shape: Mapping[str, int], dcn: Mapping[str, int]) -> None:
    for axis, n in dcn.items():
        if n == REMAINING or shape[axis] % n:
            raise UserError(f"--dcn {axis}={n} does not divide the mesh's {axis}={shape[axis]}")


def build_mesh(shape: Mapping[str, int], devices: Sequence | None = None, dcn: Mapping[str, int] | None = None):
    """A `jax.sharding.Mesh` over `devices` (default: all) with Auto axes, `tp` innermost.

    `dcn` (e.g. {"dp": 2}): the factor of each axis that spans granules (TPU slices, else
    processes), which talk over the data-center network; the rest of every axis stays
    within a granule, on its fast links."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(shape[a] for a in AXES)
    if math.prod(sizes) != len(devices):
        raise UserError(f"mesh {format_mesh(shape)} needs {math.prod(sizes)} devices, got {len(devices)}")
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    if not dcn:
        return jax.make_mesh(sizes, AXES, axis_types=auto, devices=devices)

    check_dcn(shape, dcn)
    across = tuple(dcn.get(a, 1) for a in AXES)
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_slice = None not in slices and len(slices) > 1  # TPU multislice; else processes are the granules
    granules = len({d.slice_index if by_slice else d.process_index for d in devices})
    if math.prod(across) != granules:
        what = "slices" if by_slice else "processes"
        raise UserError(f"--dcn {format_mesh(dcn)} spans {math.prod(across)} granules, but the devices are on "
                        f"{granules} {what}")
    within = tuple(n // k for n, k in zip(sizes, across))
    grid = mesh_utils.create_hybrid_device_mesh(within, across, devices, process_is_granule=not by_slice)
    return jax.sharding.Mesh(grid, AXES, axis_types=auto)
