"""Which collectives of a pipelined MoE step XLA:GPU schedules under compute, per
schedule: the step compiled ahead of time for 8 H100s (`spmd.plan --target h100x8`,
no GPU needed), and for each collective row the share of its bytes whose start and done
have compute scheduled between them (spmd.planner.hlo.overlapped). For 1F1B, zb-v and
DualPipe, where each tick runs one microbatch's forward and another's backward, that
is the experts' all-to-all over ep and the sends over pp hidden under the other
microbatch's work.

    pip install -e ".[aot-gpu]"                # XLA:GPU (3.4 GB)
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/pipeline_overlap.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

LAYOUT = ["--model", "deepseek-v3-tiny", "--mesh", "pp=2,ep=4", "--layers", "6", "--microbatches", "4",
          "--batch", "16", "--seq", "128", "--dtype", "bfloat16"]
SCHEDULES = ("1f1b", "zb-v", "dualpipe")


def plan(schedule: str) -> dict:
    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    out = subprocess.run([sys.executable, "-m", "spmd.plan", "--target", "h100x8", "--json", *LAYOUT,
                          "--pp-schedule", schedule], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def main() -> None:
    rows = {}
    for schedule in SCHEDULES:
        for c in plan(schedule)["collectives"]:
            if c["bytes_per_device"] >= 1024:
                share = c.get("under_compute_bytes", 0) / c["bytes_per_device"]
                rows.setdefault(f"{c['op']} {c['axis']}", {})[schedule] = share
    print("share of each collective's bytes with compute scheduled under it (XLA:GPU, 8 x H100, ahead of time)")
    print(f"{'collective':28}" + "".join(f"{s:>10}" for s in SCHEDULES))
    for name, shares in sorted(rows.items()):
        print(f"{name:28}" + "".join(f"{shares[s]:>10.0%}" if s in shares else f"{'-':>10}" for s in SCHEDULES))


if __name__ == "__main__":
    main()
