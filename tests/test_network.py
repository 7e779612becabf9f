"""Two hosts over a real network: two network namespaces joined by a veth pair, made here
(as root), one process of the run in each, `--dcn dp=2` across them. The run trains to
the losses of one process, the bytes on the wire per step are what the plan says crosses
`dp`, and when one host's process is killed the other exits with one line within
--step-timeout while the last checkpoint stays whole (it resumes)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.commands import losses_by_step

from spmd.formats.checkpoint import finalized_steps

pytestmark = [pytest.mark.xdist_group("multihost"),  # one worker for the runs of several processes
              pytest.mark.slow]  # processes on two network namespaces

SUBNET = "10.77.0"
PORT = 7010
STEPS = 200  # the run is killed long before: 60 steps or so are measured and compared
FLAGS = ["--mesh", "dp=2,tp=4", "--batch", "16", "--seq", "32", "--warmup", "1", "--log-every", "1"]
STEP_TIMEOUT = 20
FIRST, LAST = 10, 50  # the steps between which the wire is read
# What each packet carries besides the collectives' bytes: Ethernet, IPv4 and TCP (with
# timestamps) headers, and gloo's preamble of each message (5 size_t/int fields, 40 bytes).
# gloo sends without delay (TCP_NODELAY) and this layout's messages are under the MTU:
# a packet is a message. The data is ~900 messages a step here, so the overhead is 13%.
HEADERS = 14 + 20 + 32 + 40


class Hosts:
    """Network namespaces `{tag}0` and `{tag}1` at SUBNET.1 and SUBNET.2, joined by a veth
    pair and nothing else. Each resolves this machine's host name to its own address (what
    a real host's resolver does), which is where the collectives' library (gloo) listens."""

    def __init__(self, tag: str):
        self.names = [f"{tag}{i}" for i in range(2)]
        self.links = [f"{tag}v{i}" for i in range(2)]

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def create(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self.links[0], "netns", self.names[0], "type", "veth", "peer", "name", self.links[1],
            "netns", self.names[1])
        for i, (name, link) in enumerate(zip(self.names, self.links)):
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", link)
            # A large MTU: the bytes counted on the link are the collectives', hardly TCP's headers.
            _ip("-n", name, "link", "set", link, "mtu", "65000", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            etc = Path("/etc/netns", name)  # `ip netns exec` mounts these over /etc
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")

    def remove(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns", name), ignore_errors=True)

    def sent(self, i: int) -> tuple[int, int]:
        """Bytes and packets host i has sent over the link."""
        shown = json.loads(_ip("-n", self.names[i], "-s", "-j", "link", "show", self.links[i]))
        tx = shown[0]["stats64"]["tx"]
        return tx["bytes"], tx["packets"]

    def start(self, i: int, args: list[str], env: dict) -> subprocess.Popen:
        command = ["ip", "netns", "exec", self.names[i], sys.executable, "-m", "spmd.train", *args,
                   "--coordinator", f"{self.address(0)}:{PORT}", "--num-processes", "2", "--process-id", str(i)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="session")  # once per worker, whatever runs between its tests
def hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        reason = "two network namespaces need root and iproute2's ip"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    made = Hosts(f"spmd{os.getpid()}h")
    try:
        made.create()
        yield made
    finally:
        made.remove()


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")  # once per worker, whatever runs between its tests
def run(hosts, tmp_path_factory):
    """One run over both hosts, its wire read at steps FIRST and LAST, then host 1's process
    killed; beside it one process on the whole mesh and the plan of the layout."""
    tmp = tmp_path_factory.mktemp("network")
    env = dict(os.environ)
    train = [*FLAGS, "--steps", str(STEPS)]
    one = subprocess.Popen([sys.executable, "-m", "spmd.train", *train, "--metrics-file", str(tmp / "one.jsonl")], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    plan = subprocess.Popen([sys.executable, "-m", "spmd.plan", *FLAGS, "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    two = [*train, "--dcn", "dp=2", "--out", str(tmp / "ckpt"), "--save-every", "10",
           "--metrics-file", str(tmp / "two.jsonl"), "--step-timeout", str(STEP_TIMEOUT), "--join-timeout", "120"]
    procs = [hosts.start(i, two, env) for i in range(2)]
    sent, lines = {}, []
    try:
        deadline = time.monotonic() + 400
        for line in procs[0].stdout:  # process 0 logs every step
            lines.append(line)
            if (m := re.match(r"\[\s*(\d+)/", line)) and int(m.group(1)) in (FIRST, LAST):
                sent[int(m.group(1))] = (hosts.sent(0), hosts.sent(1))
            past_last = len(sent) == 2 and m and int(m.group(1)) >= LAST + 12
            if past_last or time.monotonic() > deadline:
                break
        procs[1].kill()  # host 1's process dies mid-run (its host went down)
        killed = time.monotonic()
        rest, err = procs[0].communicate(timeout=STEP_TIMEOUT + 60)
        ended_after = time.monotonic() - killed
    finally:
        _kill(*procs)
    _, one_err = one.communicate(timeout=300)
    assert one.returncode == 0, one_err
    plan_out, plan_err = plan.communicate(timeout=300)
    assert plan.returncode == 0, plan_err
    return dict(tmp=tmp, sent=sent, out="".join(lines) + rest, err=err, code=procs[0].returncode,
                ended_after=ended_after, plan=json.loads(plan_out), env=env)



def test_two_hosts_train_to_the_losses_of_one_process(run):
    two, one = losses_by_step(run["tmp"] / "two.jsonl"), losses_by_step(run["tmp"] / "one.jsonl")
    steps = sorted(set(two) & set(one))
    assert steps[0] == 0 and steps[-1] >= LAST  # the steps before the kill
    # Sums over the devices grouped otherwise (across the hosts, then within): float32's last bits.
    np.testing.assert_allclose([two[s] for s in steps], [one[s] for s in steps], rtol=1e-6)


def test_the_bytes_on_the_wire_are_what_the_plan_says_crosses_dp(run):
    """Per step, each host sends its devices' share of the collectives over `dp` (the axis
    --dcn puts across): 4 devices x the plan's bytes per device. (On dp=2,fsdp=2,tp=2,
    XLA:CPU all-reduces the gradients over dp and fsdp at once, where GPUs and TPUs
    reduce-scatter over fsdp first: gloo's flat ring then crosses the hosts 1.8x as often.)"""
    sent = run["sent"]
    assert set(sent) == {FIRST, LAST}, run["out"]
    rows = [r for r in run["plan"]["collectives"] if "dp" in r["axis"].split("+")]
    theory = 4 * sum(r["theory_bytes_per_device"] or 0 for r in rows)
    for host in range(2):
        (b0, p0), (b1, p1) = sent[FIRST][host], sent[LAST][host]
        measured = (b1 - b0) / (LAST - FIRST)
        packets = (p1 - p0) / (LAST - FIRST)
        payload = measured - HEADERS * packets
        print(f"host {host}: {measured:,.0f} B/step on the wire in {packets:,.0f} packets, {payload:,.0f} B of "
              f"collectives; the plan's {theory:,.0f} B: {payload / theory:.3f}")
        assert 0.95 < payload / theory < 1.05


def test_killing_one_host_ends_the_other_in_one_line_and_keeps_the_last_checkpoint(run):
    assert run["code"] not in (0, None)
    assert run["ended_after"] < STEP_TIMEOUT + 30  # bounded by --step-timeout, with start-up of the exit
    errors = [line for line in run["err"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"did another process die\?|did not finish within", errors[0]), run["err"]
    ckpt = run["tmp"] / "ckpt"
    last = finalized_steps(ckpt)[-1]
    assert last >= LAST
    # Whole: it resumes, in one process on another mesh, and trains on.
    resumed = subprocess.run([sys.executable, "-m", "spmd.train", *FLAGS, "--mesh", "fsdp=4,tp=2", "--resume",
                              str(ckpt / str(last)), "--steps", str(last + 2), "--resume-with-changes"], env=run["env"], capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt / str(last)}" in resumed.stdout
