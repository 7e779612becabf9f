"""Pipeline stages over pp: every schedule trains to the numbers of one device, executes
the work its bubble formula says, and 1F1B keeps fewer activations than GPipe."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
import pytest
from support.cases import tiered
from support.parity import PARITY, assert_params_match, train_run

from models.llama.presets import PRESETS
from spmd.base.errors import UserError
from spmd.config import TrainConfig, validate
from spmd.formats.checkpoint import Checkpoints, make_meta
from spmd.layout import make_layout
from spmd.parallel.skeleton import restack
from spmd.parallel.staged import stage_parts
from spmd.parallel.step import build_program
from spmd.parallel.pipeline.zero_bubble import executed_over_useful, timetable
from spmd.planner import hlo
from spmd.planner.hlo import chunk_dot_flops
from spmd.planner.plan import make_plan

pytestmark = pytest.mark.xdist_group("pipeline")  # they share compiled runs (support.parity)

DEEP = {"layers": 8}  # divides into pp x repeats = 2 x 2, 4 x 2 chunks

LAYOUTS = [
    # (mesh, devices, overrides)
    ("pp=4", 4, {"microbatches": 8}),
    ("pp=4", 4, {"pp_schedule": "circular", "pp_repeats": 2, "microbatches": 4}),
    ("pp=4", 4, {"pp_schedule": "1f1b", "microbatches": 8}),
    ("pp=2,dp=2,tp=2", 8, {"microbatches": 4}),
    ("pp=2,dp=2,tp=2", 8, {"pp_schedule": "circular", "pp_repeats": 2, "microbatches": 2}),
    ("pp=2,dp=2,tp=2", 8, {"pp_schedule": "1f1b", "microbatches": 4}),
    # 1F1B with fsdp, ZeRO-1 over dp... and two accumulated pipeline passes.
    ("pp=2,fsdp=2,tp=2", 8, {"pp_schedule": "1f1b", "microbatches": 2, "grad_accum": 2, "zero": 1}),
    # Interleaved 1F1B: two chunks per stage (pp=4: one layer each).
    ("pp=4", 4, {"pp_schedule": "interleaved-1f1b", "pp_repeats": 2, "microbatches": 8}),
    ("pp=2,dp=2,tp=2", 8, {"pp_schedule": "interleaved-1f1b", "pp_repeats": 2, "microbatches": 4}),
    # zb-v: 2 x pp chunks in a V (pp=2: two layers each, pp=4: one).
    ("pp=4", 4, {"pp_schedule": "zb-v", "microbatches": 8}),
    ("pp=2,dp=2,tp=2", 8, {"pp_schedule": "zb-v", "microbatches": 4}),
    # ... with fsdp (the second chunk's weights exchanged split over it), ZeRO-1, two passes.
    ("pp=2,fsdp=2,tp=2", 8, {"pp_schedule": "zb-v", "microbatches": 2, "grad_accum": 2, "zero": 1}),
    # ... under a remat policy: each chunk's whole backward in its B tick.
    ("pp=2,tp=2", 4, {"pp_schedule": "zb-v", "microbatches": 4, "remat": "full"}),
    # pp=2 alone: each chunk's scan keeps two layers (test_split_backward_executes_its_formula).
    ("pp=2", 2, {"pp_schedule": "zb-v", "microbatches": 4}),
    # DualPipe: stages d and p-1-d on device d, the microbatches in two directions.
    ("pp=4", 4, {"pp_schedule": "dualpipe", "microbatches": 8}),
    ("pp=2", 2, {"pp_schedule": "dualpipe", "microbatches": 4}),
    # ... with ZeRO-1 over dp and two accumulated passes (the mirrored stage's gradients summed in each).
    ("pp=2,dp=2", 4, {"pp_schedule": "dualpipe", "microbatches": 2, "grad_accum": 2, "zero": 1}),
]
IDS = [f"{m}{''.join(f'-{k}{v}' for k, v in o.items())}" for m, _, o in LAYOUTS]

# As in test_parity: 1e-5 relative on the loss is the spec (measured: at most ~4e-7); the
# parameters as support.parity.assert_params_match says.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def deep_reference():
    return train_run("", 1, **DEEP)


def _run(i):
    mesh, devices, overrides = LAYOUTS[i]
    return train_run(mesh, devices, **DEEP, **overrides)


# The gate trains each schedule once (1F1B also with dp and tp); the other layouts are slow.
# The floor pass repeats GPipe, 1F1B with dp and tp, and zb-v: each schedule's shard_map.
@pytest.mark.parametrize("i", tiered(range(len(LAYOUTS)), IDS, gate=[
    "pp=4-microbatches8", "pp=4-pp_schedulecircular-pp_repeats2-microbatches4", "pp=4-pp_schedule1f1b-microbatches8",
    "pp=4-pp_scheduleinterleaved-1f1b-pp_repeats2-microbatches8", "pp=2,dp=2,tp=2-pp_schedule1f1b-microbatches4",
    "pp=4-pp_schedulezb-v-microbatches8", "pp=2-pp_scheduledualpipe-microbatches4"], floor=[
    "pp=4-microbatches8", "pp=2,dp=2,tp=2-pp_schedule1f1b-microbatches4", "pp=4-pp_schedulezb-v-microbatches8"]))
def test_pipeline_matches_one_device(deep_reference, i):
    run = _run(i)
    np.testing.assert_allclose(run.losses, deep_reference.losses, rtol=LOSS_RTOL, atol=0)
    assert deep_reference.losses[-1] < deep_reference.losses[0] - 0.05
    params = restack(run.params, -1) if run.layout.repeats > 1 else run.params
    assert_params_match(params, deep_reference.params)


def test_evaluation_through_the_stages_gives_one_devices_loss(deep_reference):
    """Held-out loss of a 1F1B run (evaluated as GPipe: forward only) against one device's,
    each on its own final parameters, which agree as the parity test says."""
    from spmd.data.feed import global_batch
    from spmd.data.synthetic import MarkovSource

    losses = []
    for run in (_run(2), deep_reference):  # 1F1B on pp=4, one device
        params = jax.device_put(run.params, jax.tree.map(lambda s: s.sharding, run.program.abstract_state["params"]))
        rows = global_batch(MarkovSource(256, seed=0), 0, 32, 33, run.layout.batch_sharding, "eval")
        losses.append(float(run.program.compile_eval()(params, rows)["loss"]))
    np.testing.assert_allclose(losses[0], losses[1], rtol=LOSS_RTOL)


def _stage_flops(run) -> float:
    """Dot FLOPs one device runs in loops (the stages' layer scans), branches aside."""
    return hlo.loop_dot_flops(hlo.parse(run.hlo))


@pytest.mark.parametrize("i", [0, 1, 2, 7], ids=[IDS[0], IDS[1], IDS[2], IDS[7]])
def test_executed_compute_is_the_bubble_formula(deep_reference, i):
    """p devices execute (v*m + p - 1) / (v*m) times the layer work of one device: the
    bubble ticks compute on padding, and nothing else is repeated."""
    run, schedule = _run(i), _run(i).layout.schedule
    executed = schedule.stages * _stage_flops(run) / _stage_flops(deep_reference)
    v, m, p = schedule.repeats, schedule.microbatches, schedule.stages
    assert executed == pytest.approx((v * m + p - 1) / (v * m), rel=1e-9)


def test_one_f_one_b_keeps_fewer_activations_than_gpipe():
    """pp=4, m=8: GPipe keeps m + p - 1 = 11 ticks of a stage's activations, 1F1B 2p - 1 = 7."""
    gpipe, one_f_one_b = (_run(i).compiled.memory_analysis().temp_size_in_bytes for i in (0, 2))
    # 7/11 = 0.64 of the kept activations; other temporaries (logits, the weights'
    # gradients, the microbatches' copies) are alike in both. Measured 0.73 (12.9 / 17.7
    # MiB). 1F1B keeping the weights in its ring (a copy per slot) would measure 0.88.
    assert one_f_one_b < 0.8 * gpipe, (one_f_one_b, gpipe)


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_interleaved_one_f_one_b_keeps_about_one_f_one_bs_activations():
    """pp=4, m=8, v=2: a ring of 2vp - 1 = 15 chunk residuals, 7.5 stages' worth of
    microbatches, against 1F1B's 7 and GPipe's 11."""
    gpipe, one_f_one_b, interleaved = (_run(i).compiled.memory_analysis().temp_size_in_bytes for i in (0, 2, 7))
    # 7.5/7 of 1F1B's kept activations at most (the rest alike); with the tick's being
    # built apart before they are filed (a chunk's, 1/v, against a stage's) both hold 8.
    # Measured 0.94 of 1F1B's temporaries (10.5 / 11.2 MiB). Keeping every tick's, as
    # circular does, measures 1.09.
    assert interleaved < 1.07 * one_f_one_b, (interleaved, one_f_one_b)
    assert interleaved < 0.8 * gpipe, (interleaved, gpipe)


@pytest.mark.parametrize("layout", ["pp=2-pp_schedulezb-v-microbatches4", "pp=2-pp_scheduledualpipe-microbatches4",
                                    "pp=4-pp_scheduledualpipe-microbatches8"])
@pytest.mark.slow  # the gate holds the formula of GPipe, circular, 1F1B
def test_split_backward_executes_its_formula(deep_reference, layout):
    """zb-v runs 2m + 2p - 2 chunk forwards and input gradients (B) per device and exactly
    2m weight gradients (W), DualPipe m + p - 2 stage forwards and B's and m W's:
    executed/useful = ((2n + s - 2)(f+b) + 2n w) / (2n(f+b+w)) with n = m, s = 2p (zb-v)
    or n = m/2, s = p (DualPipe), f, b, w a chunk's dot FLOPs counted as the step's are
    (its attention kernel's causal branches aside). Here f = b = w (the layers' matmuls,
    each once per pass), so zb-v's is 1 + 2(p-1)/(3m) = 7/6 at p=2, m=4, against 1F1B's
    5/4; DualPipe's 1 + 2(p-2)/(3m): no bubble at all on p=2, 7/6 on p=4, m=8. The pairs
    of ticks run in one loop whose switch says how often each kind of pair runs
    (`counted_switch`): the planner weighs each branch's FLOPs by it."""
    run, program = _run(IDS.index(layout)), deep_reference.program
    schedule = run.layout.schedule
    p, m, dual = schedule.stages, schedule.microbatches, schedule.name == "dualpipe"
    rows = jnp.zeros((PARITY["batch"] // m, PARITY["seq"] + 1), jnp.int32)
    with program._annotated():
        parts = stage_parts(program.graphdef, deep_reference.params, rows, program._annotated, "blocks", None)
        chunk = jax.tree.map(lambda w: w[: DEEP["layers"] // (p if dual else 2 * p)], deep_reference.params["blocks"])
        f, b, w = chunk_dot_flops(parts.stage, chunk, parts.embedded())
    assert f == b == w > 0
    executed = p * _stage_flops(run) / _stage_flops(deep_reference)
    assert executed == pytest.approx(executed_over_useful(p, m, f, b, w, dual), rel=1e-9)
    assert executed == pytest.approx(1 + 2 * (p - 2 if dual else p - 1) / (3 * m), rel=1e-9)
    assert executed == pytest.approx(schedule.compute_overhead, rel=1e-9)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 64)])
def test_zb_v_timetable(p, m):
    """Every device runs one forward and one B per tick where any runs, each of its 2m
    W's after its B, and the rings are bounded whatever m is; the roofline's overhead is
    the executed-compute formula at f = b = w."""
    from spmd.parallel.pipeline import Schedule
    from spmd.parallel.pipeline.zero_bubble import timetable

    table = timetable(p, m)  # (it asserts forward <= B <= W for every chunk and microbatch)
    assert table["slots"] == (4 * p - 1, 5 * p - 2, 2 * p - 1)
    assert table["f_end"] == 2 * m + 2 * p - 2 and table["ticks"] - table["first_b"] == 2 * m + 2 * p - 2
    assert Schedule("zb-v", p, m, 2).compute_overhead == pytest.approx(executed_over_useful(p, m))
    # Under a remat policy: no W's, B's ring only, 1F1B's overhead (p-1)/m.
    whole = timetable(p, m, defers_weights=False)
    assert whole["slots"] == (4 * p - 1, 0, 0) and whole["w_start"] == whole["ticks"] == table["ticks"]
    remat = Schedule("zb-v", p, m, 2, "full")
    assert remat.compute_overhead == pytest.approx(1 + (p - 1) / m)
    assert remat.kept_microbatches == (4 * p - 1) / 2


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 64), (16, 32)])
def test_dualpipe_timetable(p, m):
    """DualPipe's plan of a step: m + p - 2 ticks of stage forwards and as many of B's
    (every device runs one of each per tick where any runs), m W's each after its B, and
    rings bounded whatever m is: B reads what 2p - 1 stage forwards kept, W the matmuls'
    inputs of (5p - 4)/2. DeepSeek's published DualPipe (V3 report, table 2) idles
    (p/2 - 1)(F&B + B - 3W) and keeps p + 1 microbatches' activations: its devices run
    their own timelines, so W's fill each one's gaps; here every device runs the same
    ticks (one program), so the idle work is (p - 2)(F + B) and the rings hold a tick's
    residuals each (benchmarks/pipeline.py prints both)."""
    from spmd.parallel.pipeline import Schedule
    from spmd.parallel.pipeline.zero_bubble import timetable

    table = timetable(p, m, dual=True)  # (it asserts forward <= B <= W for every chunk and microbatch)
    assert table["slots"] == (2 * p - 1, (5 * p - 4) // 2, p - 1)
    assert table["f_end"] == m + p - 2 and table["ticks"] - table["first_b"] == m + p - 2
    assert table["ticks"] - table["w_start"] == m and len(table["w_order"][0]) == m
    schedule = Schedule("dualpipe", p, m)
    assert schedule.compute_overhead == pytest.approx(executed_over_useful(p, m, dual=True))
    assert schedule.compute_overhead == pytest.approx(1 + 2 * (p - 2) / (3 * m))
    assert schedule.kept_microbatches == table["slots"][1]
    # The same timetable as zb-v on p/2 stages of m/2 microbatches: a V's two arms are one
    # microbatch's path there, two directions' paths here.
    if p % 4 == 0:
        half = timetable(p // 2, m // 2)
        assert table["ticks"] == half["ticks"] and table["slots"] == half["slots"]
    remat = Schedule("dualpipe", p, m, remat="full")
    assert remat.compute_overhead == pytest.approx(1 + (p - 2) / m) and remat.kept_microbatches == 2 * p - 1


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_zb_v_activations_do_not_grow_with_microbatches():
    """zb-v's rings hold a bounded number of chunk residuals (4p - 1 for B, 5p - 2 of the
    matmuls' inputs for W, 2p - 1 cotangents from B to W), whatever m is: doubling m at
    the same microbatch size adds only the step's rows (embedded microbatches and their
    gradients). Measured: zb-v 45.0 -> 45.7 MiB (x1.02, as 1F1B's 22.4 -> 22.9), GPipe
    30.1 -> 47.7 (x1.59), which keeps every microbatch's activations. Under remat full
    B's ring holds each layer's input only and there is no W ring: 10.8 MiB at m = 8."""
    def temps(schedule, m, remat="none"):
        cfg = validate(TrainConfig.of(**{**PARITY, **DEEP, "mesh": "pp=2", "pp_schedule": schedule,
                                      "microbatches": m, "batch": 8 * m, "remat": remat}))
        compiled = build_program(cfg.step, make_layout(cfg, jax.devices()[:2])).compile_step()
        return compiled.memory_analysis().temp_size_in_bytes
    zb_v = temps("zb-v", 8)
    zb_growth, gpipe_growth = zb_v / temps("zb-v", 4), temps("gpipe", 8) / temps("gpipe", 4)
    assert zb_growth < 1.1 and gpipe_growth > 1.4, (zb_growth, gpipe_growth)
    assert temps("zb-v", 8, "full") < 0.5 * zb_v


@pytest.mark.parametrize("i", [1, 15], ids=[IDS[i] for i in (1, 15)])
def test_a_pipelines_checkpoint_restores_onto_a_layout_without_pipeline(tmp_path, i):
    """A circular pipeline stores its stacked layers as (repeats, layers / repeats), and
    DualPipe as two chunks per device; either's checkpoint restores onto another layout as
    the model's layers, in order."""
    run = _run(i)
    abstract = run.program.abstract_state
    params = jax.device_put(run.params, jax.tree.map(lambda s: s.sharding, abstract["params"]))
    opt_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), abstract["opt_state"])
    checkpoints = Checkpoints(tmp_path, async_save=False)
    checkpoints.save(4, {"params": params, "opt_state": opt_state},
                     make_meta(run.cfg.record(), run.cfg.model.name, 4, params))
    checkpoints.wait()
    flat_cfg = run.cfg.replace(mesh="dp=2", pp_schedule="gpipe", pp_repeats=1, microbatches=None)
    flat = build_program(flat_cfg.step, make_layout(flat_cfg, jax.devices()[:2])).abstract_state
    restored = jax.device_get(checkpoints.restore(4, flat)["params"])
    checkpoints.close()
    want = restack(run.params, -1) if run.layout.repeats > 1 else run.params
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("i", [1, 2, 3, 8, 10, 12, 14, 16], ids=[IDS[i] for i in (1, 2, 3, 8, 10, 12, 14, 16)])
@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_plan_matches_the_compiled_pipeline(i):
    """spmd.plan's theory of pipeline stages (the pp permutes, the rows entering and
    leaving, the bubble ticks' tp traffic, dp reduced once) against the compiled step."""
    run = _run(i)
    plan = make_plan(run.cfg.step, run.layout, compiled=run.compiled)
    expected = [r for r in plan.rows if r.theory]
    assert any(r.op == "collective-permute" and r.axes == "pp" for r in expected)
    for row in expected:  # within 5% per collective and mesh axis, as for the other layouts
        assert row.measured == pytest.approx(row.theory, rel=0.05), row
    assert not any(r.unexpected for r in plan.rows)
    assert 0 <= plan.measured_state - plan.theory_state <= 16


@pytest.mark.parametrize("overrides,devices,message", [
    ({"mesh": "pp=4", "pp_schedule": "circular", "pp_repeats": 2}, 4, "2 layers do not divide into pp x repeats = 4 x 2"),
    ({"mesh": "pp=2,dp=4", "microbatches": 4, "batch": 24}, 8, "--batch 24 does not divide into 4 microbatches x 4"),
    ({"mesh": "pp=2", "pp_schedule": "circular"}, 2, "needs --pp-repeats 2 or more"),
    ({"mesh": "", "microbatches": 4}, 1, "need a pp axis"),
    ({"mesh": "pp=2", "model": "moe-tiny"}, 2, "layers=1 does not divide by pp=2"),
    ({"mesh": "pp=2", "pp_schedule": "interleaved-1f1b"}, 2, "needs --pp-repeats 2 or more.*it is --pp-schedule 1f1b"),
    ({"mesh": "pp=2", "pp_schedule": "interleaved-1f1b", "pp_repeats": 2}, 2,
     "2 layers do not divide into pp x repeats = 2 x 2"),
    ({"mesh": "pp=2", "pp_schedule": "interleaved-1f1b", "pp_repeats": 2, "layers": 4, "microbatches": 3}, 2,
     "--microbatches 3 must be a multiple of pp=2"),
    ({"mesh": "pp=2", "pp_schedule": "1f1b", "pp_repeats": 2}, 2, "--pp-repeats applies to --pp-schedule circular and"),
    ({"mesh": "pp=2", "pp_schedule": "zb-v", "layers": 6}, 2, "zb-v: model tiny's 6 layers do not divide into 2 x pp = 4"),
    ({"mesh": "pp=4", "pp_schedule": "zb-v", "layers": 8, "microbatches": 2}, 4, "--microbatches 2 must be a multiple of pp=4"),
    ({"mesh": "pp=2", "pp_schedule": "zb-v", "pp_repeats": 2}, 2, "--pp-repeats applies to"),
    ({"mesh": "pp=3", "pp_schedule": "dualpipe", "layers": 6, "microbatches": 6, "batch": 12}, 3,
     "--pp-schedule dualpipe needs an even pp \\(pp=3\\)"),
])
def test_bad_pipeline_layouts_are_refused_before_compiling(overrides, devices, message):
    """(The CLI turns these into one `error:` line and exit 2: test_cli_errors.)"""
    with pytest.raises(UserError, match=message):
        cfg = validate(TrainConfig.of(**{**PARITY, **overrides}))
        make_layout(cfg, jax.devices()[:devices])


def held_from_xla_0_12(differs: str):
    """What the test holds of the compiled step's buffers is XLA 0.12's (CI's newest JAX);
    the floor, jaxlib 0.10.2, compiles the step otherwise. `differs`: how, measured there."""
    return pytest.mark.skipif(jaxlib.version.__version_info__ < (0, 12),
                              reason=f"XLA 0.12's buffer order (jaxlib {jaxlib.version.__version__} here): on "
                                     f"jaxlib 0.10.2 {differs}")


# XLA:CPU 0.10 removes the step's optimization barriers before it schedules the step (its
# cse_barrier_expander runs ahead of layout assignment; 0.12's after scheduling), so the
# order spmd's barriers ask for (`zero_bubble._read`, `models.lookup`) is not kept there.
BARRIERS_GONE = "XLA:CPU removes the optimization barriers before scheduling"


def _ring_copies(text: str, slots) -> collections.Counter:
    """The copies in a compiled step of arrays shaped as a ring's buffers (a leading
    dimension of a ring's size, then an entry of rank 3 or more), by shape."""
    copies = re.finditer(r"= \w+\[(\d+)((?:,\d+){3,})\]\{[^}]*\} copy\(", text)
    return collections.Counter(m.group(1) + m.group(2) for m in copies if int(m.group(1)) in slots)


@held_from_xla_0_12("XLA:CPU copies the two stages' weights stacked and the ring of what the forwards keep "
                    "(11 copies): 2.4 stages over the theory's peak, not 0.2")
@pytest.mark.floor  # skipped on the floor: the pass lists the reason (-rs)
def test_dualpipe_copies_no_stage_to_pick_one():
    """A DualPipe device runs its own stage and the one its mirror sends on alternate
    ticks, which of the two by the device's parity: each pass picks its stage where it
    is, and no stage is copied to be picked. Where the weights are most of the step (16
    layers, 4 x 16 tokens, remat full), XLA:CPU then holds 0.4 of a stage more than the
    theory; with the two stacked and indexed by the stage, 2.3 stages more (XLA:GPU 8 GiB
    more on llama3-8b at 16 layers, pp=4,dp=2: docs/deepseek.md). And the ring of what
    the forwards keep is written in place (`test_split_backward_rings_are_written_in_place`)."""
    cfg = validate(TrainConfig.of(mesh="pp=2", model="tiny", layers=16, batch=4, seq=16, microbatches=4,
                               remat="full", pp_schedule="dualpipe"))
    layout = make_layout(cfg, jax.devices()[:2])
    compiled = build_program(cfg.step, layout).compile_step()
    plan = make_plan(cfg.step, layout, compiled=compiled)
    stage = plan.theory_memory["gathered_weights"]  # the mirror's stage: DualPipe's stages are alike
    assert plan.xla["peak"] - plan.theory_peak < stage, (plan.xla["peak"] - plan.theory_peak) / stage
    copies = _ring_copies(compiled.as_text(), timetable(2, 4, defers_weights=False, dual=True)["slots"])
    assert max(copies.values(), default=0) <= 1, copies


@held_from_xla_0_12(f"{BARRIERS_GONE}: zb-v's rings are copied to be written (up to 23 times a step)")
@pytest.mark.floor  # skipped on the floor: the pass lists the reason (-rs)
def test_split_backward_rings_are_written_in_place():
    """zb-v's ticks run two to a loop trip, and a tick's B (and W) reads a ring that the
    next tick's forward (or B) writes: the read is put before the write
    (`zero_bubble._read`), else XLA copies the whole ring to write it. Each ring is
    copied at most once here (into the loop); unordered, the rings of the layers' inputs
    were copied 17 times a step (two rings of 13.6 GiB alive at once on DeepSeek-V3's
    2,048-GPU layout, 128 -> 113 GiB; 91 -> 81 GiB on XLA:GPU for Llama 3 70B's 3-D
    preset under DualPipe). (A write is behind a barrier too, `zero_bubble._write`, for
    what XLA:GPU's fusion does and XLA:CPU's does not: docs/deepseek.md.)"""
    cfg = validate(TrainConfig.of(mesh="pp=2", model="tiny", layers=16, batch=4, seq=16, microbatches=4,
                               remat="none", pp_schedule="zb-v"))
    text = build_program(cfg.step, make_layout(cfg, jax.devices()[:2])).compile_step().as_text()
    slots = timetable(2, 4)["slots"]
    assert re.search(rf"\[{slots[0]},4,1,16,64\]", text)  # the ring of the layers' inputs (4 a chunk)
    copies = _ring_copies(text, slots)
    assert max(copies.values(), default=0) <= 1, copies


WIDE_VOCAB = 4096  # the head and the table 4,096 x 64, apart from every other weight's shape


def _head_shaped(instr: hlo.Instruction) -> bool:
    return sorted(hlo.dims_of(instr.result_type)) == sorted([PRESETS["tiny"].embed, WIDE_VOCAB])


@functools.lru_cache(maxsize=None)
def _wide_vocabulary_step(schedule: str) -> hlo.HloModule:
    """The compiled step of tiny with a `WIDE_VOCAB` vocabulary, pp=2 under `schedule`."""
    cfg = validate(TrainConfig.of(mesh="pp=2", architecture=dataclasses.replace(PRESETS["tiny"], vocab=WIDE_VOCAB),
                               batch=4, seq=16, microbatches=4, remat="full", pp_schedule=schedule))
    return hlo.parse(build_program(cfg.step, make_layout(cfg, jax.devices()[:2])).compile_step().as_text())


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipe"])
def test_the_heads_conditional_writes_no_head_sized_zeros(schedule):
    """The head runs in a conditional on the devices holding the last chunk and adds its
    gradients to the sums it is passed (`kit.head_vjp`); the others pass the sums through.
    Returning the gradients alone, the other branch wrote head-sized zeros in every tick
    and both sets of buffers lived beside the sums (DeepSeek-V3's 2,048-GPU layout on
    XLA:CPU, float32: 107.1 -> 100.5 GiB). No branch inside the step's loops materializes a
    head-sized broadcast (XLA:CPU's: a fusion that only broadcasts)."""
    module = _wide_vocabulary_step(schedule)
    zeros = [(i.computation, i.result_type) for comp in module.in_loops() & hlo.branch_computations(module)
             for i in module.instructions[comp].values()
             if i.op == "broadcast" and module.roots[comp] == i.name and _head_shaped(i)]
    assert not zeros, zeros


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipe"])
@held_from_xla_0_12(f"{BARRIERS_GONE}: the table's gradient zeros are made before the stages' loop")
@pytest.mark.floor  # skipped on the floor: the pass lists the reason (-rs)
def test_the_tables_gradient_zeros_are_made_after_the_stages(schedule):
    """The table's gradient is its rows' gradients scattered into zeros once the stages
    are done. Written by autodiff, the zeros are a constant, which XLA:CPU's scheduler
    computes at the step's start and holds through the loops: the table's size beside the
    pipeline's whole heap (3.45 GiB in float32 on DeepSeek-V3's 2,048-GPU layout, 100.5 ->
    97.0 GiB). `models.lookup` makes them after the rows' gradient exists: in the step's
    order (a compiled module lists its instructions as scheduled), what the scatter writes
    into comes after its last loop."""
    module = _wide_vocabulary_step(schedule)
    order = list(module.instructions[module.entry].values())
    at = {i.name: n for n, i in enumerate(order)}
    last_loop = max(n for n, i in enumerate(order) if i.op == "while")
    scatters = [i for i in order if _head_shaped(i) and hlo.root_of(module, module.entry, i)[1].op == "scatter"]
    assert scatters
    early = [(i.name, i.operands[0]) for i in scatters if at.get(i.operands[0], -1) < last_loop]
    assert not early, (early, order[last_loop].name)

