"""Mixture of experts: every ep layout trains to the numbers of one device, tokens travel
by all-to-all, and a small capacity drops tokens (counted) without stopping training."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from support.cases import tiered
from support.parity import assert_params_match, train_run
from test_parity import LOSS_RTOL

from models.moe import MoEConfig, Routing
from spmd.parallel import experts
from spmd.planner.plan import make_plan

pytestmark = pytest.mark.xdist_group("moe")  # the all-to-all test reads the parity test's runs

# moe-tiny: 8 experts, top-2. A capacity factor of experts / k gives every expert room for
# a whole sequence, so capacity mode drops nothing and must match dropless exactly.
NO_DROPS = {"moe_dispatch": "capacity", "capacity_factor": 4.0}
# A capacity factor of 1 drops about a fifth of the choices (test_with_sp_capacity_...).
DROPS = {"moe_dispatch": "capacity", "capacity_factor": 1.0}
LAYOUTS = [(mesh, devices, {}) for mesh, devices in (("ep=2", 2), ("ep=4", 4), ("ep=8", 8), ("ep=2,fsdp=2,tp=2", 8))]
LAYOUTS += [(mesh, devices, NO_DROPS) for mesh, devices in (("ep=2", 2), ("ep=8", 8), ("ep=2,fsdp=2,tp=2", 8))]
# Accumulation: capacity and the balance loss are per sequence, so microbatches compose.
# With ep the experts' all-to-all runs inside the per-shard vmap over dp and fsdp; dropless
# runs its grouped matmul there too (models.ragged).
ACCUMULATED = [("dp=2,fsdp=2", 4, NO_DROPS), ("dp=2", 2, {}), ("ep=2", 2, {}), ("ep=2", 2, NO_DROPS)]
LAYOUTS += [(mesh, devices, mode | {"grad_accum": 2}) for mesh, devices, mode in ACCUMULATED]
# With sp each device routes its chunk of every sequence (and drops what one device drops:
# test_with_sp_capacity_drops_what_one_device_drops).
LAYOUTS += [("sp=2,ep=2", 4, {})]
# sp with accumulation (ep=1): the vmap over the batch shards takes ep, so the experts' map
# inside it must not name ep (a crash of every sp + MoE + accumulation run until the
# triples of spmd.planner.matrix compiled it).
LAYOUTS += [("sp=2", 2, mode | {"grad_accum": 2}) for mode in ({}, NO_DROPS)]
# ZeRO-1 over dp and ep: the dense weights' state split over both, the experts' over dp.
LAYOUTS += [("ep=2,dp=2", 4, {"zero": 1})]


@pytest.fixture(scope="module")
def moe_reference():
    return train_run("", 1, model="moe-tiny")  # dropless, every expert on the one device


# The gate keeps a dropless, a capacity and an sp layout; the others are slow. The floor pass
# repeats one: the exchange of experts differs between JAX versions.
@pytest.mark.parametrize("mesh,devices,mode", tiered(
    LAYOUTS, [f"{m}-{o.get('moe_dispatch', 'dropless')}{'-accum' if 'grad_accum' in o else ''}" for m, _, o in LAYOUTS],
    gate=["ep=2-dropless", "ep=4-dropless", "ep=2,fsdp=2,tp=2-capacity", "sp=2-dropless-accum"],
    floor=["ep=2-dropless"]))
def test_expert_parallel_layout_matches_one_device(moe_reference, mesh, devices, mode):
    run = train_run(mesh, devices, model="moe-tiny", **mode)
    np.testing.assert_allclose(run.losses, moe_reference.losses, rtol=LOSS_RTOL, atol=0)
    assert moe_reference.losses[-1] < moe_reference.losses[0] - 0.05  # it learns, so matching means something
    assert_params_match(run.params, moe_reference.params)
    # The auxiliary terms are part of what was minimized; they match too (the loss's tolerance).
    for name in ("aux_loss", "z_loss", "imbalance"):
        np.testing.assert_allclose(run.metrics[name], moe_reference.metrics[name], rtol=LOSS_RTOL)
    assert np.all(run.metrics["dropped"] == 0)


@pytest.mark.parametrize("mesh,devices,mode", [
    ("ep=2", 2, {}), ("ep=2", 2, NO_DROPS), ("ep=2,fsdp=2,tp=2", 8, NO_DROPS),
    ("ep=2,fsdp=2,tp=2", 8, {"dtype": "bfloat16"}),  # compiles (bf16 gradients of replicated experts once crashed XLA:CPU)
    ("ep=2", 2, {"grad_accum": 2}), ("ep=2", 2, NO_DROPS | {"grad_accum": 2}), ("sp=2,ep=2", 4, {}),
    ("sp=2,ep=2", 4, DROPS),
], ids=["ep2-dropless", "ep2-capacity", "ep2-fsdp2-tp2-capacity", "ep2-fsdp2-tp2-dropless-bf16", "ep2-dropless-accum",
        "ep2-capacity-accum", "sp2-ep2-dropless", "sp2-ep2-capacity-drops"])
@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_tokens_move_by_all_to_all_and_expert_weights_are_never_gathered_over_ep(mesh, devices, mode):
    run = train_run(mesh, devices, model="moe-tiny", **mode)  # compiled once, shared with the parity test
    rows = {(r.op, r.axes): r for r in make_plan(run.cfg.step, run.layout, compiled=run.compiled).rows}
    to_all = rows[("all-to-all", "ep")]
    # There and back forward, the gradients of both backward, in every microbatch; dropless
    # also sends the expert index of each row.
    assert to_all.count == (4 if "moe_dispatch" in mode else 5) * mode.get("grad_accum", 1)
    assert to_all.measured == pytest.approx(to_all.theory, rel=0.05)
    # No all-gather involves ep: each device keeps its own experts and no device ever
    # holds another's (fsdp still gathers the embed split of weights, as for dense ones).
    assert not [key for key in rows if key[0] == "all-gather" and "ep" in key[1]]
    for row in rows.values():
        assert not row.unexpected, row
        if row.theory:
            assert row.measured == pytest.approx(row.theory, rel=0.05), row


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_with_sp_capacity_drops_what_one_device_drops():
    """Capacity is per whole sequence even when sp splits it: each device ranks its chunk's
    choices by their place in the sequence, so the same choices are dropped."""
    one = train_run("", 1, model="moe-tiny", **DROPS)
    split = train_run("sp=2,ep=2", 4, model="moe-tiny", **DROPS)  # compiled once, shared with the all-to-all test
    assert np.all(one.metrics["dropped"] > 0.1)  # a fifth of the choices: the test means something
    np.testing.assert_array_equal(split.metrics["dropped"], one.metrics["dropped"])
    np.testing.assert_allclose(split.losses, one.losses, rtol=LOSS_RTOL, atol=0)
    assert_params_match(split.params, one.params)


def test_small_capacity_drops_tokens_reports_it_and_still_trains(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "spmd.train", "--model", "moe-tiny", "--mesh", "ep=2", "--moe-dispatch", "capacity",
           "--capacity-factor", "0.5", "--steps", "12", "--warmup", "1", "--log-every", "6", "--batch", "8",
           "--seq", "32", "--metrics-file", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 12
    # Capacity per expert per sequence: ceil(0.5 x 32 x 2 / 8) = 4 slots, so 8 experts take
    # at most 32 of a sequence's 64 choices: at least half are dropped.
    assert all(r["dropped"] >= 0.5 for r in records)
    assert all(np.isfinite(r["loss"]) and r["imbalance"] >= 1.0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.1  # still learning without the dropped tokens
    assert "dropped" in [line for line in proc.stdout.splitlines() if line.startswith("[")][-1]  # so does the log


@pytest.mark.floor  # the MoE exchange differs between JAX versions
def test_ragged_all_to_all_model_follows_the_documented_example():
    """jax.lax.ragged_all_to_all's documentation, two devices: the model of it that stands in
    for the op on XLA:CPU gives the documented results."""
    mesh = jax.make_mesh((2,), (experts.AXIS,), devices=jax.devices()[:2])
    args = [np.array(a) for a in ([[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
                                  [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
    one = lambda *a: experts.ragged_all_to_all_model(*(x[0] for x in a), axis_name=experts.AXIS)[None]  # noqa: E731
    run = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=jax.P(experts.AXIS), out_specs=jax.P(experts.AXIS)))
    got = run(*jax.device_put(args, jax.NamedSharding(mesh, jax.P(experts.AXIS))))
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.mark.floor  # the MoE exchange differs between JAX versions
def test_ragged_exchange_trains_like_the_padded_one(monkeypatch, moe_reference):
    """GPUs and TPUs send dropless tokens with jax.lax.ragged_all_to_all, which XLA:CPU lacks
    (spmd.parallel.experts.ragged_exchange picks it by backend). Here the same offsets and
    sizes drive the model of its documented semantics: on ep=4 (uneven loads: a random
    router), forward and backward, the run matches one device as the padded path does."""
    calls = []

    def exchange(*args, **kwargs):
        calls.append(kwargs["axis_name"])
        return experts.ragged_all_to_all_model(*args, **kwargs)

    monkeypatch.setattr(experts, "ragged_exchange", lambda mesh: exchange)
    run = train_run("ep=4", 4, cached=False, model="moe-tiny")
    assert calls, "the ragged path did not run"
    np.testing.assert_allclose(run.losses, moe_reference.losses, rtol=LOSS_RTOL, atol=0)
    assert_params_match(run.params, moe_reference.params)
    np.testing.assert_allclose(run.metrics["aux_loss"], moe_reference.metrics["aux_loss"], rtol=LOSS_RTOL)


def test_a_capacity_factor_past_every_token_keeps_every_token():
    """Slots per expert stop at the sequence: a factor past experts / top-k (even 1e308,
    which once overflowed to a traceback) keeps every token, as dropless does."""
    moe = MoEConfig(experts=8, top_k=2, expert_mlp=16)
    assert Routing("capacity", 1.0).capacity(32, moe) == 8
    assert [Routing("capacity", f).capacity(32, moe) for f in (4.0, 1e308)] == [32, 32]


@pytest.mark.parametrize("sizes", [(10, 0, 17, 6), (33, 0, 0, 0), (0, 0, 0, 37), (0, 0, 0, 0)])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_the_grouped_matmul_by_pieces_is_the_ragged_dot(sizes, rows):
    """GPUs run the experts' grouped matmul in pieces of one expert's rows (models.ragged.by_pieces):
    the same values and gradients as jax.lax.ragged_dot, with empty groups, a group of many
    pieces, rows past the groups (zeros), and pieces longer than every row. Float32; a
    piece's matmul sums its rows' products as the ragged dot does, but XLA:CPU blocks
    them otherwise: the few float32 ulps of 1e-5."""
    import jax.numpy as jnp

    from models.ragged import by_pieces

    x = jax.random.normal(jax.random.key(0), (37, 8))
    w = jax.random.normal(jax.random.key(1), (4, 8, 5))
    sizes = jnp.array(sizes, jnp.int32)

    def both(product):
        value = product(x, w)
        grads = jax.grad(lambda x, w: jnp.sum(jnp.sin(product(x, w))), argnums=(0, 1))(x, w)
        return value, *grads

    pieces = both(lambda x, w: by_pieces(x, w, sizes, rows))
    for got, want in zip(pieces, both(lambda x, w: jax.lax.ragged_dot(x, w, sizes))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(pieces[0][int(sizes.sum()):])


def test_the_experts_grouped_matmul_for_gpus_is_no_ragged_dot():
    """XLA:GPU expands a ragged dot into a dense matmul over every expert (G times the
    FLOPs, a (G, rows, embed) buffer: 16 GiB a matmul on the Qwen3-30B-A3B preset, whose
    step held 98.3 GiB). Lowered for CUDA, the experts' forward and backward hold none,
    but the pieces' loop; for TPUs libtpu's ragged dot stays."""
    import jax.numpy as jnp

    from models.moe import grouped_experts

    def step(tokens, expert, gate_up, down):
        loss = lambda *w: jnp.sum(grouped_experts(w[0], expert, *w[1:]))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(tokens, gate_up, down)

    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((64, 16), "bfloat16"), ((64,), "int32"),
                                                      ((4, 16, 2, 8), "bfloat16"), ((4, 8, 16), "bfloat16"))]
    lowered = {p: jax.export.export(jax.jit(step), platforms=[p])(*shapes).mlir_module() for p in ("cuda", "tpu")}
    assert "chlo.ragged_dot" not in lowered["cuda"] and "stablehlo.while" in lowered["cuda"]
    assert "chlo.ragged_dot" in lowered["tpu"]
