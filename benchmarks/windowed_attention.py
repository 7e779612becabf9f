"""Sliding-window attention's memory: temporaries grow linearly with the sequence.

The train step of the small model with a window of 256 (as Mistral's or Gemma 3's local
layers, scaled down) is compiled (nothing runs) for one sequence of 1k, 2k and 4k tokens,
with the xla kernel (a band of two windows per query block) and the chunked one (blocks
outside the window skipped); XLA's memory analysis gives the temporaries. Goal: each
doubling of the sequence doubles them (ratio to the 1k step 2 and 4), where the xla
kernel without a window grows quadratically (its scores are seq x seq).

    python benchmarks/windowed_attention.py [--window 256]
"""

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

from models import PRESETS  # noqa: E402
from spmd.base.console import human_bytes  # noqa: E402
from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.parallel.step import build_program  # noqa: E402

SEQS = (1024, 2048, 4096)


def temporaries(kernel: str, seq: int, window: int | None) -> int:
    model = dataclasses.replace(PRESETS["small"], window=window)
    cfg = validate(TrainConfig.of(mesh="", model=None, architecture=model, batch=1, seq=seq, attention_kernel=kernel))
    compiled = build_program(cfg.step, make_layout(cfg, jax.devices()[:1])).compile_step()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    print(f"small model, 1 sequence, float32, remat none; temporaries and their ratio to the {SEQS[0]}-token step "
          f"(linear: {', '.join(str(s // SEQS[0]) for s in SEQS)})\n")
    print(f"{'kernel':10}{'window':>8}" + "".join(f"{s:>12}{'ratio':>7}" for s in SEQS))
    for kernel, window in (("xla", args.window), ("chunked", args.window), ("xla", None)):
        sizes = [temporaries(kernel, seq, window) for seq in SEQS]
        print(f"{kernel:10}{window or 'none':>8}" + "".join(f"{human_bytes(t):>12}{t / sizes[0]:7.2f}" for t in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
