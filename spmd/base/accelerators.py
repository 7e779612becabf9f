"""Which accelerator JAX will run on, decided before JAX starts (its flags, and how many CPU
devices to emulate, must be set before then), without starting it.

An installed plugin is not enough: `.[aot-tpu]` and `.[aot-gpu]` install libtpu and the
CUDA plugin on hosts with no TPU or GPU, to compile for one (`spmd.plan --target`). There
JAX would try the plugin, print its complaints and fall back to one CPU device; spmd runs
on the CPU, as on a host without the plugin. So an accelerator counts when its plugin is
installed and the host shows the device: NVIDIA's device nodes or driver, AMD's kernel
driver, a Google TPU on the PCI bus.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

PLUGINS = {"gpu": ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm"), "tpu": ("libtpu",)}
NVIDIA = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")
ROCM = ("/dev/kfd",)
GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on a TPU VM's PCI bus
PCI_DEVICES = Path("/sys/bus/pci/devices")


def platforms_variable(environ=os.environ) -> str | None:
    """"gpu", "tpu" or "cpu" as JAX_PLATFORMS names it (its first entry: JAX tries them in
    order); None when unset."""
    platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
    if not platforms:
        return None
    first = platforms.split(",")[0].strip()
    return "gpu" if first in ("cuda", "gpu", "rocm") else "tpu" if first == "tpu" else "cpu"


def installed_plugins() -> set[str]:
    """"gpu" and/or "tpu": the JAX plugins installed (package metadata; nothing imported)."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        found |= {platform for platform, prefixes in PLUGINS.items() if name.startswith(prefixes)}
    return found


def device_visible(platform: str) -> bool:
    if platform == "gpu":
        return any(os.path.exists(p) for p in NVIDIA + ROCM)
    try:
        return any((d / "vendor").read_text().strip() == GOOGLE_PCI_VENDOR for d in PCI_DEVICES.iterdir())
    except OSError:
        return False


def backend(environ=os.environ) -> str:
    """"gpu", "tpu" or "cpu": where JAX will run. JAX_PLATFORMS if set; else an installed
    plugin whose device the host shows (GPU before TPU, as JAX prefers); else the CPU."""
    named = platforms_variable(environ)
    if named is not None:
        return named
    plugins = installed_plugins()
    for platform in ("gpu", "tpu"):
        if platform in plugins and device_visible(platform):
            return platform
    return "cpu"


def unused_plugins(environ=os.environ) -> bool:
    """A plugin is installed, JAX_PLATFORMS is unset, and spmd runs on the CPU: JAX must be
    told (JAX_PLATFORMS=cpu), or it tries the plugin first."""
    return platforms_variable(environ) is None and backend(environ) == "cpu" and bool(installed_plugins())
