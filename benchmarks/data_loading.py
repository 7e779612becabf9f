"""Host time spent building batches, as a fraction of the step time, for each data
source; and the rows each process reads, from a real two-process run.

    python benchmarks/data_loading.py [--steps 30] [--mesh dp=2,fsdp=2,tp=2]

For the text and token-file sources (and the synthetic chain, for comparison), the same
steps are timed twice in one run: building the step's global batch on the host (what
the loop's prefetch thread does; it overlaps the devices' step, so this is an upper
bound on what data loading can cost), and the compiled step itself. Goal: under 2%.
Text is tokenized once at start-up; that time is printed apart, with the token file's.
Then `spmd.launch --nproc 2` trains on the corpus and each process reports the rows it
read; with dp spanning the processes each should read half of every batch.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or "
         "had not but first one their its new after who they have has been two all more other").split()


def make_corpus(root: Path, files: int = 200, words: int = 5000) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(files):
        (corpus / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(WORDS, words)) + "\n")
    return corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mesh", default="dp=2,fsdp=2,tp=2")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    from spmd.config import TrainConfig, validate
    from spmd.corpus import token_stream
    from spmd.data import global_batch, make_source
    from spmd.layout import make_layout
    from spmd.step import build_program

    tmp = Path(tempfile.mkdtemp(prefix="spmd-data-bench-"))
    corpus = make_corpus(tmp)
    tokens_file = tmp / "tokens.npy"
    np.save(tokens_file, token_stream(str(corpus)))
    print(f"corpus: {sum(f.stat().st_size for f in corpus.iterdir()) / 2**20:.1f} MiB of text in 200 files; "
          f"mesh {args.mesh}, batch 32 x 64, model tiny, {args.steps} steps each\n")
    print(f"{'source':12}{'start-up s':>12}{'batch ms':>11}{'step ms':>10}{'data/step':>11}{'rows/step':>11}")
    for name, data in (("synthetic", None), ("text", str(corpus)), ("token file", str(tokens_file))):
        cfg = validate(TrainConfig(mesh=args.mesh, data=data, steps=args.steps))
        layout = make_layout(cfg)
        started = time.perf_counter()
        source = make_source(cfg, layout.skeleton.model_cfg.vocab)
        startup = time.perf_counter() - started
        program = build_program(cfg, layout)
        step = program.compile_step()
        with jax.set_mesh(layout.mesh):
            state = program.init(jax.random.key(0))
        make = lambda k: global_batch(source, k, cfg.batch, cfg.seq + 1, layout.batch_sharding)  # noqa: E731
        state, _ = step(state, make(0))  # warm up
        batch_s, step_s = [], []
        for k in range(1, args.steps + 1):
            t0 = time.perf_counter()
            batch = jax.block_until_ready(make(k))
            t1 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            batch_s.append(t1 - t0)
            step_s.append(time.perf_counter() - t1)
        b, s = statistics.median(batch_s), statistics.median(step_s)
        print(f"{name:12}{startup:12.2f}{b * 1e3:11.2f}{s * 1e3:10.1f}{b / s:11.2%}"
              f"{source.rows_read / (args.steps + 1):11g}")

    print("\nrows read per process, two processes x 4 devices (spmd.launch), 4 steps of batch 32:")
    run = subprocess.run([sys.executable, "-m", "spmd.launch", "--nproc", "2", "--", sys.executable, "-m",
                          "spmd.train", "--mesh", args.mesh, "--data", str(tokens_file), "--steps", "4"],
                         capture_output=True, text=True, timeout=600)
    lines = re.findall(r"^\[process .*data: read .*$", run.stdout, re.M)
    print("\n".join(lines) if lines else f"the run failed:\n{run.stderr[-2000:]}")


if __name__ == "__main__":
    main()
