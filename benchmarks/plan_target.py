"""Each mesh_configs preset compiled for the hardware it names, by that hardware's own
compiler, ahead of time on this host (`spmd.plan --config P --target T`): XLA's peak
memory / the theory's, each collective row's measured / theory, and how much of each
axis's traffic has compute scheduled under it (XLA:GPU splits collectives into start and
done; XLA:TPU's optimized HLO shows no such split).

    pip install -e ".[aot-gpu]"   # XLA:GPU (3.4 GB); ".[aot-tpu]" for libtpu (214 MB)
    python benchmarks/plan_target.py                 # every preset whose compiler is installed
    python benchmarks/plan_target.py llama3-8b qwen3 # presets whose file name contains a NAME

Goals (issue 54): XLA's peak within 10% of the theory's, every row within 0.95-1.05.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from spmd.planner.targets import named_for

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1800


def read_preset(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def main(names: list[str]) -> int:
    rows = []
    for path in sorted((ROOT / "mesh_configs").glob("*.yaml")):
        if names and not any(n in path.stem for n in names):
            continue
        preset = read_preset(path)
        devices = 1
        for size in (preset.get("mesh") or {}).values():
            devices *= size
        target = named_for(preset.get("hardware"), devices)
        if target is None:
            continue
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "spmd.plan", "--config", str(path), "--target", target, "--json"],
                              capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT_S,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(f"{path.stem} on {target}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}", flush=True)
            continue
        plan = json.loads(done.stdout)
        rows.append(report(path.stem, target, plan, wall))
    worst = [r for r in rows if r]
    print(f"{len(worst)} presets compiled")
    return 0


def report(name: str, target: str, plan: dict, wall: float) -> dict:
    per = plan["per_device"]
    theory_peak = per["theory_peak_bytes"]
    xla_peak = per["xla"]["peak_bytes"] if per["xla"] else None
    gib = 2 ** 30
    print(f"\n{name} on {target} ({plan['mesh']}): compiled in {plan['compile_s']:.0f} s; "
          f"peak XLA {xla_peak / gib:.1f} GiB, theory {theory_peak / gib:.1f} GiB "
          f"(XLA / theory {xla_peak / theory_peak:.2f}); fits {plan['fits']}; "
          f"fused kernels {plan['fused_kernel_calls'] or 'none'}", flush=True)
    for c in plan["collectives"]:
        measured, expected, under = c["bytes_per_device"], c["theory_bytes_per_device"], c.get("under_compute_bytes")
        against = (f"theory {measured / expected:.2f}" if expected else "unexpected" if c.get("unexpected")
                   else "small")
        overlap = f"  under compute {under / measured:.0%}" if under is not None and measured else ""
        print(f"  {c['op']:>18} {c['axis']:<14} x{c['count']:<5} {measured / gib:9.3f} GiB  {against}{overlap}")
    return {"name": name, "target": target, "peak_ratio": xla_peak / theory_peak, "wall_s": wall}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
