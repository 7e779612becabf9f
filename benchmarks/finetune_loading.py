"""Fine-tuning records: how fast the host prepares packed rows (read, render the chat
template, tokenize, pack: spmd.data.stream, its worker processes) against how fast the
default training step consumes them, and the start-up time on a 1 GiB chat JSONL.

    python benchmarks/finetune_loading.py [--gib 1] [--windows 20] [--steps 10]

Prints `prepared tokens/s / consumed tokens/s` (goal: at least 10, so that loading never
holds a step up; both count the rows' positions, padding included) and the start-up time
of a source over the whole file (indexing its lines, then packing the first window). The
records are synthetic chats (a short question and answer, most fitting a row of the
default 65 tokens) rendered with the ChatML template of tests/sft, written until the file
holds --gib GiB; the step is `spmd.train`'s default (model small, its default mesh and
batch) on the synthetic data, timed after compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or "
         "had not but first one their its new after who they have has been two all more other").split()


def make_chats(path: Path, size: int) -> int:
    """Chat records until the file holds `size` bytes: 65,536 distinct ones, each line
    drawn at random, so that every window renders and tokenizes its own records."""
    import numpy as np

    rng = np.random.default_rng(0)
    say = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    lines = [(json.dumps({"messages": [{"role": "user", "content": say(int(rng.integers(1, 5)))},
                                       {"role": "assistant", "content": say(int(rng.integers(1, 8)))}]}) + "\n").encode()
             for _ in range(65536)]
    records = 0
    with open(path, "wb") as f:
        while f.tell() < size:
            f.write(b"".join(lines[i] for i in rng.integers(0, len(lines), 65536)))
            records += 65536
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the chat JSONL")
    parser.add_argument("--windows", type=int, default=20, help="windows of records to prepare, after the first")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np

    jax.config.update("jax_num_cpu_devices", 8)

    from spmd.config import TrainConfig, validate
    from spmd.data.stream import WINDOW, Rows, record_source
    from spmd.data.feed import global_batch
    from spmd.data.synthetic import MarkovSource
    from spmd.data.workers import default_workers
    from spmd.layout import make_layout
    from spmd.parallel.step import build_program

    cfg = validate(TrainConfig.of(model="small"))  # the default run's mesh, batch and seq, on the small model
    tmp = Path(tempfile.mkdtemp(prefix="spmd-finetune-bench-"))
    path = tmp / "chats.jsonl"
    try:
        records = make_chats(path, int(args.gib * 2**30))
        size = path.stat().st_size
        if hasattr(os, "posix_fadvise"):  # the start-up reads the file from the disk, not the page cache
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

        started = time.perf_counter()
        source = record_source(str(path), str(ROOT / "tests" / "sft" / "chatml"),
                               Rows(cfg.training.seq + 1, cfg.training.batch, cfg.training.seed))
        startup = time.perf_counter() - started
        first = source.first.rows

        # Every row of the next --windows windows, read as training reads them: the workers
        # tokenize ahead while the rows are read.
        started, rows, step = time.perf_counter(), 0, first // cfg.training.batch + 1
        while source.counts["examples"] < (args.windows + 1) * WINDOW:
            batch = source.rows(step, 0, cfg.training.batch, cfg.training.seq + 1)
            rows += int(np.count_nonzero(batch["segments"].any(axis=1)))
            step += 1
        prepared = rows * cfg.training.seq / (time.perf_counter() - started)
        source.close()
    finally:
        path.unlink()
        tmp.rmdir()

    layout = make_layout(cfg)
    program = build_program(cfg.step, layout)
    step_fn = program.compile_step()
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(0))
    chain = MarkovSource(layout.skeleton.model_cfg.vocab, 0)
    batches = [global_batch(chain, k, cfg.training.batch, cfg.training.seq + 1, layout.batch_sharding)
               for k in range(args.steps + 1)]
    state, metrics = step_fn(state, batches[0])
    jax.block_until_ready(metrics)
    times = []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    consumed = cfg.training.batch * cfg.training.seq / statistics.median(times)

    print(f"{records:,} chat records, {size / 2**30:.2f} GiB of JSONL; windows of {WINDOW:,} records, the first "
          f"packed into {first:,} rows of {cfg.training.seq + 1}; {default_workers()} worker process(es) on "
          f"{os.cpu_count()} CPUs")
    print(f"prepared: {prepared:,.0f} tokens/s ({args.windows} windows: reading, chat template, tokenizer, packing)")
    print(f"consumed: {consumed:,.0f} tokens/s (the default step: model small, mesh {cfg.parallelism.mesh}, "
          f"batch {cfg.training.batch} x {cfg.training.seq}, {statistics.median(times) * 1e3:.1f} ms)")
    print(f"prepared / consumed: {prepared / consumed:.1f} (goal: at least 10)")
    print(f"start-up: {startup:.1f} s for {size / 2**30:.2f} GiB (indexing its lines, then packing the first window)")


if __name__ == "__main__":
    main()
