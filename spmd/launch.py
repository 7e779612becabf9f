"""`python -m spmd.launch --nproc N -- python -m spmd.train ...`: N local processes of one run.

Each process gets the coordinator's address, the process count and its index in the
environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), which
`spmd.train` reads; on a CPU-only machine each emulates its share of the mesh's devices.
This is how to try a multi-host run on one machine, and what the tests use.

When one process fails, the others get `--grace` seconds to stop by themselves (they
notice within `--step-timeout` or the heartbeat timeout), then they are terminated.
The exit code is the first failure's, else 0. SIGINT and SIGTERM are passed on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from spmd.config import OneLineErrorParser
from spmd.errors import UserError, one_line_errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(index: int, count: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count), JAX_PROCESS_ID=str(index))
    return env


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with one_line_errors():
        if "--" not in argv:
            raise UserError("usage: python -m spmd.launch --nproc N -- COMMAND ... (the command after --)")
        split = argv.index("--")
        parser = OneLineErrorParser(prog="python -m spmd.launch", description=__doc__.splitlines()[0])
        parser.add_argument("--nproc", type=int, required=True, help="processes to start")
        parser.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
        parser.add_argument("--grace", type=float, default=60.0,
                            help="seconds the others get to stop by themselves after one fails (default: 60)")
        args = parser.parse_args(argv[:split])
        command = argv[split + 1:]
        if args.nproc < 1 or not command:
            raise UserError("--nproc must be at least 1, and a command must follow --")
    port = args.port or free_port()
    # Their own process group: a Ctrl-C at the terminal reaches the launcher alone, which
    # passes it on once (twice would be the trainer's "abort now").
    procs = [subprocess.Popen(command, env=process_env(i, args.nproc, port), process_group=0)
             for i in range(args.nproc)]
    forward = lambda signum, frame: [p.send_signal(signum) for p in procs if p.poll() is None]  # noqa: E731
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return wait(procs, args.grace)


def wait(procs: list[subprocess.Popen], grace: float) -> int:
    """Wait for every process; after the first failure, give the rest `grace` seconds."""
    failed: tuple[int, int] | None = None  # (process index, exit code)
    deadline = None
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if failed is None and p.returncode not in (None, 0):
                failed, deadline = (i, p.returncode), time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            _reap(procs)
            break
        time.sleep(0.2)
    if failed is None:
        failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if failed is None:
        return 0
    index, code = failed
    why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    print(f"error: process {index} of {len(procs)} failed ({why})", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code


def _reap(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
