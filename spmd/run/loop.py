"""The training loop: steps, logging, checkpoints, preemption and non-finite losses."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from spmd.base.console import emit, human_bytes
from spmd.base.errors import OutputFailed, UserError, why_io_failed
from spmd.base.hardware import peak_tflops, train_flops_per_token
from spmd.base.signals import StopSignals
from spmd.data.feed import Prefetcher, global_batch
from spmd.formats.checkpoint import finalized_steps, make_meta
from spmd.parallel.balance import REBALANCE_EVERY
from spmd.parallel.step import model_params
from spmd.planner.report import describe_run
from spmd.run.distributed import Watchdog
from spmd.run.observe import Profile, Scalars, duration, peak_memory_bytes

# The host may run this many steps ahead of the devices. Enough to keep them busy while
# the next batch is built; bounded because a deep queue of in-flight executions
# deadlocked XLA:CPU's collectives on emulated devices (seen at ~200 queued steps).
MAX_STEPS_IN_FLIGHT = 2


@dataclasses.dataclass
class Result:
    records: list[dict]
    state: dict
    ok: bool  # False when stopped by a non-finite loss


def weighted_mean(results: list[dict]) -> tuple[float, int]:
    """The mean loss over all the targets of several evaluated batches ({"loss", "tokens"}
    each), and their number: each batch's mean weighted by its targets."""
    tokens = np.array([r["tokens"] for r in results], np.float64)
    losses = np.array([r["loss"] for r in results], np.float64)
    return float(np.sum(losses * tokens) / np.sum(tokens)), int(np.sum(tokens))


@dataclasses.dataclass
class _Progress:
    """What the loop carries from step to step."""
    window_start: float  # when the current window of steps began
    done: int  # steps dispatched
    tokens: int  # a step's, and its FLOPs per device, and the device's peak TFLOP/s: for the records
    flops_per_device: float
    peak: float | None
    records: list[dict] = dataclasses.field(default_factory=list)
    pending: list[dict] = dataclasses.field(default_factory=list)  # metrics of steps not yet fetched
    in_flight: deque = dataclasses.field(default_factory=deque)  # their losses, to wait for the oldest
    votes: deque = dataclasses.field(default_factory=deque)  # stop votes cast, read a few steps later


class MetricsFile:
    """The run's JSONL metrics: started as `start_metrics` says, a window appended at a time."""

    def __init__(self, path: str, start_step: int):
        self.path = path
        start_metrics(path, start_step)

    def write(self, window: list[dict]) -> None:
        append_records(self.path, window)

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What the trainer sets up for the loop (spmd.run.trainer): the options, layout and
    plan; the compiled programs; the state and step it starts from; the data; where it
    saves and logs."""
    cfg: object  # the run's options
    layout: object  # spmd.parallel.layout.Layout
    plan: object  # the planner's, which the first lines describe
    step_fn: object  # the compiled training step
    state: dict  # the state the run starts from
    start_step: int
    checkpoints: object  # where it saves (spmd.formats.checkpoint.Checkpoints), or None
    setup_s: float  # seconds from the start to the first step
    source: object  # the data (spmd.data.source.DataSource)
    eval_fn: object = None  # the compiled evaluation, with --eval-every
    skipped: int = 0  # updates skipped for a non-finite loss before this run (a resumed run's)
    log: object = print  # prints the run's lines (process 0's job)
    lock: object = None  # on the checkpoint directory (spmd.base.paths.DirectoryLock), released at the end
    resumed: bool = False  # from a checkpoint: its first step is saved already
    rebalance: object = None  # places expert copies anew (spmd.parallel.balance), or None


class Run:
    """`log` prints the run's lines (process 0's job); `say` prints this process's own."""

    def __init__(self, setup: RunSetup):
        cfg = setup.cfg
        self.cfg, self.layout, self.plan, self.step_fn = cfg, setup.layout, setup.plan, setup.step_fn
        self.state, self.start_step, self.checkpoints = setup.state, setup.start_step, setup.checkpoints
        self.setup_s, self.skipped, self.log = setup.setup_s, setup.skipped, setup.log
        self.source, self.eval_fn = setup.source, setup.eval_fn
        # Expert copies placed anew every --rebalance-every steps (spmd.parallel.balance).
        self.rebalance, self.rebalance_every = setup.rebalance, cfg.moe.rebalance_every or REBALANCE_EVERY
        # A resumed run's first step is saved already; a fresh run with --steps 0 saves its
        # start (e.g. a Hugging Face model, converted).
        self.last_saved: int | None = setup.start_step if setup.resumed else None
        self.primary = jax.process_index() == 0
        self.watchdog = Watchdog(cfg.processes.step_timeout)
        self.lock = setup.lock  # on the checkpoint directory (spmd.base.paths.DirectoryLock), released at the end
        # Several processes must stop after the same step, whichever got the signal.
        self.stop_vote = StopVote(setup.layout.mesh) if jax.process_count() > 1 else None

    def save(self, step: int) -> None:
        if self.checkpoints is None or self.last_saved == step:
            return
        meta = make_meta(self.cfg.record(), self.cfg.model.name, step, self.state["params"])
        meta["skipped_updates"] = self.skipped
        if (position := self.source.state(step)) is not None:  # where a resumed run finds its rows
            meta["data"] = position
        with self._writing_checkpoint(step):
            if step in self.checkpoints.steps():  # a later checkpoint of a run this one resumed before
                self.checkpoints.delete(step)
            self.checkpoints.save(step, self.state, meta)
        self.last_saved = step

    @contextlib.contextmanager
    def _writing_checkpoint(self, step: int):
        """A save that fails (disk full, permission lost, I/O error) ends the run with one
        line naming the last complete checkpoint; an async save's failure surfaces at the
        next save or wait, so `step` is the newest one started."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - Orbax raises what the file system raised
            complete = finalized_steps(self.checkpoints.directory)
            failed = min((s for s in (self.last_saved, step) if s is not None and s not in complete), default=step)
            done = [s for s in complete if s < failed]
            last = (f"the last complete checkpoint is {self.checkpoints.directory / str(max(done))}" if done
                    else "no checkpoint was completed")
            raise OutputFailed(f"saving the checkpoint of step {failed} in {self.checkpoints.directory} failed "
                               f"({why_io_failed(exc)}); {last}") from None

    def loop(self) -> Result:
        """Steps dispatched ahead of the devices; at each window's end (a log, save or
        evaluation step, or a stop) its metrics fetched, written to the sinks and checked
        for non-finite losses, then the save, the log line or the stop."""
        cfg = self.cfg
        for line in describe_run(cfg.step, self.layout, self.plan, self.source.describe(cfg.training.seq),
                                 self.setup_s):
            self.log(line)
        sinks = self._sinks()
        profile = Profile(cfg.logging.profile_range, cfg.logging.profile_dir, self.start_step, self.log)
        batches = Prefetcher(
            lambda k: global_batch(self.source, k, cfg.training.batch, cfg.training.seq + 1,
                                   self.layout.batch_sharding),
            self.start_step, cfg.training.steps)
        run = _Progress(time.perf_counter(), self.start_step, *self._throughput())
        ok = True
        try:
            with StopSignals() as stop:
                for step in range(self.start_step, cfg.training.steps):
                    run.done = done = step + 1
                    stopping = self._stop_requested(stop, run, self._dispatch(step, batches, profile, run), step)
                    save_due = bool(cfg.checkpoint.save_every) and done % cfg.checkpoint.save_every == 0
                    log_due = done % cfg.logging.log_every == 0 or done == cfg.training.steps
                    eval_due = bool(cfg.data.eval_every) and done % cfg.data.eval_every == 0
                    if not (save_due or log_due or eval_due or stopping):
                        continue
                    # Fetch before saving, so that a non-finite loss is seen before its state is kept.
                    window = self._end_window(run, step, eval_due)
                    for sink in sinks:
                        sink.write(window)
                    bad = [r["step"] for r in window if r["skipped"]]
                    if bad and cfg.training.on_nan == "stop":
                        ok = False
                        self._report_non_finite(bad[0])
                        break
                    if save_due or stopping:
                        self.save(done)
                    if log_due or eval_due or stopping:
                        self.log(log_line(window[-1], cfg.training.steps,
                                          recent_loss(run.records, cfg.logging.log_every), self.skipped))
                    if stopping:
                        profile.stop(done)
                        self._finish_saves()
                        where = f"saved {self.checkpoints.directory / str(done)}" if self.checkpoints else "not saved (no --out)"
                        # Every process says where it stopped: all the same step (StopVote).
                        self.say(f"stopped by {stopping} after step {done}; {where}")
                        return Result(run.records, self.state, ok)
                else:
                    self.save(cfg.training.steps)
        except UserError as exc:  # the data failed (a bad record, a data worker that died): where a rerun resumes
            raise UserError(f"{exc}; {self._last_checkpoint()}") from None
        finally:
            batches.close()
            try:
                profile.stop(run.done)  # a run that ends inside the range keeps the trace of its steps so far
                for sink in sinks:
                    sink.close()
                self._finish_saves()
            finally:
                self.watchdog.close()
                if self.lock:
                    self.lock.release()
        self._summarize(run.records, ok)
        return Result(run.records, self.state, ok)

    def _sinks(self) -> list:
        """Where each window's records go besides the log: the metrics file and
        TensorBoard, written by one process for the run."""
        cfg = self.cfg
        if not self.primary:
            return []
        return ([MetricsFile(cfg.logging.metrics_file, self.start_step)] if cfg.logging.metrics_file else []) + (
            [Scalars(cfg.logging.tensorboard, self.start_step)] if cfg.logging.tensorboard else [])

    def _throughput(self) -> tuple[int, float, float | None]:
        """A step's tokens, its model FLOPs per device, and the device's peak TFLOP/s (if known)."""
        cfg, mesh = self.cfg, self.layout.mesh
        tokens = cfg.training.batch * cfg.training.seq
        flops = train_flops_per_token(self.layout.skeleton.model_cfg, cfg.training.seq) * tokens
        return tokens, flops / mesh.devices.size, peak_tflops(mesh.devices.flat[0].device_kind)

    def _dispatch(self, step: int, batches, profile, run: _Progress) -> dict:
        """Run step `step` (and a rebalancing of the experts after it, when due) without
        waiting for it, unless the profile's range ends there: its metrics, still on the devices."""
        done = step + 1
        with profile.step(done):
            with self.watchdog.waiting(f"reading step {step}'s batch"):
                batch = batches.next()
            self.state, metrics = self.step_fn(self.state, batch)
            if self.rebalance and done % self.rebalance_every == 0 and done < self.cfg.training.steps:
                with self.watchdog.waiting(f"rebalancing the experts after step {step}"):
                    self.state = self.rebalance(self.state)
        if profile.ends_at(done):  # the trace must hold this step's device work
            with self.watchdog.waiting(f"step {step}, the last one profiled"):
                jax.block_until_ready((self.state, metrics))
            run.window_start += profile.stop(done)  # writing the trace is no step's time
        run.pending.append(metrics)
        return metrics

    def _stop_requested(self, stop, run: _Progress, metrics: dict, step: int):
        """Whether to stop after this step: the signal, read once (it may land mid-step); with
        several processes the vote cast MAX_STEPS_IN_FLIGHT steps ago, which every process
        reads alike. Waits for the step that far behind, so the host stays that far ahead."""
        run.in_flight.append(metrics["loss"])
        stopping = stop.requested
        if self.stop_vote:
            run.votes.append(self.stop_vote.cast(stopping))
            stopping = None
        if len(run.in_flight) > MAX_STEPS_IN_FLIGHT:
            with self.watchdog.waiting(f"step {step - MAX_STEPS_IN_FLIGHT}"):
                run.in_flight.popleft().block_until_ready()  # a step already behind: no stall
                if self.stop_vote:  # the vote cast with that step: every process reads the same
                    stopping = self.stop_vote.outcome(run.votes.popleft())
        return stopping

    def _end_window(self, run: _Progress, step: int, evaluate: bool) -> list[dict]:
        """The records of the steps since the last window, fetched; the held-out loss and
        the devices' peak memory on its last."""
        with self.watchdog.waiting(f"step {step}"):
            fetched = jax.device_get(run.pending)
        now = time.perf_counter()
        window = self._records(fetched, run.done - len(fetched), (now - run.window_start) / len(fetched),
                               run.tokens, run.flops_per_device, run.peak)
        if evaluate:
            window[-1]["eval_loss"] = self.evaluate(run.done)
        if (peak_memory := peak_memory_bytes(self.layout.mesh.local_devices)) is not None:
            window[-1]["peak_memory_bytes"] = peak_memory
        run.records += window
        run.pending, run.window_start = [], now
        return window

    def _summarize(self, records: list[dict], ok: bool) -> None:
        """The run's last lines: its final loss (beside the data's floor, where known) and what it read."""
        cfg = self.cfg
        if records and ok:  # a run that went to the end
            last = recent_loss(records, cfg.logging.log_every)
            floor = self.source.entropy_floor(cfg.training.seq)
            versus = "" if floor is None else f"; synthetic floor {floor:.4f}; gap {last - floor:+.4f}"
            self.log(f"done: final loss {last:.4f} nats/token (mean of the last log window){versus}")
        steps = cfg.training.steps - self.start_step
        packed = f"; {held}" if (held := self.source.packed_so_far()) else ""
        self.say(f"data: read {self.source.rows_read:,} training rows in {steps} steps "
                 f"({self.source.rows_read / max(steps, 1):g} per step of the global batch's "
                 f"{cfg.training.batch}){packed}")

    def say(self, line: str) -> None:
        """A line of this process's own (every process prints it, named when there are several)."""
        who = f"[process {jax.process_index()}/{jax.process_count()}] " if jax.process_count() > 1 else ""
        emit(who + line)

    def evaluate(self, step: int) -> float:
        """Mean loss over the targets of --eval-batches held-out batches (the same ones every
        time), no more than the held-out data holds."""
        cfg, layout, source = self.cfg, self.layout, self.source
        if source.finite:  # its held-out examples each at most once
            batches = itertools.takewhile(lambda j: source.has_rows(j * cfg.training.batch, "eval"),
                                          range(cfg.data.eval_batches))
        else:  # a held-out set of windows read once each (the first batch, at least, if it is smaller)
            held = source.held_out_rows
            batches = range(cfg.data.eval_batches if held is None
                            else min(cfg.data.eval_batches, max(1, held // cfg.training.batch)))
        results = [self.eval_fn(model_params(self.state),
                                global_batch(self.source, j, cfg.training.batch, cfg.training.seq + 1,
                                             layout.batch_sharding, "eval"))
                   for j in batches]
        with self.watchdog.waiting(f"evaluation at step {step}"):
            return weighted_mean(jax.device_get(results))[0]

    def _records(self, fetched, first: int, step_time: float, tokens: int, flops_per_device: float, peak):
        window = []
        for i, m in enumerate(fetched):
            skipped = bool(m["skipped"])
            self.skipped += skipped
            record = {
                "step": first + i,
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "lr": float(m["lr"]),
                "skipped": skipped,
                "step_time_s": step_time,
                "tokens_per_sec": tokens / step_time,
                "tflops_per_device": flops_per_device / step_time / 1e12,
            }
            if peak:
                record["mfu"] = record["tflops_per_device"] / peak
            record |= {name: float(m[name]) for name in MODEL_METRICS if name in m}
            window.append(record)
        return window

    def _report_non_finite(self, step: int) -> None:
        self._finish_saves()
        good = [s for s in (self.checkpoints.steps() if self.checkpoints else []) if s <= step]
        where = f"last good checkpoint: {self.checkpoints.directory / str(max(good))}" if good else "no checkpoint was written"
        print(f"error: non-finite loss at step {step} (its update was not applied); {where}; "
              f"--on-nan skip would drop such updates and go on", file=sys.stderr, flush=True)

    def _last_checkpoint(self) -> str:
        """The run's last checkpoint, where a rerun resumes (its save is finished as the loop ends)."""
        if self.checkpoints is None or self.last_saved is None:
            return "no checkpoint was written"
        return f"last checkpoint: {self.checkpoints.directory / str(self.last_saved)} (a rerun resumes there)"

    def _finish_saves(self) -> None:
        if self.checkpoints is not None and self.last_saved is not None:
            with self._writing_checkpoint(self.last_saved), self.watchdog.waiting("the last checkpoint's save"):
                self.checkpoints.wait()


# Metrics of the model (spmd.parallel.step): of MoE models: load-balancing and z-loss, share of dropped choices,
# expert load imbalance (max / mean tokens per expert) and, with ep > 1, per device; and
# multi-token prediction's loss (models.deepseek3).
MODEL_METRICS = ("aux_loss", "z_loss", "dropped", "imbalance", "device_imbalance", "mtp_loss")


def log_line(r: dict, steps: int, window_loss: float, skipped: int) -> str:
    done = r["step"] + 1
    mfu = f"  mfu {r['mfu']:.1%}" if "mfu" in r else ""
    skip = f"  skipped {skipped}" if skipped else ""
    held_out = f"  eval_loss {r['eval_loss']:.4f}" if "eval_loss" in r else ""
    peak = f"  peak {human_bytes(r['peak_memory_bytes'])}" if "peak_memory_bytes" in r else ""
    left = f"  eta {duration((steps - done) * r['step_time_s'])}" if done < steps else ""
    moe = (f"  aux {r['aux_loss']:.3f}  z {r['z_loss']:.3f}  dropped {r['dropped']:.1%}  imbalance {r['imbalance']:.2f}"
           if "aux_loss" in r else "")
    if "device_imbalance" in r:
        moe += f" (devices {r['device_imbalance']:.2f})"
    if "mtp_loss" in r:
        moe += f"  mtp {r['mtp_loss']:.4f}"
    return (f"[{done:>{len(str(steps))}}/{steps} {done / steps:4.0%}] loss {window_loss:.4f}  "
            f"grad_norm {r['grad_norm']:.3f}  lr {r['lr']:.2e}  {r['tokens_per_sec']:,.0f} tok/s  "
            f"{r['step_time_s'] * 1e3:.1f} ms/step  {r['tflops_per_device']:.3f} TFLOP/s/device{mfu}{peak}{moe}"
            f"{held_out}{skip}{left}")


def recent_loss(records: list[dict], n: int) -> float:
    """Mean loss of the last `n` steps (one step's loss is too noisy to report)."""
    return float(np.mean([r["loss"] for r in records[-n:]]))


def start_metrics(path: str, start_step: int) -> None:
    """A fresh run starts a fresh file; a resumed one keeps the records of the steps before
    its checkpoint (those after it are trained again, and would be there twice), rewritten
    whole or not at all. A file that is no regular file (/dev/null) is only opened."""
    with _writing_metrics(path):
        if not (start_step and os.path.isfile(path)):
            open(path, "w").close()
            return
        with open(path, errors="replace") as f:
            kept = [line if line.endswith("\n") else line + "\n" for line in f if _is_record_before(line, start_step)]
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), delete=False) as tmp:
            tmp.writelines(kept)
        os.chmod(tmp.name, os.stat(path).st_mode & 0o777)
        os.replace(tmp.name, path)


def _is_record_before(line: str, before: int) -> bool:
    """Whether `line` is a record of a step before `before` (not a record of ours, or one
    cut short by a kill, is dropped)."""
    try:
        return json.loads(line)["step"] < before
    except (ValueError, KeyError, TypeError):
        return False


def append_records(path, records: list[dict]) -> None:
    with _writing_metrics(path), open(path, "a") as f:
        f.write("".join(json.dumps(record) + "\n" for record in records))


@contextlib.contextmanager
def _writing_metrics(path: str):
    try:
        yield
    except OSError as exc:
        raise OutputFailed(f"cannot write --metrics-file {path}: {why_io_failed(exc)}") from None


class StopVote:
    """Processes agree on a stop: with each step every process casts its stop request (a
    signal's number, or 0) into a tiny all-reduce (max over all devices), and reads the
    outcome when it next waits for that step anyway. All read the same value at the same
    step, so all stop after the same step and save it together."""

    def __init__(self, mesh):
        self._sharding = jax.NamedSharding(mesh, jax.P(mesh.axis_names))
        self._size = mesh.devices.size
        self._ballots: dict[int, jax.Array] = {}  # built once per value: no transfer per step
        self._max = jax.jit(jnp.max, out_shardings=jax.NamedSharding(mesh, jax.P()))

    def cast(self, requested: str | None) -> jax.Array:
        value = int(signal.Signals[requested]) if requested else 0
        if value not in self._ballots:
            self._ballots[value] = jax.make_array_from_callback(
                (self._size,), self._sharding, lambda index: np.full(len(range(self._size)[index[0]]), value, np.int32))
        return self._max(self._ballots[value])

    @staticmethod
    def outcome(vote: jax.Array) -> str | None:
        value = int(jax.device_get(vote))
        return signal.Signals(value).name if value else None
