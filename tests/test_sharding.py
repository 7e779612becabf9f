"""State is born sharded, and each ZeRO stage holds what theory says per device."""

import jax
import numpy as np
import pytest
from support.parity import init_config, initial_state, train_run

from spmd.config import TrainConfig, validate
from spmd.layout import make_layout
from spmd.parallel.layout import bytes_per_device
from spmd.parallel.step import build_program

pytestmark = pytest.mark.xdist_group("layouts")  # they share compiled runs (support.parity)

PSI = 131_392  # parameters of the tiny model; every one has an `embed` dimension that divides 8
N = 8


@pytest.mark.parametrize("mesh,zero,params,opt", [
    # fp32 parameters (4 B) and Adam's two moments (8 B); DESIGN.md section 8.
    ("dp=8", 0, 4 * PSI, 8 * PSI),
    ("dp=8", 1, 4 * PSI, 8 * PSI // N),
    ("dp=8", 2, 4 * PSI, 8 * PSI // N),
    ("fsdp=8", 0, 4 * PSI // N, 8 * PSI // N),
])
def test_state_bytes_per_device_match_zero_theory(mesh, zero, params, opt):
    state = train_run(mesh, 8, zero=zero).program.abstract_state  # carries each leaf's sharding
    held = {"params": bytes_per_device(state["params"]), "opt_state": bytes_per_device(state["opt_state"])}
    assert held["params"] == params
    # Beyond the moments, the optimizer holds only step counters (a few int32 scalars).
    assert 0 <= held["opt_state"] - opt <= 16


def _born_sharded(mesh: str, **overrides) -> dict:
    run = train_run(mesh, 8, **overrides)
    with jax.set_mesh(run.layout.mesh):
        state = run.program.init(jax.random.key(0))
    # The same values as on one device (the other tests start from those).
    one_device = initial_state(init_config(run.cfg))
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(one_device), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    return state


def test_initializer_creates_state_already_sharded():
    state = _born_sharded("dp=2,fsdp=2,tp=2")
    wkv = state["params"]["blocks"]["attn"]["wkv"]  # (layers, embed, kv_heads, 2, head_dim)
    assert wkv.sharding.spec == jax.P("pp", ("fsdp", "sp"), "tp", None, None)  # pp and sp have size 1 here
    assert {s.data.shape for s in wkv.addressable_shards} == {(2, 32, 2, 2, 8)}
    mu = state["opt_state"][1][0].mu["blocks"]["mlp"]["down"]  # (layers, mlp, embed)
    assert mu.sharding.spec == jax.P("pp", "tp", ("fsdp", "sp"))


def test_experts_are_stored_split_over_ep():
    cfg = validate(TrainConfig.of(model="moe-tiny", mesh="ep=2,fsdp=2,tp=2"))
    state = build_program(cfg.step, make_layout(cfg)).abstract_state  # what init is jitted to produce
    gate_up = state["params"]["blocks"]["moe"]["mlp"]["gate_up"]  # (groups, experts, embed, 2, expert_mlp)
    assert gate_up.sharding.spec == jax.P("pp", "ep", ("fsdp", "sp"), None, "tp")
    assert gate_up.sharding.shard_shape(gate_up.shape) == (1, 4, 32, 2, 32)


def test_zero_splits_the_state_over_every_axis_that_replicates_a_weight():
    """ZeRO-1 on pp=2,ep=2,dp=2: the moments of the dense weights, in the stages or out
    (the embedding), are split over dp x ep, an expert's over dp (ep splits its experts
    already); the parameters stay as without ZeRO. (What it saves on DeepSeek-V3's layout:
    docs/deepseek.md.)"""
    cfg = validate(TrainConfig.of(model="moe-tiny", layers=4, mesh="pp=2,ep=2,dp=2", zero=1))
    state = build_program(cfg.step, make_layout(cfg)).abstract_state
    mu = state["opt_state"][1][0].mu
    specs = {name: leaf.sharding.spec for name, leaf in (
        ("embedding", mu["embedding"]), ("attention", mu["blocks"]["moe"]["attn"]["wo"]),
        ("experts", mu["blocks"]["moe"]["mlp"]["gate_up"]))}
    assert specs == {"embedding": jax.P("tp", ("fsdp", "sp", "dp", "ep")),
                     "attention": jax.P("pp", "tp", None, ("fsdp", "sp", "dp", "ep")),
                     "experts": jax.P("pp", "ep", ("fsdp", "sp", "dp"), None, "tp")}
    assert state["params"]["embedding"].sharding.spec == jax.P("tp", ("fsdp", "sp"))
    # Each mesh axis splits an array once, whatever the rules name it on.
    for leaf in jax.tree.leaves(state):
        axes = [a for entry in leaf.sharding.spec for a in ((entry,) if isinstance(entry, str) else entry or ())]
        assert len(axes) == len(set(axes)), leaf.sharding.spec
