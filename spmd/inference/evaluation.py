"""`python -m spmd.eval`'s library: the mean loss of a model over a dataset, read through
training's pipeline and computed by training's compiled evaluation."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import jax

from spmd.base.errors import UserError
from spmd.data.feed import global_batch, make_source
from spmd.parallel.layout import make_layout
from spmd.parallel.step import build_program
from spmd.run.loop import MAX_STEPS_IN_FLIGHT, weighted_mean
from spmd.run.weights import load_params


def evaluate(cfg, checkpoint, batches: int | None, devices=None) -> tuple[float, int, int]:
    """Mean loss over the targets of `batches` batches (default: all) of `cfg.data.path`, on
    `devices` (default: all; started by spmd.run.bootstrap.start_devices_and_mesh).
    -> (loss, target tokens, batches)"""
    layout = make_layout(cfg.step, devices)
    source = make_source(cfg.data, cfg.training, layout.skeleton.model_cfg.vocab)
    try:
        steps = _batches(source, cfg, batches)
        evaluate_fn = build_program(cfg.step, layout, source.packed).compile_eval()
        params = load_params(cfg, layout, checkpoint)
        results = []
        split = "in order" if source.finite else "train"
        for j in steps:
            batch = global_batch(source, j, cfg.training.batch, cfg.training.seq + 1, layout.batch_sharding, split)
            results.append(evaluate_fn(params, batch))
            # A bounded queue: hundreds of executions in flight abort XLA:CPU's collectives on
            # emulated devices (seen with ep=2 at 494 batches), as in the training loop.
            if len(results) > MAX_STEPS_IN_FLIGHT:
                results[-MAX_STEPS_IN_FLIGHT - 1]["loss"].block_until_ready()
    finally:
        source.close()  # its worker processes
    loss, tokens = weighted_mean(jax.device_get(results))
    return loss, tokens, len(results)


def _batches(source, cfg, batches: int | None) -> Iterable[int]:
    """The batches to evaluate. Fine-tuning records: every example once, in order, the
    last batch filled with padding rows (which hold no targets). A token stream: its
    windows, in the run's order."""
    if source.finite:
        if not source.has_rows(0, "in order"):
            raise UserError(f"--data {cfg.data.path}: no target tokens: no example has a token to learn after its "
                            f"first within --seq {cfg.training.seq}")
        return itertools.takewhile(lambda j: (batches is None or j < batches) and
                                   source.has_rows(j * cfg.training.batch, "in order"), itertools.count())
    available = source.train_samples // cfg.training.batch
    if available < 1:
        raise UserError(f"--data {cfg.data.path}: {source.train_samples} samples of {cfg.training.seq + 1} tokens "
                        f"do not fill one batch of {cfg.training.batch}; give a smaller --batch or --seq")
    return range(min(batches or available, available))
