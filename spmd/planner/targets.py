"""Accelerators to compile for without one (`spmd.plan --target NAME`): TPU slices by
topology, GPU nodes by a target description of the chip, both compiled ahead of time by
the real accelerator's compiler (libtpu; XLA:GPU of the CUDA plugin) on this host.

Names, as Cloud TPU and GPU clouds name them:
  v5p-128       a TPU v5p slice of 128 TensorCores (64 chips, 4x4x4); v5p-8 is the smallest
  v5e-256       a TPU v5e slice of 256 chips (16x16); v6e-64 likewise (8x8)
  2xv5p-128     two such slices joined by the data-center network (multislice)
  v5p:2x2x4     a slice by its chips' topology, as libtpu names it
  h100x8        one node of 8 H100s; h200x8 likewise; h100x2 a node of 2
  2xh100x8      two such nodes
The GPU chips' descriptions are data (targets/*.txtpb: XLA's GpuTargetConfig, in text);
TPUs need none (libtpu knows its chips).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from pathlib import Path

from spmd.base.cli import parse_integer, shown
from spmd.base.errors import UserError
from spmd.base.schema import Bounds

DESCRIPTIONS = Path(__file__).with_name("targets")
# TensorCores per chip in a slice's name: v5p (and v4) count cores, two a chip; v5e and v6e count chips.
CORES_PER_CHIP = {"v5p": 2, "v5e": 1, "v6e": 1}
TORUS_DIMS = {"v5p": 3, "v5e": 2, "v6e": 2}
MAX_TPU_CHIPS = {"v5p": 8960, "v5e": 256, "v6e": 256}  # the largest slice of each
MAX_SLICES = 64
# The H800 is the H100's chip with NVLink cut (hardware.toml's h800): the same to the compiler.
GPU_CHIPS = {"h100": "h100.txtpb", "h800": "h100.txtpb", "h200": "h200.txtpb"}
MAX_GPUS_PER_NODE = 8
MAX_GPU_NODES = 256  # DeepSeek-V3's 2,048 H800s
TARGET_HELP = (  # spmd.plan's and spmd.train's --target
    "compile for this accelerator with its own compiler, ahead of time and with none here: a TPU slice "
    "(v5p-128, v5e-256, v6e-64, 2xv5p-128) or a GPU node (h100x8, h200x8, 2xh100x8); needs .[aot-tpu] or "
    ".[aot-gpu] (docs/planner.md)")
EXTRAS = {"tpu": ("aot-tpu", "libtpu"), "cuda": ("aot-gpu", "jax_cuda12_plugin")}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "tpu" or "cuda"
    hardware: str  # its spmd/base/hardware.toml entry
    topology: str  # libtpu's "v5p:4x4x4"; for GPUs "slices x hosts x devices per host"
    slices: int = 1
    target_config: str | None = None  # GPUs: XLA's GpuTargetConfig, text
    accelerator_type: str | None = None  # TPUs: one slice as a TPU VM names it (TPU_ACCELERATOR_TYPE), v5p-128

    @property
    def devices(self) -> int:
        per_slice = math.prod(int(d) for d in re.findall(r"\d+", self.topology.split(":")[-1]))
        return per_slice * (self.slices if self.platform == "tpu" else 1)


def torus(chips: int, dims: int) -> tuple[int, ...]:
    """A slice's chip grid as Cloud TPU shapes it: from one chip, the smallest side doubles
    (the last of equal sides first): 4 chips 2x2x1, 8 2x2x2, 16 2x2x4, 32 2x4x4, 64 4x4x4;
    in 2D 4 chips 2x2, 8 2x4, 16 4x4, 256 16x16."""
    shape = [2, 2, 1] if dims == 3 else [1, 1]  # a 3D slice starts at 4 chips
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, side in enumerate(shape) if side == smallest)
        shape[last] *= 2
    if math.prod(shape) != chips:
        raise ValueError(chips)
    return tuple(shape)


def named_for(hardware: str, devices: int) -> str | None:
    """The target of `devices` accelerators of the kind `hardware` (hardware.toml's names):
    GPU nodes of 8, or a TPU slice of that many chips; None for a kind no target compiles
    for, or a count no slice has."""
    if hardware in ("h100", "h200", "h800"):
        return f"{hardware}x{devices}" if devices <= 8 else f"{devices // 8}x{hardware}x8"
    if hardware == "v5p" and devices >= 4:  # a 3D slice has 4 chips at least; v5p-N counts 2 cores a chip
        return f"v5p-{2 * devices}"
    if hardware in ("v5e", "v6e"):
        return f"{hardware}-{devices}"
    return None


def parse(name: str) -> Target:
    """The target a name means, or a UserError listing the forms."""
    label = f"--target {name if len(name) <= 40 else shown(name)}"  # (how messages name it)
    text = name.strip().lower()
    slices, rest = 1, text
    if m := re.fullmatch(r"([0-9]+)x(.+)", text):
        rest = m.group(2)
        most = MAX_SLICES if re.match(r"v[0-9]", rest) else MAX_GPU_NODES
        slices = parse_integer(m.group(1), f"{label}: the {'slices' if most == MAX_SLICES else 'nodes'}",
                               Bounds(at_least=1, at_most=most))
    if m := re.fullmatch(r"(v5p|v5e|v6e)-([0-9]+)", rest):
        generation = m.group(1)
        most = MAX_TPU_CHIPS[generation] * CORES_PER_CHIP[generation]
        sizes = (f"{generation} slices come in powers of two up to {most}"
                 f"{' TensorCores (two a chip), from 8' if generation == 'v5p' else ' chips'}")
        try:
            cores = parse_integer(m.group(2), label, Bounds(at_least=1, at_most=most))
            chips, odd = divmod(cores, CORES_PER_CHIP[generation])
            if odd or not chips:
                raise ValueError(chips)
            shape = torus(chips, TORUS_DIMS[generation])
        except (UserError, ValueError):
            raise UserError(f"{label}: {sizes}") from None
        return Target(name, "tpu", generation, f"{generation}:{'x'.join(map(str, shape))}", slices,
                      accelerator_type=rest)
    if m := re.fullmatch(r"(v5p|v5e|v6e):([0-9]+(?:x[0-9]+)+)", rest):
        generation, shape = m.group(1), m.group(2)
        if len(shape.split("x")) != TORUS_DIMS[generation]:
            raise UserError(f"{label}: a {generation} topology has {TORUS_DIMS[generation]} sides")
        most = MAX_TPU_CHIPS[generation]
        sides = [parse_integer(side, f"{label}: a side", Bounds(at_least=1, at_most=most)) for side in shape.split("x")]
        chips = math.prod(sides)
        if chips > most:
            raise UserError(f"{label}: {chips:,} chips; a {generation} slice has at most {most}")
        return Target(name, "tpu", generation, f"{generation}:{'x'.join(map(str, sides))}", slices,
                      accelerator_type=f"{generation}-{chips * CORES_PER_CHIP[generation]}")
    if m := re.fullmatch(r"(h100|h800|h200)x([0-9]+)", rest):
        chip = m.group(1)
        per_node = parse_integer(m.group(2), f"{label}: the GPUs of a node", Bounds(at_least=1,
                                                                                      at_most=MAX_GPUS_PER_NODE))
        config = (DESCRIPTIONS / GPU_CHIPS[chip]).read_text()
        return Target(name, "cuda", chip, f"1x{slices}x{per_node}", 1, config)
    raise UserError(f"{label}: unknown; give a TPU slice (v5p-128, v5e-256, v6e-64, v5p:2x2x4, "
                    f"multislice 2xv5p-128) or a GPU node (h100x8, h200x8, 2xh100x8)")


def check_plugin(target: Target) -> None:
    """One line naming the extra when the target's compiler is not installed."""
    extra, module = EXTRAS[target.platform]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"--target {target.name} compiles with the {'TPU' if target.platform == 'tpu' else 'CUDA'} "
                        f"plugin, which is not installed: pip install -e \".[{extra}]\"")


def devices(target: Target) -> list:
    """The target's devices, to compile for (they run nothing). Set the compiler's flags first."""
    check_plugin(target)
    # Imported on first use: naming and parsing a target needs no jax.
    from jax.experimental import topologies

    if target.platform == "tpu":
        # libtpu looks for the TPU VM it runs on and warns of each thing it cannot find;
        # compiling for a topology needs none of them (a TPU VM's own values stand).
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.accelerator_type)
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # libtpu locks /tmp/libtpu_lockfile so that one process owns a TPU; compiling owns
        # none, and two plans at once would otherwise refuse each other.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        kwargs = {"num_slices": target.slices} if target.slices > 1 else {}
        topology = topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **kwargs)
    else:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU, no driver to check against
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.target_config,
                                                topology=target.topology)
    return list(topology.devices)
