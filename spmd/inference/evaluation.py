"""`python -m spmd.eval`'s library: the mean loss of a model over a dataset, read through
training's pipeline and computed by training's compiled evaluation."""

from __future__ import annotations

import jax

from spmd.base.errors import UserError
from spmd.data.packing import PackedSource
from spmd.data.synthetic import global_batch, make_source
from spmd.parallel.layout import make_layout
from spmd.parallel.step import build_program
from spmd.run.bootstrap import start_devices
from spmd.run.loop import MAX_STEPS_IN_FLIGHT, weighted_mean
from spmd.run.weights import load_params


def evaluate(cfg, checkpoint, batches: int | None, devices=None) -> tuple[float, int, int]:
    """Mean loss over the targets of `batches` batches (default: all) of `cfg.data`, on
    `devices` (default: all). -> (loss, target tokens, batches)"""
    start_devices(cfg)
    layout = make_layout(cfg, devices)
    source = make_source(cfg, layout.skeleton.model_cfg.vocab)
    # Fine-tuning records: every example once, in order, the last batch filled with padding
    # rows (which hold no targets). A token stream: its windows, in the run's order.
    every_example = isinstance(source, PackedSource)
    available = -(-source.train_samples // cfg.batch) if every_example else source.train_samples // cfg.batch
    split = "in order" if every_example else "train"
    if available < 1:
        raise UserError(f"--data {cfg.data}: {source.train_samples} samples of {cfg.seq + 1} tokens do not fill one "
                        f"batch of {cfg.batch}; give a smaller --batch or --seq")
    batches = min(batches or available, available)
    evaluate_fn = build_program(cfg, layout, getattr(source, "packed", False)).compile_eval()
    params = load_params(cfg, layout, checkpoint)
    results = []
    for j in range(batches):
        batch = global_batch(source, j, cfg.batch, cfg.seq + 1, layout.batch_sharding, split)
        results.append(evaluate_fn(params, batch))
        # A bounded queue: hundreds of executions in flight abort XLA:CPU's collectives on
        # emulated devices (seen with ep=2 at 494 batches), as in the training loop.
        if len(results) > MAX_STEPS_IN_FLIGHT:
            results[-MAX_STEPS_IN_FLIGHT - 1]["loss"].block_until_ready()
    loss, tokens = weighted_mean(jax.device_get(results))
    return loss, tokens, batches
