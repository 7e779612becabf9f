"""Fine-tuning records: how fast the host prepares tokens (read, render the chat template,
tokenize, pack) against how fast the default training step consumes them, and the
start-up time per gigabyte of chat JSONL.

    python benchmarks/finetune_loading.py [--records 20000] [--steps 10]

Prints `prepared tokens/s / consumed tokens/s` (goal: at least 10, so that loading never
holds a step up) and the start-up time of a source over the records, scaled to 1 GB.
The records are synthetic chats (a short question and answer, most fitting a row of the
default 65 tokens) rendered with the ChatML template of tests/sft; the step is `spmd.train`'s default (model small,
its default mesh and batch) on the synthetic data, timed after compiling.
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


def make_chats(path: Path, records: int) -> int:
    import numpy as np

    rng = np.random.default_rng(0)
    say = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(records):
            messages = [{"role": "user", "content": say(int(rng.integers(1, 5)))},
                        {"role": "assistant", "content": say(int(rng.integers(1, 8)))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax

    jax.config.update("jax_num_cpu_devices", 8)

    from spmd.config import TrainConfig, validate
    from spmd.data.packing import PackedSource
    from spmd.data.records import read_examples
    from spmd.data.synthetic import MarkovSource, global_batch
    from spmd.data.tokenizer import load_tokenizer_directory
    from spmd.parallel.layout import make_layout
    from spmd.parallel.step import build_program

    cfg = validate(TrainConfig(model="small"))  # the default run's mesh, batch and seq, on the small model
    tmp = Path(tempfile.mkdtemp(prefix="spmd-finetune-bench-"))
    size = make_chats(tmp / "chats.jsonl", args.records)

    started = time.perf_counter()
    examples = read_examples(str(tmp / "chats.jsonl"), load_tokenizer_directory(str(ROOT / "tests" / "sft" / "chatml")))
    source = PackedSource(examples, cfg.seq + 1, cfg.batch, cfg.seed)
    startup = time.perf_counter() - started
    tokens = sum(e.ids.size for e in examples)
    prepared = tokens / startup  # read, render, tokenize and pack: all of it happens at start-up today

    layout = make_layout(cfg)
    program = build_program(cfg, layout)
    step = program.compile_step()
    with jax.set_mesh(layout.mesh):
        state = program.init(jax.random.key(0))
    chain = MarkovSource(layout.skeleton.model_cfg.vocab, 0)
    batches = [global_batch(chain, k, cfg.batch, cfg.seq + 1, layout.batch_sharding) for k in range(args.steps + 1)]
    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    times = []
    for batch in batches[1:]:
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    consumed = cfg.batch * cfg.seq / statistics.median(times)

    print(f"{args.records:,} chat records, {size / 2**20:.1f} MiB of JSONL, {tokens:,} tokens, packed into "
          f"{source.train_samples:,} rows of {cfg.seq + 1}")
    print(f"prepared: {prepared:,.0f} tokens/s (reading, chat template, tokenizer, packing; one process)")
    print(f"consumed: {consumed:,.0f} tokens/s (the default step: model small, mesh {cfg.mesh}, batch {cfg.batch} x "
          f"{cfg.seq}, {statistics.median(times) * 1e3:.1f} ms)")
    print(f"prepared / consumed: {prepared / consumed:.1f} (goal: at least 10)")
    print(f"start-up: {startup:.2f} s for {size / 2**20:.1f} MiB, {startup * 2**30 / size:.0f} s per GiB of JSONL "
          f"(every record is tokenized at start-up, in memory)")


if __name__ == "__main__":
    main()
