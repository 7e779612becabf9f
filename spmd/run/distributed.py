"""Several processes: who they are, joining them with `jax.distributed`, and not waiting
forever for one that died or hangs.

A run is multi-process when flags say so (`--coordinator host:port --num-processes N
--process-id i`), when the environment does (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID, as `spmd.launch` sets them; or a SLURM job step of several tasks), or with
`--coordinator auto` (JAX finds the cluster: a TPU pod, SLURM, Open MPI, Kubernetes).
Otherwise it is one process and `jax.distributed` is never started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
import time
from collections.abc import Mapping

import jax

from spmd.base.errors import UserError, first_line

AUTO = "auto"
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
EXIT_TIMEOUT = 3
SLURM = "SLURM"  # Processes.found_in of a SLURM job step
# Where the count and index of the processes come from (Processes.found_in), as a message names
# each: a value out of range is refused here, naming its source, before JAX sees it.
PLACE_NAMES = {"flags": ("--num-processes {}", "--process-id {}"),
               "environment": ("JAX_NUM_PROCESSES={}", "JAX_PROCESS_ID={}"),
               SLURM: ("SLURM_NTASKS={}", "SLURM_PROCID={}")}
JAX_JOIN_GRACE_S = 30  # JAX's own deadline comes this much after ours
# The most processes a run may name: beyond the largest clusters (a TPU v5p pod has 2,240
# hosts), and within the 32-bit counts JAX's client takes.
MAX_PROCESSES = 1 << 16


@dataclasses.dataclass(frozen=True)
class Processes:
    count: int = 1  # 0: unknown until JAX detects it (--coordinator auto)
    index: int = 0
    coordinator: str | None = None  # None: JAX finds it (SLURM, --coordinator auto)
    found_in: str = "single process"

    @property
    def multi(self) -> bool:
        return self.count != 1


def processes(cfg, environ: Mapping[str, str] = os.environ) -> Processes:
    """This process's place in the run, from the flags, else the environment."""
    if cfg.processes.coordinator == AUTO:
        if cfg.processes.num_processes is not None or cfg.processes.process_id is not None:
            raise UserError("--coordinator auto finds the processes itself; drop --num-processes and --process-id")
        return Processes(count=0, found_in="detected by JAX")
    given = (cfg.processes.coordinator, cfg.processes.num_processes, cfg.processes.process_id)
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise UserError("several processes need all of --coordinator HOST:PORT, --num-processes and --process-id")
        return _checked(cfg.processes.coordinator, cfg.processes.num_processes, cfg.processes.process_id, "flags")
    if any(name in environ for name in ENV):
        missing = [name for name in ENV if name not in environ]
        if missing:
            raise UserError(f"the environment sets some of {', '.join(ENV)} but not {', '.join(missing)}")
        return _checked(environ[ENV[0]], _int(environ, ENV[1]), _int(environ, ENV[2]), "environment")
    if "SLURM_JOB_ID" in environ and _int(environ, "SLURM_NTASKS", 1) != 1:
        # A job step of several tasks (srun): JAX finds the coordinator and the ids from the
        # same variables (checked here, so that a bad one is named before JAX reads it); the
        # count and index are read here only to share emulated devices.
        for name in ("SLURM_JOB_ID", "SLURM_LOCALID"):
            _int(environ, name, 0)
        placed = _placed(Processes(_int(environ, "SLURM_NTASKS"), _int(environ, "SLURM_PROCID", 0), found_in=SLURM))
        if not environ.get("SLURM_STEP_NODELIST", "").strip():  # (where JAX finds the coordinator)
            raise UserError("environment variable SLURM_STEP_NODELIST is unset or empty: the job step's nodes are "
                            "unknown")
        return placed
    return Processes()


def one_task_per_node(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this SLURM job step runs one task on each of its nodes: then each process
    drives all of its node's GPUs, as `--dcn` supposes (a process per host)."""
    return "SLURM_STEP_NUM_NODES" in environ and \
        _int(environ, "SLURM_NTASKS", 1) == _int(environ, "SLURM_STEP_NUM_NODES")


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in environ and default is not None:
        return default
    value = environ[name]
    if not (value.isascii() and value.strip().lstrip("+-").isdigit()):  # int() takes other digits, "1_0" too
        raise UserError(f"environment variable {name}={value!r} is not an integer")
    return int(value)


HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")  # a name or IPv4 address, or [an IPv6 address]


def _checked(coordinator: str, count: int, index: int, found_in: str) -> Processes:
    host, _, port = coordinator.rpartition(":")
    if not HOST.fullmatch(host) or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        given = f"{ENV[0]}={coordinator!r}" if found_in == "environment" else f"--coordinator {coordinator!r}"
        raise UserError(f"coordinator {given} is not host:port (a host name, an IPv4 address or a bracketed IPv6 "
                        "one; a port from 1 to 65535)")
    return _placed(Processes(count, index, coordinator, found_in))


def _placed(procs: Processes) -> Processes:
    """`procs`, once its count is at least 1 and its index one of 0 to count - 1; else one
    line naming the flag or environment variable and its bound."""
    count_name, index_name = (name.format(value) for name, value in
                              zip(PLACE_NAMES[procs.found_in], (procs.count, procs.index)))
    if not 1 <= procs.count <= MAX_PROCESSES:
        raise UserError(f"{count_name}: the number of processes must be 1 to {MAX_PROCESSES:,}")
    if not 0 <= procs.index < procs.count:
        raise UserError(f"{index_name} is not one of {procs.count} processes ({count_name}): it must be "
                        f"0 to {procs.count - 1}")
    return procs


def initialize(procs: Processes, heartbeat_timeout: int, join_timeout: int = 300) -> None:
    """Join the run's other processes (a barrier). Must come before JAX starts a backend."""
    if not procs.multi:
        return

    kwargs = {} if procs.coordinator is None else dict(
        coordinator_address=procs.coordinator, num_processes=procs.count, process_id=procs.index)
    if procs.coordinator:
        who = f"process {procs.index} of {procs.count} waits for the others at {procs.coordinator}"
    elif procs.count:
        who = f"process {procs.index} of {procs.count} ({procs.found_in}) waits for the others"
    else:
        who = "waiting for the cluster's processes (found by JAX)"
    print(f"{who} (up to {join_timeout} s, --join-timeout)", file=sys.stderr, flush=True)
    # When the others never come, JAX's client aborts the process with a C++ stack trace
    # (a fatal error in its own thread, which Python cannot catch): give up first, in one line.
    timer = threading.Timer(join_timeout, _give_up, (procs, join_timeout))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=heartbeat_timeout,
                                   initialization_timeout=join_timeout + JAX_JOIN_GRACE_S)
    except (RuntimeError, ValueError) as exc:  # XlaRuntimeError is a RuntimeError
        raise UserError(f"could not join the other processes ({procs.found_in}): {first_line(exc)}") from None
    finally:
        timer.cancel()
    if procs.found_in == SLURM and one_task_per_node():
        # JAX's SLURM detection gives each process one GPU (the one of its local task id),
        # for one task per GPU; with one task per node that would leave all but one idle.
        for option in ("jax_cuda_visible_devices", "jax_rocm_visible_devices"):
            jax.config.update(option, "all")


def _give_up(procs: Processes, join_timeout: int) -> None:
    where = f" at {procs.coordinator}" if procs.coordinator else ""
    count = f"{procs.count} " if procs.count else ""
    print(f"error: the run's processes did not all join within {join_timeout} s{where} (are all {count}started, "
          "with the same coordinator? --join-timeout)", file=sys.stderr, flush=True)
    os._exit(EXIT_TIMEOUT)


class Watchdog:
    """Bounds the host's waits on the devices: a step that does not finish within
    `timeout` seconds means a process of the run died or hangs (its collectives never
    complete), so this process says so on one line and exits, rather than wait forever."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._waiting: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    @contextlib.contextmanager
    def waiting(self, what: str):
        with self._lock:
            self._waiting = (what, time.monotonic() + self.timeout)
        try:
            yield
        finally:
            with self._lock:
                self._waiting = None

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.timeout / 4)):
            with self._lock:
                waiting = self._waiting
            if waiting and time.monotonic() > waiting[1]:
                print(f"error: {waiting[0]} did not finish within {self.timeout:g} s: a process of the run died or "
                      f"hangs, or a collective is stuck (--step-timeout)", file=sys.stderr, flush=True)
                os._exit(EXIT_TIMEOUT)
