"""What the command-line and fault tests share: the one-line check, a directory's
snapshot, the losses a metrics file records, and a private user and mount namespace to make
faults in."""

import json
import subprocess
from pathlib import Path


def one_error_line(stderr: str) -> str:
    """The single `error: ...` line a command printed (fails on anything else)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def snapshot(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under `root`, each file with its size and modification time: equal
    before and after means nothing was written there. (A directory's own time changes
    when a writability probe is made and removed in it, so only its presence counts.)"""
    return {str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def in_namespace(script: str, cwd: Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `script` (sh) as root of a private user and mount namespace (`unshare -rm`),
    where it may mount a tiny tmpfs or a read-only bind mount that no one else sees."""
    return subprocess.run(["unshare", "-rm", "sh", "-ec", script], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def losses_by_step(metrics_file: Path) -> dict[int, float]:
    """The loss of each step a --metrics-file records."""
    return {r["step"]: r["loss"] for r in map(json.loads, metrics_file.read_text().splitlines())}
