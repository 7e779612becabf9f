"""A real one-node SLURM for the tests: Debian's munge and slurm-wlm daemons, started as
root from a temporary directory with their own key, ports and state, stopped at the end.

The node declares 8 GPUs (a `gres.conf` over device nodes made in the temporary directory),
so job scripts written for GPU nodes (`--gpus-per-node=8`) run unchanged on CPU devices.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from spmd.launch import free_port

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
NODE = "localhost"  # the name jobs see in SLURM_STEP_NODELIST: JAX's coordinator host, resolvable anywhere


def install() -> str | None:
    """Install the packages if a daemon is missing (as root, with apt-get); the reason when that cannot be done."""
    if all(shutil.which(d) or Path("/usr/sbin", d).exists() for d in DAEMONS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"SLURM is not installed and cannot be (needs root and apt-get): apt-get install {' '.join(PACKAGES)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install_cmd, env=env, capture_output=True).returncode:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        subprocess.run(install_cmd, env=env, capture_output=True, check=True)
    return None


def _conf(root: Path) -> str:
    # Root runs everything (no slurm user needed); no cgroups, accounting or MPI plugins.
    # KillWait: how long a stopped task has between SIGTERM and SIGKILL (a step and a save).
    # cred_expire and sched_interval: a requeued job may start again after 5 s, not 120,
    # and the scheduler looks every second, not every minute.
    return f"""\
ClusterName=spmdtests
SlurmctldHost={NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=3600
GresTypes=gpu
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={NODE} CPUs=8 Gres=gpu:8 State=UNKNOWN
PartitionName=main Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class Slurm:
    """munged, slurmctld and slurmd of one node; `env` is what a user's shell needs (SLURM_CONF)."""

    def __init__(self, root: Path):
        self.root = root
        for d in ("munge", "state", "spool"):
            (root / d).mkdir(mode=0o700, parents=True)
        key = root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf = root / "slurm.conf"
        self.conf.write_text(_conf(root))
        # SLURM counts a GPU only with a device file: character nodes made here, never opened.
        (root / "gpus").mkdir()
        for i in range(8):
            os.mknod(root / "gpus" / f"gpu{i}", 0o600 | stat.S_IFCHR, os.makedev(195, i))
        (root / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File={root}/gpus/gpu[0-7]\n")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        munge = self.root / "munge"
        self._run("munged", "--force", f"--socket={munge}/socket", f"--key-file={munge}/key",
                  f"--log-file={munge}/log", f"--pid-file={munge}/pid", f"--seed-file={munge}/seed")
        self._run("slurmctld", "-i")
        self._run("slurmd", "-N", NODE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.command("sinfo", "--noheader", "--format=%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not come up within {timeout:g} s: {self.logs()}")

    def stop(self) -> None:
        self.command("scontrol", "shutdown", check=False)  # slurmctld and slurmd
        pids = []
        for pid_file in ("slurmctld.pid", "slurmd.pid", "munge/pid"):
            try:
                pids.append(int((self.root / pid_file).read_text()))
            except (OSError, ValueError):  # never started
                continue
        for pid in pids:
            _end(pid)

    def command(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def _run(self, *argv: str) -> None:
        done = self.command(*argv, check=False)
        if done.returncode:
            raise RuntimeError(f"{argv[0]} did not start: {done.stderr.strip()} {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in
                         (self.root / "slurmctld.log", self.root / "slurmd.log", self.root / "munge" / "log") if p.exists())

    def restarts(self, job: str) -> int:
        """How many times the job was requeued and started again."""
        shown = self.command("scontrol", "show", "job", "--oneliner", job).stdout
        return int(re.search(r"\bRestarts=(\d+)", shown).group(1))

    def job_state(self, job: str) -> str:
        return self.command("squeue", "--noheader", "--states=all", "--format=%T", f"--jobs={job}",
                            check=False).stdout.strip()


def _end(pid: int, wait: float = 10) -> None:
    """SIGTERM, then up to `wait` seconds to end, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
