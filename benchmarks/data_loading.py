"""Host time spent building batches, as a fraction of the step time, for each data
source; and the rows each process reads, from a real two-process run.

    python benchmarks/data_loading.py [--steps 30] [--mesh dp=2,fsdp=2,tp=2]

For the text and token-file sources (and the synthetic chain, for comparison), one run
measures, per source:
- `build`: the host time to build a step's global batch (what the loop's prefetch
  thread does, timed alone between steps), against the compiled step's time;
- `waited`: the time the trainer's loop (`spmd.run.loop`, prefetching as it does) spent
  waiting for its batches, against the loop's step time. This is what data loading
  costs a run; goal: under 2%.
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
    from spmd.data.corpus import token_stream
    from spmd.data.feed import make_source
    from spmd.layout import make_layout

    tmp = Path(tempfile.mkdtemp(prefix="spmd-data-bench-"))
    corpus = make_corpus(tmp)
    tokens_file = tmp / "tokens.npy"
    np.save(tokens_file, token_stream(str(corpus)))
    print(f"corpus: {sum(f.stat().st_size for f in corpus.iterdir()) / 2**20:.1f} MiB of text in 200 files; "
          f"mesh {args.mesh}, batch 32 x 64, model tiny, {args.steps} steps each\n")
    print(f"{'source':12}{'start-up s':>11}{'build ms':>10}{'step ms':>9}{'build/step':>12}"
          f"{'waited/step':>13}{'rows/step':>11}")
    for name, data in (("synthetic", None), ("text", str(corpus)), ("token file", str(tokens_file))):
        cfg = validate(TrainConfig.of(mesh=args.mesh, data=data, steps=args.steps, log_every=args.steps))
        layout = make_layout(cfg)
        started = time.perf_counter()
        source = make_source(cfg.data, cfg.training, layout.skeleton.model_cfg.vocab)
        startup = time.perf_counter() - started
        build, step = _build_and_step(cfg, layout, source, args.steps)
        waited, step_s, rows = _loop_wait(cfg, layout)
        print(f"{name:12}{startup:11.2f}{build * 1e3:10.2f}{step * 1e3:9.1f}{build / step:12.2%}"
              f"{waited / step_s:13.3%}{rows:11g}")

    print("\nrows read per process, two processes x 4 devices (spmd.launch), 4 steps of batch 32:")
    run = subprocess.run([sys.executable, "-m", "spmd.launch", "--nproc", "2", "--", sys.executable, "-m",
                          "spmd.train", "--mesh", args.mesh, "--data", str(tokens_file), "--steps", "4"],
                         capture_output=True, text=True, timeout=600)
    lines = re.findall(r"^\[process .*data: read .*$", run.stdout, re.M)
    print("\n".join(lines) if lines else f"the run failed:\n{run.stderr[-2000:]}")


def _build_and_step(cfg, layout, source, steps: int) -> tuple[float, float]:
    """Median seconds to build a batch on the host, and to run the compiled step on it."""
    import jax

    from spmd.data.feed import global_batch
    from spmd.parallel.step import build_program

    program = build_program(cfg.step, layout)
    step = program.compile_step()
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(0))
    make = lambda k: global_batch(source, k, cfg.training.batch, cfg.training.seq + 1,  # noqa: E731
                                  layout.batch_sharding)
    state, _ = step(state, make(0))  # warm up
    build_s, step_s = [], []
    for k in range(1, steps + 1):
        t0 = time.perf_counter()
        batch = jax.block_until_ready(make(k))
        t1 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        build_s.append(t1 - t0)
        step_s.append(time.perf_counter() - t1)
    return statistics.median(build_s), statistics.median(step_s)


def _loop_wait(cfg, layout) -> tuple[float, float, float]:
    """The trainer's own loop: mean seconds per step spent waiting for the next batch,
    mean step time (its records), and rows this process read per step."""
    import spmd.run.loop
    from spmd.train import prepare

    waited = []
    real_next = spmd.run.loop.Prefetcher.next

    def timed_next(self):
        t0 = time.perf_counter()
        batch = real_next(self)
        waited.append(time.perf_counter() - t0)
        return batch

    spmd.run.loop.Prefetcher.next = timed_next
    try:
        run = prepare(cfg, layout, log=lambda _: None)
        result = run.loop()
    finally:
        spmd.run.loop.Prefetcher.next = real_next
    steady = slice(1, None)  # the first step waits for the prefetch thread's start
    step_s = statistics.mean(r["step_time_s"] for r in result.records[steady])
    return statistics.mean(waited[steady]), step_s, run.source.rows_read / cfg.training.steps


if __name__ == "__main__":
    main()
