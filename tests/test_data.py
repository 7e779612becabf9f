"""The synthetic source: indexed by (seed, step, row), never by the mesh; its floor is right."""

import jax
import numpy as np

from spmd.data.feed import global_batch
from spmd.data.synthetic import MarkovSource
from spmd.parallel.mesh import build_mesh, resolve_mesh


def _sharding(mesh_sizes):
    mesh = build_mesh(resolve_mesh(mesh_sizes, 8))
    return jax.sharding.NamedSharding(mesh, jax.P(("dp", "fsdp", "ep"), None))


def test_rows_are_a_pure_function_of_seed_step_and_row():
    source = MarkovSource(256, seed=3)
    whole = source.rows(5, 0, 16, 33)
    np.testing.assert_array_equal(source.rows(5, 4, 12, 33), whole[4:12])
    assert not np.array_equal(source.rows(6, 0, 16, 33), whole)
    assert not np.array_equal(MarkovSource(256, seed=4).rows(5, 0, 16, 33), whole)


def test_global_batch_is_the_same_on_every_mesh():
    source = MarkovSource(256, seed=0)
    want = source.rows(2, 0, 16, 33)
    for sizes in ({"dp": 8}, {"fsdp": 2, "tp": 4}, {"tp": 8}, {"dp": 2, "fsdp": 2, "tp": 2}):
        got = global_batch(source, 2, 16, 33, _sharding(sizes))
        np.testing.assert_array_equal(np.asarray(got), want)


def test_replicated_rows_are_generated_once(monkeypatch):
    source = MarkovSource(256, seed=0)
    calls = []
    real = source.rows
    monkeypatch.setattr(source, "rows", lambda *a: calls.append(a) or real(*a))
    sharding = _sharding({"dp": 2, "tp": 4})  # 2 row ranges, each held by 4 devices
    global_batch(source, 0, 16, 33, sharding)
    assert sorted((a[1], a[2]) for a in calls) == [(0, 8), (8, 16)]
    assert source.rows_read == 16  # what the source counts: each row once


def test_entropy_floor_is_the_true_chains_cross_entropy():
    source = MarkovSource(64, seed=1)
    rows = source.rows(0, 0, 4000, 17)
    prob = {(a, b): p for a in range(64) for b, p in zip(source.successors[a], source.probs[a])}
    nll = -np.mean([np.log(prob[(a, b)]) for row in rows for a, b in zip(row[:-1], row[1:])])
    # 64,000 samples of a per-token NLL with standard deviation ~0.5 nats: the mean's
    # standard error is ~0.002; 0.01 is five of them.
    assert abs(nll - source.entropy_floor(16)) < 0.01
    assert 0.5 < source.entropy_floor(16) < np.log(4)
