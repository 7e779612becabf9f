"""Multi-token prediction (DeepSeek-V3's, `--mtp-depth`): the loss against a reference
written from the report's equations (section 2.2), on plain and packed rows; the same
numbers on the layouts that move it (the head's stage under DualPipe and 1F1B, sp's column
order, accumulation); the weight's switch; and left out of what is exported."""

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.parity import assert_params_match, train_run
from flax import nnx, traverse_util

from models import PRESETS, Routing, hf_layout
from spmd.base.errors import UserError
from spmd.formats.hf import Directory, write_hf
from spmd.formats.safetensors import SafeTensors, Writer
from spmd.hf import from_pretrained
from spmd.layout import make_layout
from spmd.parallel.objective import AuxLosses, aux_losses, model_loss
from spmd.parallel.skeleton import build_model, model_skeleton
from spmd.parallel.step import build_program, initial_params
from spmd.run.config import TrainConfig
from spmd.run.resolve import validate
from spmd.run.trainer import fresh_state

CFG = dataclasses.replace(PRESETS["deepseek-v3-tiny"], mtp_depth=2, layers=3)  # 2 dense layers, 1 MoE
GOLDEN = Path(__file__).with_name("hf") / "deepseek-v3"  # 4 layers: its prediction layer would be layer 4
WEIGHT = 0.3


def _rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _cross_entropy(logits, targets):
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _reference(model, examples: np.ndarray, counted: np.ndarray):
    """Examples' (each its own sequence t_1..t_{T+1}, all of one length) summed losses and
    counts: the next token's, and per depth k the report's: h'_i = M_k [RMSNorm(Emb(t_{i+k}));
    RMSNorm(h_i^{k-1})] (the halves in DeepSeek's released order), h^k_{1:T-k} =
    TRM_k(h'_{1:T-k}), each predicting t_{i+k+1} through the shared head.
    `counted[:, j]`: whether token j is a target."""
    cfg, embedding, head = model.cfg, model.embedding[...], model.head[...]
    examples, counted = jnp.asarray(examples), jnp.asarray(counted, jnp.float32)
    n = examples.shape[1] - 1
    h, _ = model.hidden(examples[:, :-1])
    logits = _rms(h, model.final_norm.scale[...], cfg.norm_eps) @ head
    sums, counts = [jnp.sum(_cross_entropy(logits, examples[:, 1:]) * counted[:, 1:])], [jnp.sum(counted[:, 1:])]
    for k, module in enumerate(model.mtp, start=1):
        rows = n - k
        joined = (_rms(embedding[examples[:, k:k + rows]], module.embedding_norm.scale[...], cfg.norm_eps)
                  @ module.join_embedded[...]
                  + _rms(h[:, :rows], module.hidden_norm.scale[...], cfg.norm_eps) @ module.join_hidden[...])
        h, _ = module.block(joined, np.arange(rows))
        logits = _rms(h, module.norm.scale[...], cfg.norm_eps) @ head
        mask = counted[:, k + 1:k + 1 + rows]
        sums.append(jnp.sum(_cross_entropy(logits, examples[:, k + 1:k + 1 + rows]) * mask))
        counts.append(jnp.sum(mask))
    return jnp.stack(sums), jnp.stack(counts)


def _loss_from_sums(sums, counts):
    means = sums / counts
    mtp = jnp.mean(means[1:])
    return means[0] + WEIGHT * mtp, mtp


@pytest.mark.parametrize("packed", [pytest.param(False, marks=pytest.mark.slow), True],  # the gate keeps packed rows
                         ids=["rows", "packed"])
def test_the_loss_and_its_gradients_are_the_reports_equations(packed):
    """Rolled columns whose wrapped ends are masked (as the model computes them, so that
    the sequence keeps its length and its split) give the loss and gradients of the
    report's truncated sequences; packed examples are each their own sequence."""
    model = build_model(CFG, "float32", "none", Routing(), None, nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab, (2, 17), dtype=np.int32)
    if packed:  # two examples of 8 tokens a row (the reference runs them as one batch), then padding
        segments = np.array([[1] * 8 + [2] * 8 + [0]] * 2, np.int32)
        mask = rng.random((2, 17)) > 0.2
        rows = {"tokens": tokens, "segments": segments, "loss_mask": mask}
        examples = (tokens[:, :16].reshape(4, 8), mask[:, :16].reshape(4, 8))
    else:
        rows, examples = tokens, (tokens, np.ones(tokens.shape, bool))

    def ours(params):
        loss, metrics = model_loss(graphdef, params, rows, None, AuxLosses(mtp_weight=WEIGHT))
        return loss, metrics["mtp_loss"]

    def reference(params):
        return _loss_from_sums(*_reference(nnx.merge(graphdef, params), *examples))

    # Gradients on packed rows (the costlier compile), where every mask is at work.
    differentiated = (lambda f: jax.value_and_grad(f, has_aux=True)) if packed else (lambda f: lambda p: (f(p), None))
    (loss, mtp), grads = jax.jit(differentiated(ours))(params)
    (want_loss, want_mtp), want_grads = jax.jit(differentiated(reference))(params)
    # float32 sums of a few hundred terms in another order (measured: within 3e-7 relative).
    np.testing.assert_allclose([loss, mtp], [want_loss, want_mtp], rtol=2e-6)
    assert float(mtp) > 1.0  # an untrained model's loss, far from 0
    if not packed:
        return
    flat, want = (jax.tree.leaves(nnx.to_pure_dict(g)) for g in (grads, want_grads))
    scale = max(float(jnp.max(jnp.abs(g))) for g in want)
    for got, expected in zip(flat, want):  # within float32 rounding of the largest gradient
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * scale)
    mtp_grads = nnx.to_pure_dict(grads)["mtp"]
    assert all(float(jnp.max(jnp.abs(mtp_grads[1][name]))) > 0 for name in ("join_embedded", "join_hidden"))


def test_the_weight_switches_at_its_step():
    cfg = TrainConfig.of(model="deepseek-v3-tiny", mtp_depth=1, mtp_weight_later="5:0.1")
    weights = [float(aux_losses(cfg.step, jnp.int32(step)).mtp_weight) for step in (0, 4, 5, 9)]
    np.testing.assert_allclose(weights, [0.3, 0.3, 0.1, 0.1], rtol=1e-7)
    assert aux_losses(cfg.step).mtp_weight is None  # evaluation: the model's loss alone


MTP = dict(model="deepseek-v3-tiny", mtp_depth=1)


@pytest.mark.parametrize("mesh,devices,overrides", [
    # The head and the prediction module on both ends of DualPipe's stages, experts over ep.
    ("pp=2,ep=2", 4, dict(pp_schedule="dualpipe", microbatches=4)),
    # 1F1B's head on the last stage, ZeRO-1 over dp.
    ("pp=2,dp=2", 4, dict(pp_schedule="1f1b", microbatches=2, zero=1)),
    # sp's column order (the later columns are laid out before it), accumulation's shards.
    ("sp=2,tp=2", 4, dict(grad_accum=2)),
    # Expert copies in the model's layers, moved every 2 steps; the module's experts have none.
    ("pp=2,ep=2", 4, dict(pp_schedule="dualpipe", microbatches=4, redundant_experts=2, rebalance_every=2)),
], ids=["pp=2,ep=2-dualpipe", "pp=2,dp=2-1f1b", "sp=2,tp=2-accum", "pp=2,ep=2-dualpipe-copies"])
@pytest.mark.xdist_group("mtp")  # one worker: they share the reference run (support.parity)
@pytest.mark.slow  # the gate holds the reference's equations on packed rows
def test_layout_matches_one_device(mesh, devices, overrides):
    reference = train_run("", 1, **MTP)
    run = train_run(mesh, devices, **MTP, **overrides)
    for name in ("loss", "mtp_loss"):
        np.testing.assert_allclose(run.metrics[name], reference.metrics[name], rtol=1e-5)  # test_parity's
    assert reference.metrics["mtp_loss"][-1] < reference.metrics["mtp_loss"][0] - 0.05  # it trains
    copies = "redundant_experts" in overrides  # (the layers' experts as slots: test_balance compares those)
    assert_params_match(*({"mtp": r.params["mtp"]} if copies else r.params for r in (run, reference)))
    assert "mtp" in run.params


def test_the_prediction_modules_stay_out_of_the_export(tmp_path):
    """transformers' DeepseekV3 has no prediction modules: the export writes the model's
    tensors alone, and config.json says the model without them."""
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), model_skeleton(CFG).shapes)
    assert "mtp" in params
    written = write_hf(tmp_path, params, CFG, "float32", 10**9, {})
    without = dataclasses.replace(CFG, mtp_depth=0)
    assert Directory(tmp_path).cfg == without
    names = SafeTensors(tmp_path / written[0]).names()
    assert sorted(names) == sorted(n for t in hf_layout(without).tensors(without) for i in range(t.stacked or 1)
                                   for n in t.names(i))


@pytest.mark.parametrize("mesh,overrides", [  # the gate keeps DualPipe's; the other layouts are slow
    ("pp=2,ep=2", dict(mtp_depth=2, pp_schedule="dualpipe", microbatches=4)),
    # GPipe: the modules after the stages, the dense prefix before them, over sp
    pytest.param("pp=2,sp=2", dict(mtp_depth=1), marks=pytest.mark.slow),
    pytest.param("fsdp=2,tp=2", dict(mtp_depth=2), marks=pytest.mark.slow),
    pytest.param("sp=2,ep=2", dict(mtp_depth=1, moe_dispatch="capacity"), marks=pytest.mark.slow),
    pytest.param("pp=2,dp=2", dict(mtp_depth=1, pp_schedule="1f1b", microbatches=4, zero=1), marks=pytest.mark.slow),
    # The layers' experts with copies, the module's without: capacity buffers of each size.
    pytest.param("pp=2,ep=2", dict(mtp_depth=1, pp_schedule="dualpipe", microbatches=4, redundant_experts=2,
                                   moe_dispatch="capacity"), marks=pytest.mark.slow),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{x}" for k, x in v.items()))
def test_the_plan_counts_the_prediction_modules(mesh, overrides):
    """Every collective row of a layout with multi-token prediction within 0.95-1.05 of
    the theory (benchmarks/plan_ratios.py's goal), which counts the modules' blocks as
    layers where the head runs, their weights gathered and reduced, the head and the
    table used once more per depth and, in stages that hold the head, the later columns
    entering and the lookups gathered over ep. Uncounted, the rows were off by up to a
    half (tiny DeepSeek, pp=2,ep=2 DualPipe: all-to-all over ep 1.50). Scalar rows (under
    1 KiB a collective: the loss, MoE statistics) are left out, as spmd.plan flags none."""
    from spmd.config import validate
    from spmd.layout import make_layout
    from spmd.planner.counting import SMALL_BYTES
    from spmd.planner.plan import make_plan

    cfg = validate(TrainConfig.of(mesh=mesh, model="deepseek-v3-tiny", batch=8, seq=32, **overrides))
    plan = make_plan(cfg.step, make_layout(cfg, jax.devices()[:4]))
    rows = {f"{r.op} {r.axes}": r.measured / r.theory if r.theory else float("inf")
            for r in plan.rows if r.measured >= SMALL_BYTES * r.count or r.theory >= SMALL_BYTES * max(r.count, 1)}
    assert len(rows) >= 3, rows
    assert {row: ratio for row, ratio in rows.items() if not 0.95 <= ratio <= 1.05} == {}


def _with_prediction_layer(root: Path, edit=lambda tensors: None) -> Path:
    """The DeepSeek golden with a prediction layer as DeepSeek's checkpoint holds one (its
    layer 61, here layer 4): the decoder layer a copy of the model's last (layer 3), the
    norms and the join drawn, the embedding and the head copied; `edit` changes the tensors."""
    directory = root / "deepseek-v3-mtp"
    shutil.copytree(GOLDEN, directory)
    files = SafeTensors(directory / "model.safetensors")
    tensors = {name: files.read(name) for name in files.names()}
    e, rng = 32, np.random.default_rng(0)
    tensors |= {name.replace(".3.", ".4.", 1): w for name, w in tensors.items() if name.startswith("model.layers.3.")}
    tensors |= {f"model.layers.4.{name}": (1 + 0.5 * rng.standard_normal(e)).astype(np.float32)
                for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    tensors |= {"model.layers.4.eh_proj.weight": (rng.standard_normal((e, 2 * e)) * (2 * e) ** -0.5).astype(np.float32),
                "model.layers.4.embed_tokens.weight": tensors["model.embed_tokens.weight"],
                "model.layers.4.shared_head.head.weight": tensors["lm_head.weight"]}
    edit(tensors)
    writer = Writer(directory / "model.safetensors", [(name, w.shape) for name, w in tensors.items()], np.float32)
    for name, w in tensors.items():
        writer.write(name, w)
    writer.close()
    return directory


def test_deepseeks_prediction_layer_is_read_into_the_first_module(tmp_path):
    """`--init-from` DeepSeek's checkpoint with `--mtp-depth 2`: depth 1 is its prediction
    layer. Its logits are the report's equations on the published tensors (eh_proj
    reading [enorm(embedding); hnorm(hidden)], shared_head.norm before the head), its
    decoder layer read as the model's layers are; depth 2, which the files lack, is what
    a fresh run draws. Without `--mtp-depth` the layer is dropped, as transformers drops it."""
    directory = _with_prediction_layer(tmp_path)
    cfg = validate(TrainConfig.of(init_from=str(directory), mtp_depth=2, mesh="", batch=2, seq=16, steps=1))
    layout, said = make_layout(cfg, jax.devices()[:1]), []
    state = fresh_state(cfg, build_program(cfg.step, layout), log=said.append)  # (what spmd.train starts from)
    assert f"multi-token prediction: 1 of the 2 modules read from {directory}'s prediction layers (layer 4 on), " \
           "the rest fresh" in said
    params = jax.device_get(state["params"])
    stack = traverse_util.flatten_dict(params["blocks"])  # the MoE layers 2 and 3
    for path, w in traverse_util.flatten_dict(params["mtp"][0]["block"]).items():
        np.testing.assert_array_equal(w, stack[path][1], err_msg=str(path))
    fresh = jax.device_get(initial_params(cfg.step, layout)(jax.random.key(cfg.training.seed))["mtp"][1])
    jax.tree.map(np.testing.assert_array_equal, params["mtp"][1], fresh)

    published = {name: f.read(name) for f in [SafeTensors(directory / "model.safetensors")] for name in f.names()}
    layer = lambda name: published[f"model.layers.4.{name}"]  # noqa: E731
    tokens = np.load(GOLDEN / "tokens.npy")
    rows = tokens.shape[1] - 2

    @nnx.jit
    def depth_one(model):  # (ours, the equations') logits
        eps, positions, later = model.cfg.norm_eps, np.arange(rows), tokens[:, 1:1 + rows]
        hidden, _ = model.hidden(tokens[:, :rows])
        got = model.predictions(hidden, np.stack([later, tokens[:, 2:2 + rows]], -1), positions)[0]
        joined = jnp.concatenate([_rms(published["model.embed_tokens.weight"][later], layer("enorm.weight"), eps),
                                  _rms(hidden, layer("hnorm.weight"), eps)], -1) @ layer("eh_proj.weight").T
        out, _ = model.mtp[0].block(joined, positions)
        return got, _rms(out, layer("shared_head.norm.weight"), eps) @ published["lm_head.weight"].T

    got, want = depth_one(nnx.merge(layout.skeleton.graphdef, params))
    # float32: the join's 64-term sums taken as two halves of 32 here
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))

    dropped, golden = (np.asarray(from_pretrained(d)(tokens)) for d in (directory, GOLDEN))
    np.testing.assert_array_equal(dropped, golden)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"model.layers.4.embed_tokens.weight": t["model.embed_tokens.weight"] + 1}),
     "tensor model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight, which DeepSeek's "
     "multi-token prediction module shares"),
    (lambda t: t.pop("model.layers.4.hnorm.weight"), "tensor model.layers.4.hnorm.weight is not in model.safetensors"),
    (lambda t: t.update({"model.layers.5.enorm.weight": t["model.layers.4.enorm.weight"]}),
     "model.safetensors holds tensor model.layers.5.enorm.weight, which the model of config.json has no place for"),
], ids=["a copy that differs", "a layer in part", "a layer without its join"])
def test_a_prediction_layer_is_whole_or_refused(tmp_path, edit, message):
    with pytest.raises(UserError, match="^--init-from .*: " + message.replace(".", r"\.")):
        Directory(_with_prediction_layer(tmp_path, edit))


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_a_run_with_expert_copies_and_prediction_exports_the_model(tmp_path):
    """DeepSeek-V3 trained with expert copies and a prediction module, its selection bias
    kept in the router state (no --router-bias-rate): the export is the model of one
    expert each, with the bias as a weight and no module (it crashed: the served model's
    bias was left in the router state)."""
    run, out = tmp_path / "run", tmp_path / "hf"
    for argv in (["spmd.train", "--model", "deepseek-v3-tiny", "--mesh", "ep=2", "--cpu-devices", "2",
                  "--redundant-experts", "2", "--mtp-depth", "1", "--steps", "2", "--batch", "8", "--seq", "32",
                  "--out", str(run)],
                 ["spmd.export", "--checkpoint", str(run), "--format", "hf", "--out", str(out)]):
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    cfg = Directory(out).cfg
    assert cfg.mtp_depth == 0 and cfg.moe.experts == PRESETS["deepseek-v3-tiny"].moe.experts
    names = SafeTensors(out / "model.safetensors").names()
    assert sorted(names) == sorted(n for t in hf_layout(cfg).tensors(cfg) for i in range(t.stacked or 1)
                                   for n in t.names(i))
