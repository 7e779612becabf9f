"""`python -m spmd.launch --nproc N -- python -m spmd.train ...`: N local processes of one run.

Each process gets the coordinator's address, the process count and its index in the
environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), which
`spmd.train` reads; on a CPU-only machine each emulates its share of the mesh's devices.
This is how to try a multi-host run on one machine, and what the tests use.

When one process fails, the others, whichever it is, get `--grace` seconds to stop by
themselves (they notice within `--step-timeout` or the heartbeat timeout), then they are
terminated, and killed if still there a moment later: the launch ends within `--grace`
and two seconds. The exit code is the first failure's, else 0. SIGINT and SIGTERM are
passed on.
A process that cannot be started (no such command, no more processes allowed) stops the
ones already started: one `error:` line, exit code 2.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from spmd.base.cli import OneLineErrorParser, finite, integer
from spmd.base.errors import UserError, file_kind, one_line_errors

# A fixed bound, the same on every machine: every process is a whole JAX runtime (a few
# hundred MB and its own threads), so no single machine runs a thousand of them usefully,
# while a typo (--nproc 100000) would fork until the process table is full and take the
# machine's other work down with it. Real multi-host runs start one process per host
# with spmd.train's own flags, not through this launcher.
MAX_PROCESSES = 1024
STOP_WAIT_S = 5.0  # after SIGTERM, before SIGKILL, when the launch itself fails
# After --grace, SIGTERM, then SIGKILL this much later: the launch ends within --grace + 2 s
# (with POLL_S between checks). The processes had their grace to stop cleanly.
KILL_AFTER_S = 1.0
POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(index: int, count: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count), JAX_PROCESS_ID=str(index))
    return env


def launch_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=integer, required=True, help=f"processes to start (1 to {MAX_PROCESSES})")
    parser.add_argument("--port", type=integer, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--grace", type=finite, default=60.0,
                        help="seconds the others get to stop by themselves after one fails (default: 60)")
    return parser


def parse(argv: list[str]):
    """The launcher's flags and the command after `--`; UserError on anything wrong."""
    if "--" not in argv:
        raise UserError("usage: python -m spmd.launch --nproc N -- COMMAND ... (the command after --)")
    split = argv.index("--")
    parser = launch_parser()
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.nproc < 1 or not command:
        raise UserError("--nproc must be at least 1, and a command must follow --")
    if not command[0]:  # (the system would look for it as each directory of PATH, and call that permission denied)
        raise UserError("the command after -- is empty (''); give the program to run")
    if args.nproc > MAX_PROCESSES:
        raise UserError(f"--nproc {args.nproc:,} is more than the {MAX_PROCESSES} processes one machine can run "
                        "(one JAX runtime each)")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise UserError(f"--port must be a port from 1 to 65535, got {args.port}")
    if args.grace < 0:
        raise UserError(f"--grace must be at least 0 seconds, got {args.grace:g}")
    return args, command


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with one_line_errors():
        args, command = parse(argv)
    port = args.port or free_port()
    procs: list[subprocess.Popen] = []
    signalled: list[int] = []

    def forward(signum, frame):
        signalled.append(signum)
        for p in procs:
            _signal_group(p, signum)  # (a shell's children too)

    # Installed first: a Ctrl-C while the processes start reaches those started, and no more start.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    for index in range(args.nproc):
        if signalled:
            break
        try:
            # Their own process group: a Ctrl-C at the terminal reaches the launcher alone,
            # which passes it on once (twice would be the trainer's "abort now").
            procs.append(subprocess.Popen(command, env=process_env(index, args.nproc, port), process_group=0))
        except OSError as exc:
            stop(procs)
            print(f"error: {_why_not_started(exc, command, index, args.nproc, len(procs))}", file=sys.stderr,
                  flush=True)
            return 2
    if not procs:  # a signal came before the first process started
        print(f"error: {_signal_name(signalled[0])} before any process started", file=sys.stderr, flush=True)
        return 128 + signalled[0]
    return wait(procs, args.grace, signalled)


def _why_not_started(exc: OSError, command: list[str], index: int, count: int, started: int) -> str:
    if isinstance(exc, FileNotFoundError):
        why = f"command not found: {command[0]}"
    elif isinstance(exc, PermissionError):
        why = f"cannot run {command[0]}: {_not_a_program(command[0]) or 'permission denied'}"
    else:
        why = f"cannot start process {index} of {count}: {exc.strerror or exc}"
    return why + (f"; stopped the {started} already started" if started else "")


def _not_a_program(name: str) -> str | None:
    """What `name` is where the system looked for it, when that is no file (a directory
    is refused as "permission denied"); None for a file, which it may not run."""
    places = [name] if "/" in name else [os.path.join(d or ".", name) for d in os.get_exec_path()]
    for place in places:  # the search reports the first refusal it met (what is not there, it passes)
        if os.path.lexists(place) and (kind := file_kind(place)) != "a broken symbolic link":
            return None if kind == "a regular file" or kind.startswith("unreadable") else f"it is {kind}, not a program"
    return None


def stop(procs: list[subprocess.Popen], timeout: float = STOP_WAIT_S) -> None:
    """Terminate every process still running; kill those still there after `timeout`."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    _reap(procs, timeout)


def _signal_group(p: subprocess.Popen, signum: int) -> None:
    """Signal the process and what it started (its own process group: a shell's children
    too, which would otherwise outlive it), while it is unreaped (its id is still ours)."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signum)


def wait(procs: list[subprocess.Popen], grace: float, signalled: list[int] = ()) -> int:
    """Wait for every process; after the first failure, or a signal passed on to them
    (`signalled`), give the rest `grace` seconds."""
    failed: tuple[int, int] | None = None  # (process index, exit code)
    deadline = None
    # Every process is polled each time round (not up to the first one running): a failure
    # behind a process that runs on must start the grace period.
    while [p for p in procs if p.poll() is None]:
        if signalled and deadline is None:
            deadline = time.monotonic() + grace
        for i, p in enumerate(procs):
            if failed is None and p.returncode not in (None, 0):
                failed, deadline = (i, p.returncode), min(deadline or math.inf, time.monotonic() + grace)
        if deadline is not None and time.monotonic() > deadline:
            stop(procs, timeout=KILL_AFTER_S)
            break
        time.sleep(POLL_S)
    if failed is None:
        failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if failed is None:
        return 0
    index, code = failed
    why = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
    print(f"error: process {index} of {len(procs)} failed ({why})", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _reap(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """Wait up to `timeout` seconds in all (not each) for the processes; kill the rest."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
