"""Accelerators we can plan for (`hardware.toml`), and the model FLOPs of a step.

MFU = achieved model FLOP/s per device / the device's dense bf16 peak (PaLM's definition:
the FLOPs the model needs, not what the hardware executed, so remat does not inflate it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import resource
import tomllib
from pathlib import Path

from spmd.base.errors import UserError

TABLE = Path(__file__).with_name("hardware.toml")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    memory_gib: float
    bf16_tflops: float
    fp32_tflops: float
    intra_gbs: float
    inter_gbs: float
    devices_per_node: int
    device_kind: tuple[str, ...]
    shares_memory: bool = False  # emulated devices: the memory is the host's, split between them

    def memory_bytes(self, num_devices: int) -> float:
        return self.memory_gib * GIB / (num_devices if self.shares_memory else 1)

    def peak_flops(self, dtype: str) -> float:
        return (self.bf16_tflops if dtype == "bfloat16" else self.fp32_tflops) * 1e12


@functools.cache
def table() -> dict[str, Hardware]:
    data = tomllib.loads(TABLE.read_text())
    return {name: Hardware(name=name, **{**fields, "device_kind": tuple(fields["device_kind"])})
            for name, fields in data.items()}


def get(name: str) -> Hardware:
    hardware = table()
    if name not in hardware:
        raise UserError(f"unknown hardware {name!r}; choose one of {', '.join(hardware)}")
    return hardware[name]


def detect(device_kind: str) -> Hardware | None:
    """The table entry for a `jax.Device.device_kind`, if any (emulated CPUs excluded): of the
    entries whose kinds are in it, the one with the longest ("TPU v5 lite" over "TPU v5")."""
    found = [(len(k), hw) for hw in table().values() if hw.name != "cpu"
             for k in hw.device_kind if k.lower() in device_kind.lower()]
    return max(found, key=lambda f: f[0])[1] if found else None


def peak_tflops(device_kind: str) -> float | None:
    hw = detect(device_kind)
    return hw.bf16_tflops if hw else None


def train_flops_per_token(model_cfg, seq: int) -> float:
    """6 x (parameters a token multiplies with: its top-k experts, in an MoE model)
    + attention 6 x layers x heads x (q k^T's width + the weights times v's: 2 head_dim in
    grouped-query attention) x the keys a query sees (seq / 2 causal; fewer under a sliding
    window), forward and twice backward."""
    c = model_cfg
    lookup_only = 0 if c.tie_embeddings else c.vocab * c.embed  # the input table is gathered, not multiplied
    matmul_params = c.num_params(active=True) - lookup_only
    attention = 6 * c.layers * c.heads * c.attention_width() * c.attended_keys(seq)
    return 6.0 * matmul_params + attention


def host_memory_bytes() -> int:
    """This host's memory, or its container's limit (cgroup v2) when that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def free_memory_bytes() -> int:
    """The memory this process can still take: the least of what the host has available
    (MemAvailable), what its container's limit leaves (cgroup v2), and what its own
    address-space limit leaves (ulimit -v, prlimit --as). Linux; elsewhere the host's."""
    free = [host_memory_bytes()]
    try:
        free.append(int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1]) * 1024)
    except (OSError, TypeError):  # no /proc (macOS), or no such line
        pass
    try:
        limit, used = (Path("/sys/fs/cgroup", name).read_text().strip() for name in ("memory.max", "memory.current"))
        if limit.isdigit() and used.isdigit():
            free.append(int(limit) - int(used))
    except OSError:
        pass
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        try:
            size = int(re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024
        except (OSError, TypeError):
            size = 0
        free.append(address_space - size)
    return max(0, min(free))


def usable_cpus() -> int:
    """The CPUs this process may run on: those a scheduler gave the job (SLURM's
    --cpus-per-task, taskset), else all of the host's (macOS has no affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_memory(devices) -> tuple[float, str] | None:
    """What each of `devices` (one process's, of one kind) can hold, and whose memory that
    is: emulated CPU devices share the host's; an accelerator has its allocator's limit,
    else its table entry's memory. None: not known."""
    device = devices[0]
    if device.platform == "cpu":
        count = len(devices)
        return host_memory_bytes() / count, f"this host's memory, shared by {count} CPU device{'s' * (count != 1)}"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return float(limit), f"{device.device_kind}'s memory"
    hardware = detect(device.device_kind)
    return (hardware.memory_bytes(len(devices)), f"{hardware.name}'s memory") if hardware else None
