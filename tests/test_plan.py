"""spmd.plan: theory equals hand-computed values; XLA's compiled step matches theory."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.cases import tiered
from support.parity import train_run

from spmd.base import hardware
from spmd.config import TrainConfig, validate
from spmd.parallel.checks import FEATURES, REFUSED
from spmd.layout import make_layout
from spmd.planner import footprint, matrix, theory
from spmd.planner.counting import by_op_and_axes
from spmd.planner.plan import make_plan
from spmd.planner.report import roofline_lines
from spmd.planner.roofline import predict

pytestmark = pytest.mark.xdist_group("layouts")  # they share compiled runs (support.parity)

PSI = 131_392  # parameters of the tiny model
STACKED = 98_560  # of which in the 2 stacked blocks (gathered again in the backward pass)
TABLE, EMBED = 256 * 64, 64  # of which the embedding table (vocab x embed)
TOKENS = 32 * 32 // 8  # a device's tokens (batch 32 x seq 32 on 8 devices)
N = 8
F32 = 4


def _theory(mesh, devices=8, **overrides):
    import jax

    cfg = validate(TrainConfig.of(mesh=mesh, model="tiny", batch=32, seq=32, **overrides))
    layout = make_layout(cfg, jax.devices()[:devices])
    totals = by_op_and_axes(theory.collectives(cfg.step, layout))
    return footprint.memory(cfg.step, layout), {k: round(v) for k, v in totals.items()}


def test_theory_equals_hand_computed_values():
    # DP: replicas all-reduce the whole fp32 gradient, 2(N-1)/N of it.
    memory, comm = _theory("dp=8")
    assert (memory["params"], memory["opt_state"], memory["gradients"]) == (F32 * PSI, 2 * F32 * PSI, F32 * PSI)
    assert comm == {("all-reduce", "dp"): round(2 * 7 / 8 * F32 * PSI)}

    # ZeRO-1: optimizer state split 8 ways; gradients reduce-scattered to it, parameters re-gathered.
    memory, comm = _theory("dp=8", zero=1)
    assert (memory["params"], memory["opt_state"]) == (F32 * PSI, 2 * F32 * PSI / N)
    assert comm == {("reduce-scatter", "dp"): round(7 / 8 * F32 * PSI), ("all-gather", "dp"): round(7 / 8 * F32 * PSI)}

    # FSDP: everything split 8 ways; blocks gathered forward and again backward, the rest
    # once, but the embedding table: the lookup's 128 token ids a device are gathered to
    # it, and its rows sent back (an all-to-all), their gradients the same way.
    memory, comm = _theory("fsdp=8")
    assert (memory["params"], memory["opt_state"], memory["gradients"]) == (F32 * PSI / N, 2 * F32 * PSI / N, F32 * PSI / N)
    assert comm == {("all-gather", "fsdp"): round(7 / 8 * F32 * (PSI + STACKED - TABLE) + 7 * TOKENS * 4),
                    ("reduce-scatter", "fsdp"): round(7 / 8 * F32 * (PSI - TABLE)),
                    ("all-to-all", "fsdp"): round(2 * 7 / 8 * TOKENS * EMBED * F32)}

    # HSDP: reduce-scatter within fsdp=4 (the table's rows move instead), then all-reduce
    # of the quarter across dp=2.
    _, comm = _theory("dp=2,fsdp=4")
    assert comm[("reduce-scatter", "fsdp")] == round(3 / 4 * F32 * (PSI - TABLE))
    assert comm[("all-reduce", "dp")] == round(2 * 1 / 2 * F32 * PSI / 4)

    # TP=4: per layer 4 all-reduces of (tokens x embed), plus embedding lookup and head
    # gradient, plus 3 softmax statistics (tokens floats); 2(t-1)/t = 1.5 each.
    _, comm = _theory("tp=4", devices=4)
    tokens, embed = 32 * 32, 64
    assert comm == {("all-reduce", "tp"): round(1.5 * ((4 * 2 + 2) * tokens * embed * F32 + 3 * tokens * F32))}


@pytest.mark.parametrize("mesh,devices,overrides", [
    ("dp=8", 8, {}),
    ("dp=8", 8, {"zero": 1}),
    ("fsdp=8", 8, {}),
    ("dp=4,tp=2", 8, {"zero": 3}),
    ("tp=4", 4, {}),
    ("dp=2,fsdp=4", 8, {}),
    ("dp=2,fsdp=2,tp=2", 8, {"grad_accum": 4}),
    ("dp=2,sp=2", 4, {"grad_accum": 2}),
    ("tp=8", 8, {}),  # beyond the 4 kv heads: their gradients summed over the devices sharing one
])
@pytest.mark.floor  # the plan's reading of the HLO that each JAX version writes
def test_compiled_collectives_and_state_match_theory(mesh, devices, overrides):
    run = train_run(mesh, devices, **overrides)  # compiled once, shared with the parity tests
    plan = make_plan(run.cfg.step, run.layout, compiled=run.compiled)
    # Within 5% per collective and mesh axis (measured: equal to the byte). XLA:CPU
    # emits each reduce-scatter as all-reduce + dynamic-slice; spmd.planner.traffic counts it
    # as the reduce-scatter that XLA on GPU/TPU forms (the row says so).
    expected = [r for r in plan.rows if r.theory]
    assert expected
    for row in expected:
        assert row.measured == pytest.approx(row.theory, rel=0.05), row
    # Nothing unexpected: the only other collectives are scalar reductions (the loss, the
    # gradient norm's partial sums), a few hundred bytes in all.
    assert not any(r.unexpected for r in plan.rows)
    assert sum(r.measured for r in plan.rows if not r.theory) < 1024
    # The state XLA takes as arguments (less the batch) is what theory says each device
    # holds, plus the int32 step counters (the train step's and the optimizer's).
    assert 0 <= plan.measured_state - plan.theory_state <= 16


# benchmarks/plan_ratios.py compiles every pair of spmd.parallel.checks.FEATURES; CI a fixed
# sample of them: the pairs whose theory had to learn what XLA does (pipeline rounds of
# accumulation each reduce their gradients; a ragged matmul's output kept, not recomputed
# and summed over tp again), and two more kinds of map (experts with sequence chunks, LoRA).
PAIRS = dict((name, (fields, devices)) for name, fields, devices in matrix.pairs())
SAMPLE = ["pp+grad-accum", "tp+MoE", "ep+sp", "fsdp+LoRA"]
# And of the triples (the benchmark compiles all 286): those that the triples found wrong,
# accumulation's vmap with the experts' map inside (it crashed) and with gradients stored
# over fsdp and sp (an unexpected permute each step), Megatron-SP's table gradient where ep
# replicates the table (reduce-scattered over ep as over dp), a pipeline with two
# automatic axes, Megatron-SP with capacity dispatch (each choice's gradient gathered and
# the buffers moved over tp, before the experts' output was constrained whole) and with
# LoRA (the attention's input gradient all-reduced whole).
TRIPLES = dict((name, (fields, devices)) for name, fields, devices in matrix.triples())
TRIPLE_SAMPLE = ["sp+MoE+grad-accum", "fsdp+sp+grad-accum", "ep+tp+Megatron-SP", "pp+fsdp+tp",
                 "tp+capacity+Megatron-SP", "tp+Megatron-SP+LoRA"]
# The matrix runs remat none; recomputation changes what is sent again (name@policy): "dots"
# gathers Megatron-SP's projection inputs again (under LoRA, the adapted ones'), both policies
# reduce the experts' outputs again (the gates' gradient reads them), "full" an MoE layer's
# shared expert too, and the ring's recomputed hop at sp=2 is the backward's (sent once).
REMAT_SAMPLE = ["sp+tp+Megatron-SP@dots", "tp+MoE+Megatron-SP@full", "tp+Megatron-SP+LoRA@dots"]


def test_the_matrix_has_every_pair_of_features_that_combines():
    assert len(PAIRS) == len(FEATURES) * (len(FEATURES) - 1) // 2 - len(REFUSED)
    assert set(SAMPLE) <= set(PAIRS) and set(TRIPLE_SAMPLE) | {n.partition("@")[0] for n in REMAT_SAMPLE} <= set(TRIPLES)


@pytest.mark.parametrize("name", tiered(SAMPLE + TRIPLE_SAMPLE + REMAT_SAMPLE, lambda n: n,
                                        gate=["fsdp+LoRA", "sp+MoE+grad-accum"]))  # a pair and a triple
def test_every_row_of_a_pair_of_features_matches_theory(name):
    """Each collective kind per mesh-axis group and the state, measured / theory in
    0.95-1.05 (the goal of benchmarks/plan_ratios.py); an unexpected collective fails."""
    import jax

    name, _, remat = name.partition("@")
    fields, devices = {**PAIRS, **TRIPLES}[name]
    cfg = validate(TrainConfig.of(**fields, **({"remat": remat} if remat else {})))
    ratios = matrix.ratios(make_plan(cfg.step, make_layout(cfg, jax.devices()[:devices])))
    assert len(ratios) > 1
    assert {row: ratio for row, ratio in ratios.items() if not 0.95 <= ratio <= 1.05} == {}


def test_expert_copies_cost_their_copies_rows_over_ep():
    """balance.tie gathers the R copy slots' gradients and their homes' (2R expert rows per
    MoE layer) and all-reduces them over ep: bytes in R, not in the number of experts."""
    import jax

    def tie_bytes(**overrides):
        cfg = validate(TrainConfig.of(mesh="ep=4,dp=2", model="moe-tiny", layers=8, batch=32, seq=32, **overrides))
        layout = make_layout(cfg, jax.devices()[:8])
        return sum(e.bytes_per_device for e in theory.collectives(cfg.step, layout)
                   if e.why.startswith("expert copies"))

    row = 3 * 64 * 64 * F32  # an expert's gate, up and down projections
    moe_layers = 4
    assert tie_bytes(redundant_experts=4) == 2 * 3 / 4 * moe_layers * 2 * 4 * row
    assert tie_bytes(redundant_experts=4, experts=16) == tie_bytes(redundant_experts=4)
    assert tie_bytes(redundant_experts=8) == 2 * tie_bytes(redundant_experts=4)


def test_zero_bubble_counts_the_latent_up_projections_and_the_norms_with_b():
    """zb-v's B computes, besides the norm scales', the gradients of the matrices whose
    input the backward pass recomputes from what B reads: DeepSeek-V3's wq_b and wkv_b
    (their latents come through unnamed norms). The model lists them (RECOMPUTED_INPUT_WEIGHTS):
    the split of a latent attention (traced, nothing compiled) must agree. Their gradients,
    and the norms' (stored as a (2, layers/2) stack), are reduced with the bubble: each
    of B's runs, not W's m (deepseek-v3-tiny, pp=2,ep=4,dp=2, zb-v, m=4: all-reduce ep was
    1.05 of theory, wq_b, wkv_b and the norms counted 8 times per stage where XLA reduces
    them 10 times; 1.00 with them in B)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models import PRESETS
    from models.deepseek3.model import DeepSeekV3, LatentAttention
    from models.llama.model import REMAT_POLICIES
    from spmd.parallel.pipeline.split import split_backward
    from spmd.planner.counting import is_vector, params, stage_overhead

    model_cfg = PRESETS["deepseek-v3-tiny"]
    graph, weights = nnx.split(nnx.eval_shape(lambda: LatentAttention(model_cfg, jnp.float32, nnx.Rngs(0))))
    weights = nnx.to_pure_dict(weights)
    remat = REMAT_POLICIES["none"]  # zb-v's

    def stage(chunk, x, side=None, fixed=None):
        return jax.checkpoint(lambda c, x: nnx.merge(graph, c)(x, np.arange(8)), policy=remat)(chunk, x)

    x = jax.ShapeDtypeStruct((1, 8, model_cfg.embed), jnp.float32)
    forward, backward_input, _, _ = split_backward(stage, weights, x)
    out, b_residuals, _ = jax.eval_shape(forward, weights, x)
    grads = jax.eval_shape(lambda w, r, ct: backward_input(w, r, ct)[0], weights, b_residuals, out)
    paths = [".".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(weights)[0]]
    in_b = {"attn." + path for path, g in zip(paths, grads) if g is not None and "norm" not in path}
    assert in_b == set(DeepSeekV3.RECOMPUTED_INPUT_WEIGHTS)

    cfg = validate(TrainConfig.of(mesh="pp=2,ep=4", model="deepseek-v3-tiny", layers=6, pp_schedule="zb-v",
                               microbatches=4, batch=32, seq=32))
    layout = make_layout(cfg, jax.devices()[:8])
    stage_runs = 4 * stage_overhead(layout)
    runs = {p.path: theory._stage_gradient_runs(cfg, layout, p, stage_runs) for p in params(layout, cfg) if p.stacked}
    assert stage_runs == 5
    assert is_vector(next(p for p in params(layout, cfg) if p.path == "blocks.attn_norm.scale"))
    assert {path for path, n in runs.items() if n == stage_runs} == {
        "blocks.attn_norm.scale", "blocks.mlp_norm.scale", "blocks.attn.q_norm.scale", "blocks.attn.kv_norm.scale",
        "blocks.mlp.bias", "blocks.attn.wq_b", "blocks.attn.wkv_b"}
    assert {n for n in runs.values() if n != stage_runs} == {4}


@pytest.mark.parametrize("schedule", ["zb-v", "1f1b"])
def test_a_prefix_before_stages_that_hold_the_head_reduces_its_gradients_as_computed(schedule):
    """Schedules that run the head in the stages (1f1b, zb-v) sum its gradients over the
    ticks in float32 before reducing them; a prefix of layers before the stages (DeepSeek-V3's
    dense ones) runs once per round, outside them, and reduces its matrices' gradients in
    the compute dtype (deepseek-v3-tiny, pp=2,ep=4,dp=2, zb-v, ZeRO-1, bf16: all-reduce pp+ep
    was 0.56 of theory and reduce-scatter dp 0.78, the prefix counted in float32; 1.00 with
    bf16). Here: the prefix's and the table's gradients are reduce-scattered over dp+ep
    (ZeRO splits their state over both) in the compute dtype, and then all-reduced over pp;
    beside them, once per step, the float32 sums over the ticks of the weights in the stages
    that are whole on every dp and ep device, the head's among them (the map's sum and
    ZeRO's slice of it)."""
    import jax

    from spmd.planner.counting import in_head, live, params, spec_axes, uses

    cfg = validate(TrainConfig.of(mesh="pp=2,ep=2,dp=2", model="deepseek-v3-tiny", layers=6, pp_schedule=schedule,
                               microbatches=4, batch=32, seq=32, dtype="bfloat16", zero=1))
    layout = make_layout(cfg, jax.devices()[:8])
    model_cfg = layout.skeleton.model_cfg
    scattered = [p for p in params(layout, cfg) if (p.prefix or p.path == "embedding")
                 and "dp" in live(spec_axes(p.names, layout.rules.grads), layout.shape)]
    assert {p.path for p in scattered} >= {"embedding", "prefix.mlp.gate_up", "prefix.attn.wq_a"}
    # float32 for the table (read in float32) and the norm scales, bfloat16 for the matrices
    half = sum(p.numel / 2 * max(uses(p, model_cfg, 2)) for p in scattered)
    assert sum(p.numel * max(uses(p, model_cfg, 2)) for p in scattered if p.path.endswith(("gate_up", "wq_a"))) == \
        2 * sum(p.numel for p in scattered if p.path.endswith(("gate_up", "wq_a")))
    whole = [p for p in params(layout, cfg) if (p.stacked and "experts" not in p.names or in_head(layout, p))
             and {"dp", "ep"} <= set(live(spec_axes(p.names, layout.rules.grads), layout.shape))]
    stages = sum(p.numel / 2 * 4 for p in whole if p.stacked)  # a stage's half of the layers
    head = sum(p.numel * 4 for p in whole if not p.stacked)
    assert stages and head
    comm = by_op_and_axes(theory.collectives(cfg.step, layout))
    assert comm[("reduce-scatter", "dp+ep")] == pytest.approx(3 / 4 * (2 * half + stages + head))
    assert comm[("all-reduce", "pp")] == pytest.approx((2 * half + head) / 4)  # the head's sum over the stages too


def test_a_model_of_two_kinds_of_layer_with_a_tied_table_matches_theory():
    """Gemma 3's sliding and global layers each run ring attention over sp, in the two
    branches of a conditional; one branch runs per layer, so the K/V hops count once
    (counted in both branches they were 2.00 of theory). Its tied table's gradient is
    reduced once per use, the lookup's and the head's (counted once it was 1.10)."""
    golden = Path(__file__).with_name("hf") / "gemma3"
    run = train_run("sp=2,tp=2", 4, model=None, init_from=str(golden))  # shared with test_parity
    plan = make_plan(run.cfg.step, run.layout, compiled=run.compiled)
    rows = {(r.op, r.axes): r for r in plan.rows}
    for key in (("collective-permute", "sp"), ("reduce-scatter", "sp"), ("all-gather", "sp"), ("all-reduce", "tp")):
        assert rows[key].measured == pytest.approx(rows[key].theory, rel=0.05), rows[key]
    # The q/k norms' gradients are summed over sp+tp, the whole mesh, where the step's
    # scalar sums (loss, gradient norm) go too: a few hundred bytes beside 384.
    assert 0 <= rows[("all-reduce", "sp+tp")].measured - rows[("all-reduce", "sp+tp")].theory < 256


# Each family's golden on a layout that splits its weights over fsdp and tp (tp beyond the
# kv heads but DeepSeek-V3's, whose latent attention has as many as heads): every collective
# kind per mesh-axis group within 2% of theory (the bound: a family whose parts add
# collectives teaches the planner). OLMo 2's q/k norms over the whole projections sum their
# statistics over tp (1.037 of theory until the theory counted them: `split_norms`); under
# remat "full" a norm after each sublayer reads the MLP's output, made again (OLMo 2 read
# 1.196, Gemma 3 1.181). Under Megatron-SP and a remat policy, OLMo 2's attention reads the
# block's input, kept gathered, where a pre-norm block's reads its norm's output, gathered
# again (OLMo 2's all-gathers over tp read 0.849 of a theory that gathered both sublayers'
# inputs again, under "dots" and "full"). Compiled only (test_parity trains some of these layouts).
FAMILY_PLANS = [("llama-gqa", "fsdp=2,tp=4", {}), ("mixtral", "fsdp=2,tp=4", {}), ("qwen3", "fsdp=2,tp=4", {}),
                ("qwen3-moe", "fsdp=2,tp=4", {}), ("qwen2", "fsdp=2,tp=4", {}), ("mistral", "fsdp=2,tp=4", {}),
                ("gemma3", "fsdp=2,tp=4", {}), ("deepseek-v3", "fsdp=2,tp=4", {}), ("olmo2", "fsdp=2,tp=4", {}),
                ("olmo2", "fsdp=2,tp=4", {"remat": "full"}),
                *[("olmo2", "fsdp=2,tp=4", {"megatron_sp": True, "remat": remat}) for remat in ("dots", "full")]]
SCALAR_SUMS = 256  # bytes: the step's scalar reductions (loss, gradient norm) ride on the smallest rows
GOLDENS = Path(__file__).with_name("hf")


@pytest.mark.parametrize("golden,mesh,options", FAMILY_PLANS,
                         ids=[f"{g}-{m}" + "".join(f"-{k if v is True else v}" for k, v in o.items())
                              for g, m, o in FAMILY_PLANS])
def test_a_familys_compiled_collectives_match_theory_within_two_percent(golden, mesh, options):
    import jax

    cfg = validate(TrainConfig.of(mesh=mesh, model=None, init_from=str(GOLDENS / golden), batch=32, seq=32, **options))
    plan = make_plan(cfg.step, make_layout(cfg, jax.devices()[:8]))
    rows = [r for r in plan.rows if r.theory]
    assert rows and not any(r.unexpected for r in plan.rows)
    off = {(r.op, r.axes): (round(r.measured / r.theory, 3), r.measured, r.theory) for r in rows
           if not 0.98 <= r.measured / r.theory <= 1.02 and not 0 <= r.measured - r.theory < SCALAR_SUMS}
    assert off == {}


def test_every_registered_family_has_a_plan_row():
    """Each architecture a registered family reads (models.HF_LAYOUTS' ARCHITECTURES: Mixtral's
    and Qwen3-MoE's beside their dense ones) has a golden in FAMILY_PLANS: a new family adds one."""
    from models import FAMILIES, HF_LAYOUTS

    covered = {a for golden, _, _ in FAMILY_PLANS
               for a in json.loads((GOLDENS / golden / "config.json").read_text())["architectures"]}
    missing = {a for family in FAMILIES for a in HF_LAYOUTS[family].ARCHITECTURES} - covered
    assert not missing, f"no FAMILY_PLANS row reads {sorted(missing)}: add a golden's tp/fsdp layout"


def test_json_has_the_documented_keys():
    run = train_run("dp=2,fsdp=2,tp=2", 8)
    cfg = validate(run.cfg.replace(hardware="h100"))
    data = make_plan(cfg.step, run.layout, compiled=run.compiled, hardware=hardware.get("h100")).as_json()
    per_device = data["per_device"]
    assert per_device["state_bytes"] > 0 and per_device["xla"]["argument_bytes"] > per_device["state_bytes"]
    assert per_device["xla"]["temp_bytes"] > 0
    ops = {(c["op"], c["axis"]) for c in data["collectives"]}
    assert {("all-gather", "fsdp"), ("reduce-scatter", "fsdp"), ("all-reduce", "dp"), ("all-reduce", "tp")} <= ops
    assert set(data["theory"]["collective_bytes_per_device"]) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert data["fits"] is True
    assert 0 < data["predicted_step_time_s"] and 0 < data["predicted_mfu"] < 1


# A device with 48 MiB: the small model's replicas need 16 B x 3.3M parameters (50 MiB) for
# their state alone; split over fsdp or tp, it fits. Run in a process of its own: XLA:CPU
# crashed twice (a segmentation fault) compiling one of its candidates in a test worker
# that had compiled hundreds of programs before, never in a fresh process (7 of 7).
AUTO = """
import dataclasses, json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
from spmd.base import hardware
from spmd.config import TrainConfig, validate
from spmd.layout import make_layout
from spmd.planner import plan
from spmd.planner.plan import auto, make_plan

plan.AUTO_SHOWN = 2  # confirm the best two, not five: fewer compiles
tiny_device = dataclasses.replace(hardware.get("h100"), name="48MiB", memory_gib=48 / 1024)
devices = jax.devices()[:4]
cfg = validate(TrainConfig.of(mesh="dp=4", model="small", batch=8, seq=64))
pure_dp = make_plan(cfg.step, make_layout(cfg, devices), hardware=tiny_device)
plans, searched = auto(cfg.step, devices, tiny_device, "4 emulated CPU devices")
json.dump({"pure_dp_fits": pure_dp.fits, "searched": searched, "memory": tiny_device.memory_bytes(4),
           "plans": [{"fits": p.fits, "peak": p.peak, "dp": p.layout.shape["dp"], "zero": p.cfg.parallelism.zero,
                      "step_s": p.prediction.step_s} for p in plans]}, sys.stdout)
"""


def test_auto_finds_a_layout_where_pure_data_parallel_does_not_fit():
    done = subprocess.run([sys.executable, "-c", AUTO], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["pure_dp_fits"] is False
    plans = found["plans"]
    assert 1 <= len(plans) <= 2 and "fit" in found["searched"]
    assert all(p["fits"] and p["peak"] <= found["memory"] for p in plans)
    assert all(p["dp"] < 4 or p["zero"] > 0 for p in plans)  # never plain replicas
    steps = [p["step_s"] for p in plans]
    assert steps == sorted(steps)


@pytest.mark.slow  # a plan of many devices
def test_llama3_70b_plans_on_tp_16_beyond_its_8_kv_heads():
    # Two of its 80 layers: the shapes and the sharing of kv heads are the model's.
    cmd = [sys.executable, "-m", "spmd.plan", "--model", "llama3-70b", "--layers", "2", "--mesh", "fsdp=2,tp=16",
           "--batch", "4", "--seq", "256", "--dtype", "bfloat16", "--remat", "full", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(c["op"], c["axis"]): c for c in json.loads(out.stdout)["collectives"]}
    # Each kv head is shared by 2 of the 16 tp devices: its gradient is summed over those 2
    # (neighbours), then the 8 heads' are gathered for the projection stored whole.
    assert {("all-reduce", "tp:inner2"), ("all-gather", "tp:outer8")} <= set(rows)
    for row in rows.values():
        assert not row.get("unexpected"), row
        if row["theory_bytes_per_device"]:
            assert row["bytes_per_device"] == pytest.approx(row["theory_bytes_per_device"], rel=0.05), row


def test_the_roofline_labels_an_axis_as_it_counted_its_seconds():
    """Gradients over ep overlap with compute, tokens' all-to-all over ep does not: the
    prediction counts them apart, and the report says how much of ep is exposed."""
    cfg = validate(TrainConfig.of(mesh="ep=2,dp=4", model="moe-tiny", batch=32, seq=32))
    shape = {"pp": 1, "dp": 4, "fsdp": 1, "ep": 2, "sp": 1, "tp": 1}
    h100 = hardware.get("h100")
    traffic = [("all-reduce", "ep", 3e9), ("all-to-all", "ep", 1e9), ("all-reduce", "dp", 2e9)]
    p = predict(cfg.step, shape, cfg.model_cfg, traffic, h100)
    assert p.exposed_by_axes["ep"] == pytest.approx(p.comm_s["ep"] / 4)
    assert p.exposed_by_axes["dp"] == 0 and p.exposed_s == pytest.approx(p.exposed_by_axes["ep"])
    plan = SimpleNamespace(prediction=p, hardware=h100, layout=SimpleNamespace(shape=shape), cfg=cfg)
    line = roofline_lines(plan)[0]
    assert re.search(r"ep [\d.]+ ms \(intra-node, [\d.]+ ms of it exposed\)", line), line
    assert re.search(r"dp [\d.]+ ms \(intra-node, overlapped\)", line), line
