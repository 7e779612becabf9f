"""What a process prints: one line per write, sizes in binary units."""

from __future__ import annotations

import sys


def emit(line: str) -> None:
    """Print one line with one write: the processes of a run may share a terminal or pipe,
    and print's separate write of the newline lets their lines interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError
