"""Packed rows (several examples per row, fine-tuning data) train as if each example had a
row of its own: the loss and gradients of a packed batch equal those of the same examples
one per row with padding, on every attention kernel and across sp; and the loss is the
mean over the step's counted targets, so --grad-accum does not change the step."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from support.parity import assert_params_match, init_config, initial_state

from spmd.config import TrainConfig, validate
from spmd.layout import make_layout
from spmd.parallel.staged import Auxiliary
from spmd.parallel.step import build_program, target_counts

SEQ = 32
VOCAB = 256


def _examples(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, loss mask) of examples 3 to 20 tokens long; the mask trains a random suffix
    (a completion after its prompt) and never the first token."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(count):
        n = int(rng.integers(3, 21))
        mask = np.zeros(n, bool)
        mask[int(rng.integers(1, n)):] = True
        examples.append((rng.integers(0, VOCAB, n).astype(np.int32), mask))
    return examples


def _rows(groups: list[list[tuple[np.ndarray, np.ndarray]]], length: int) -> dict:
    """Each group of examples packed into one row of `length` tokens, padding after them."""
    rows = {"tokens": np.zeros((len(groups), length), np.int32), "segments": np.zeros((len(groups), length), np.int32),
            "loss_mask": np.zeros((len(groups), length), bool)}
    for r, group in enumerate(groups):
        at = 0
        for segment, (tokens, mask) in enumerate(group, 1):
            rows["tokens"][r, at:at + len(tokens)] = tokens
            rows["segments"][r, at:at + len(tokens)] = segment
            rows["loss_mask"][r, at:at + len(tokens)] = mask
            at += len(tokens)
        assert at <= length
    return rows


def _packed(examples, rows: int, length: int) -> list[list]:
    """First fit, in order, into `rows` rows."""
    groups, used = [[] for _ in range(rows)], [0] * rows
    for example in examples:
        r = next(i for i in range(rows) if used[i] + len(example[0]) <= length)
        groups[r].append(example)
        used[r] += len(example[0])
    return groups


# Eight rows of 33 tokens hold these 16 examples; one per row, they need 16 rows.
EXAMPLES = _examples(0, 16)
PACKED = _rows(_packed(EXAMPLES, 8, SEQ + 1), SEQ + 1)
ONE_PER_ROW = _rows([[e] for e in EXAMPLES], SEQ + 1)


def _program(mesh: str, devices: int, batch: int, **overrides):
    cfg = validate(TrainConfig.of(mesh=mesh, model="tiny", batch=batch, seq=SEQ, steps=1, lr=3e-3, warmup=1,
                                  **overrides))
    return build_program(cfg.step, make_layout(cfg, jax.devices()[:devices]), packed=True)


def _params(program):
    step = program.cfg  # the run's sections a step is built from
    cfg = TrainConfig(step.model, dataclasses.replace(step.training, batch=8), step.optimizer, step.parallelism,
                      step.moe, step.lora)
    state = initial_state(init_config(cfg))
    shardings = jax.tree.map(lambda s: s.sharding, program.abstract_state["params"])
    return jax.device_put(program.layout.stored(state["params"]), shardings)


def _loss_and_grads(program, rows: dict):
    def loss_and_grads(params, rows):
        metrics, grads = program._loss_and_grads(params, rows, Auxiliary(denominator=target_counts(rows)))
        return metrics["loss"], grads

    with jax.set_mesh(program.layout.mesh):
        rows = jax.device_put(rows, program.layout.batch_sharding)
        return jax.device_get(jax.jit(loss_and_grads)(_params(program), rows))


@functools.lru_cache(maxsize=None)
def _one_per_row(layers: int):
    return _loss_and_grads(_program("", 1, len(ONE_PER_ROW["tokens"]), attention_kernel="xla", layers=layers),
                           ONE_PER_ROW)


@pytest.mark.parametrize("mesh, devices, overrides", [  # the gate keeps the first; the others are more layouts
    ("", 1, dict(attention_kernel="xla")),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("", 1, dict(attention_kernel="chunked")),
        ("sp=2", 2, dict(attention_kernel="chunked")),
        ("sp=4", 4, dict(attention_kernel="xla")),
        ("dp=2,sp=2", 4, dict(attention_kernel="xla", attention="all-gather")),
        # Pipelines: the stages read each microbatch's examples; the head counts its targets.
        ("pp=2,dp=2", 4, dict(microbatches=4)),
        ("pp=2,dp=2", 4, dict(pp_schedule="1f1b", microbatches=2, grad_accum=2)),
        ("pp=2,sp=2", 4, dict(pp_schedule="interleaved-1f1b", pp_repeats=2, layers=4, microbatches=2)),
        ("pp=2", 2, dict(pp_schedule="zb-v", layers=4, microbatches=4)),
    ]],
])
def test_packed_rows_train_as_one_example_per_row(mesh, devices, overrides):
    # float32 sums of the same terms in another order (rows, blocks, ranks): 1e-5 relative.
    program = _program(mesh, devices, 8, **overrides)
    if program.cfg.training.grad_accum > 1:
        step = jax.jit(lambda params, rows: program._train_step(program._start(params), rows)[1]["loss"])
        with jax.set_mesh(program.layout.mesh):
            loss = step(_params(program), jax.device_put(PACKED, program.layout.batch_sharding))
        np.testing.assert_allclose(loss, _one_per_row(program.cfg.model.layers or 2)[0], rtol=1e-5)
        return
    loss, grads = _loss_and_grads(program, PACKED)
    want_loss, want_grads = _one_per_row(program.cfg.model.layers or 2)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        # Chunked pipelines store the layers as (repeats, layers / repeats): in order, row-major.
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-6)


def test_a_step_is_the_same_with_gradient_accumulation():
    # Uneven masks: the four microbatches hold different numbers of targets, so a mean of
    # their means would differ from the step's mean (by far more than float32 rounding).
    results = []
    for accumulation in (1, 4):
        program = _program("dp=2", 2, 8, grad_accum=accumulation)
        state = program.start(_params(program))
        with jax.set_mesh(program.layout.mesh):
            state, metrics = program.step(state, jax.device_put(PACKED, program.layout.batch_sharding))
        results.append(jax.device_get((state["params"], metrics)))
    (params_1, metrics_1), (params_4, metrics_4) = results
    counted = PACKED["loss_mask"][:, 1:] & (PACKED["segments"][:, 1:] == PACKED["segments"][:, :-1])
    # Microbatch i is row i of each dp shard's four (spmd.parallel.step._split_locally).
    assert len(set(counted.sum(axis=1).reshape(2, 4).sum(axis=0))) > 1
    np.testing.assert_allclose(metrics_4["loss"], metrics_1["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_4["grad_norm"], metrics_1["grad_norm"], rtol=1e-5)
    assert_params_match(params_4, params_1)  # after Adam's first step: support.parity says why its tolerances
