"""What the command-line and fault tests share: the one-line check, a directory's
snapshot, the losses a metrics file records, and a private user and mount namespace to make
faults in."""

import json
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).parents[1] / "cli_driver.py"


def one_error_line(stderr: str) -> str:
    """The single `error: ...` line a command printed (fails on anything else)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under `root`, each file with its size and modification time: equal
    before and after means nothing was written there. (A directory's own time changes
    when a writability probe is made and removed in it, so only its presence counts.)"""
    def state(p: Path):  # (a broken link: its own)
        st = p.stat() if p.exists() else p.lstat()
        return st.st_size, st.st_mtime_ns

    return {str(p.relative_to(root)): None if p.is_dir() else state(p) for p in sorted(root.rglob("*"))}


def in_namespace(script: str, cwd: Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `script` (sh) as root of a private user and mount namespace (`unshare -rm`),
    where it may mount a tiny tmpfs or a read-only bind mount that no one else sees."""
    return subprocess.run(["unshare", "-rm", "sh", "-ec", script], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def losses_by_step(metrics_file: Path) -> dict[int, float]:
    """The loss of each step a --metrics-file records."""
    return {r["step"]: r["loss"] for r in map(json.loads, metrics_file.read_text().splitlines())}


def run_cases(cases: dict, files: dict, work: Path, timeout: float = 600, options=None) -> dict:
    """Each case (name -> (module, argv whose `{name}` fields are `files`' paths, ...)) in an
    empty working directory of its own under `work`, all run by one tests/cli_driver.py;
    `options(name)`: what else the driver takes for a case ("env", "limit").
    -> name -> (its result, its working directory)"""
    batch = []
    for i, (name, (module, argv, *_)) in enumerate(cases.items()):
        (work / str(i)).mkdir()
        batch.append({"module": module, "cwd": str(work / str(i)), "argv": [a.format(**files) for a in argv],
                      **(options(name) if options else {})})
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return {name: (result, work / str(i)) for i, (name, result) in enumerate(zip(cases, json.loads(done.stdout)))}
