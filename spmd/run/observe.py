"""What users watch besides the log line: a profiler trace of chosen steps (--profile-steps),
TensorBoard scalars of the run's records (--tensorboard), the devices' peak memory, the ETA.

None of it waits for the devices, except the trace, once: at its last step, so that the
trace holds that step's device work.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import jax

from spmd.base.errors import OutputFailed, why_io_failed


class Profile:
    """A `jax.profiler` trace of steps A to B of --profile-steps (numbered from 1, as in the
    log line; `steps` None: no trace). It is written in TensorBoard's layout,
    DIR/plugins/profile/<time>/, as <host>.xplane.pb (TensorBoard's profile plugin, xprof)
    and perfetto_trace.json.gz (ui.perfetto.dev), each step marked (the profile plugin's
    step times). Each process traces its own devices; with several, into DIR/process<i>."""

    def __init__(self, steps: tuple[int, int] | None, directory: str, start_step: int, log):
        self.active, self.skip, self.log = False, steps is None, log
        if self.skip:
            return
        first, last = self.first, self.last = steps
        self.directory = Path(directory)
        if jax.process_count() > 1:  # hosts would share the time-named folder, and hostnames may repeat
            self.directory /= f"process{jax.process_index()}"
        if start_step >= last:
            self.skip = True
            log(f"profile: {_steps(first, last)} come{'s' * (first == last)} before step {start_step + 1}, "
                "where this resumed run starts; no trace is taken")
        elif start_step >= first:  # resumed inside the range: trace what is left of it
            self.first = start_step + 1

    def step(self, done: int):
        """Around the reading and dispatch of step `done` (numbered from 1): starts the trace
        at the range's first step, and marks each step traced."""
        if not self.skip and done == self.first:
            self._before = self._folders()
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True
            self.log(f"profile: tracing {_steps(self.first, self.last)} into {self.directory}")
        return jax.profiler.StepTraceAnnotation("train", step_num=done) if self.active else contextlib.nullcontext()

    def ends_at(self, done: int) -> bool:
        """Whether step `done` is the last one traced: once it is dispatched, the caller
        waits for its outputs (the trace must hold its device work) and calls `stop`."""
        return self.active and done == self.last

    def stop(self, done: int) -> float:
        """Write the trace, of the steps up to `done` (also when the run stops inside the
        range; nothing when no trace is running). -> seconds spent writing it."""
        if not self.active:
            return 0.0
        started = time.perf_counter()
        self.active = False
        try:
            jax.profiler.stop_trace()
        except Exception as exc:  # noqa: BLE001 - XLA's profiler raises a JaxRuntimeError for what the file system said
            raise OutputFailed(f"cannot write the --profile-dir trace into {self.directory}: {why_io_failed(exc)}") \
                from None
        new = sorted(self._folders() - self._before)
        where = new[-1] if len(new) == 1 else self.directory / "plugins" / "profile"
        self.log(f"profile: {_steps(self.first, done)} written to {where} (tensorboard --logdir {self.directory}, "
                 "xprof, or its perfetto_trace.json.gz in ui.perfetto.dev)")
        return time.perf_counter() - started

    def _folders(self) -> set[Path]:
        with contextlib.suppress(OSError):
            return {p for p in (self.directory / "plugins" / "profile").iterdir() if p.is_dir()}
        return set()


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


class Scalars:
    """--tensorboard: each record's numbers as TensorBoard scalars at the record's step (the
    metrics file's), written with tensorboardX (no TensorFlow) on the caller's thread when
    records are fetched, and flushed then. A resumed run marks its first step so that
    TensorBoard hides the older events of the steps it trains again."""

    def __init__(self, directory: str, start_step: int):
        # Imported by runs with --tensorboard only: its protobuf modules take a while to load.
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.directory = directory
        with self._writing():
            os.makedirs(directory, exist_ok=True)
            # One file per process and second: the pid keeps a quick restart from truncating the last one's.
            self._events = EventsWriter(os.path.join(directory, "events"), f".{os.getpid()}")
            if start_step:
                self._events.write_event(Event(wall_time=time.time(), step=start_step,
                                               session_log=SessionLog(status=SessionLog.START)))
            self._events.flush()

    def write(self, records: list[dict]) -> None:
        # (imported with --tensorboard only, as in __init__)
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        now = time.time()
        with self._writing():
            for r in records:
                values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in r.items()
                          if name != "step" and isinstance(value, (int, float))]
                self._events.write_event(Event(wall_time=now, step=r["step"], summary=Summary(value=values)))
            self._events.flush()

    def close(self) -> None:
        with self._writing():
            self._events.close()

    @contextlib.contextmanager
    def _writing(self):
        try:
            yield
        except OSError as exc:
            raise OutputFailed(f"cannot write --tensorboard {self.directory}: {why_io_failed(exc)}") from None


def peak_memory_bytes(devices) -> int | None:
    """The most memory any of `devices` has held so far (None where the backend does not
    say, as on the CPU). Asks the allocator: no wait for the devices."""
    stats = [d.memory_stats() or {} for d in devices]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return max(peaks) if peaks else None


def duration(seconds: float) -> str:
    """A duration, short: 12s, 3m20s, 1h02m."""
    s = math.ceil(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
