"""DeepSeek-V3 (models.deepseek3) trains to the numbers of one device on the layouts that
split what is its own: pipeline stages with the dense prefix outside them, latent attention
over sp and tp, and group-limited routing with its selection bias over ep; the presets
have the published sizes. (Its logits, generation and round trip against transformers are
in test_hf.py and test_generate.py, with the other families' goldens.)"""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.parity import assert_params_match, train_run
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from models import PRESETS
from models.deepseek3.model import DeepSeekV3
from spmd.formats.hf import Directory
from spmd.formats.safetensors import SafeTensors
from spmd.run.pretrained import from_pretrained

GOLDENS = Path(__file__).with_name("hf")

MODEL = dict(model="deepseek-v3-tiny")
LOSS_RTOL = 1e-5  # as test_parity's: float32 sums in another order
BIASED = MODEL | dict(router_bias_rate=0.01)  # the selection bias moves against the measured load every step


SHARED = pytest.mark.xdist_group("deepseek")  # one worker: they share the reference run (support.parity)


@pytest.mark.parametrize("mesh,devices,overrides", [
    # 4 MoE layers in 2 stages; the 2 dense ones with the embedding.
    pytest.param("pp=2,ep=2", 4, MODEL | dict(microbatches=4), marks=SHARED, id="pp=2,ep=2-gpipe"),
    # The prefix's gradient through the embedding's (the schedule computes the stages' own).
    pytest.param("pp=2,ep=2", 4, MODEL | dict(microbatches=4, pp_schedule="1f1b"), marks=SHARED, id="pp=2,ep=2-1f1b"),
    # Ring attention on the decompressed keys and values.
    pytest.param("sp=2,tp=2", 4, MODEL, marks=SHARED, id="sp=2,tp=2"),
    # 16 experts in 4 groups, 2 kept, over 4 devices.
    pytest.param("ep=4", 4, BIASED, id="ep=4-biased"),
])
@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_layout_matches_one_device(mesh, devices, overrides):
    reference = train_run("", 1, **overrides | dict(microbatches=None, pp_schedule="gpipe"))
    run = train_run(mesh, devices, **overrides)
    np.testing.assert_allclose(run.losses, reference.losses, rtol=LOSS_RTOL, atol=0)
    assert reference.losses[-1] < reference.losses[0] - 0.05  # it trains, so matching it says something
    assert_params_match(run.params, reference.params)
    if overrides is BIASED:  # the bias moved, the same on both
        np.testing.assert_allclose(run.router["blocks"]["mlp"]["bias"], reference.router["blocks"]["mlp"]["bias"],
                                   rtol=0, atol=1e-6)
        assert np.abs(reference.router["blocks"]["mlp"]["bias"]).max() > 0


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_empty_layers_even_out_the_stages_without_changing_the_numbers():
    """3 MoE layers as zb-v's 2 x pp = 4 chunks: one empty layer after them, which passes
    its input on, adds nothing to the balance loss or the metrics, and stays zeros; the
    layers train as one device's without it, from the same initial values."""
    reference = train_run("", 1, **BIASED, layers=5)
    run = train_run("pp=2,ep=2", 4, **BIASED, layers=5, empty_layers=1, microbatches=4, pp_schedule="zb-v")
    np.testing.assert_allclose(run.losses, reference.losses, rtol=LOSS_RTOL, atol=0)
    for name in ("aux_loss", "imbalance"):  # means over the 3 MoE layers, not 4
        np.testing.assert_allclose(run.metrics[name], reference.metrics[name], rtol=LOSS_RTOL)
    assert min(run.metrics["device_imbalance"]) >= 1  # (max over mean per layer: 3/4 of it if the empty one counted)
    # The selection bias moves on the MoE layers as one device's; the empty layer's (an even load) stays zero.
    bias, want = (r.router["blocks"]["mlp"]["bias"] for r in (run, reference))
    bias = bias.reshape(-1, bias.shape[-1])
    assert np.abs(want).max() > 0 and not np.any(bias[3])
    np.testing.assert_allclose(bias[:3], want, rtol=0, atol=1e-6)  # test_layout_matches_one_device's bound
    blocks = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), run.params.pop("blocks"))  # zb-v's (2, 2, ...)
    assert all(not np.any(leaf[3]) for leaf in jax.tree.leaves(blocks))
    assert_params_match(run.params | {"blocks": jax.tree.map(lambda a: a[:3], blocks)}, reference.params)


def test_presets_have_the_published_sizes():
    """DeepSeek-V3: 671B, of which 37B active per token (36.6B without the input embedding,
    the paper's count); DeepSeek-V2-Lite: 15.7B, 2.4B active."""
    v3, lite = PRESETS["deepseek-v3"], PRESETS["deepseek-v2-lite"]
    assert v3.num_params() == 671_026_419_200
    assert v3.num_params(active=True) - v3.vocab * v3.embed == 36_625_618_432
    assert lite.num_params() == 15_706_484_224
    assert lite.num_params(active=True) - lite.vocab * lite.embed == 2_451_435_008


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_the_checkpoints_selection_bias_moves_with_the_run_and_is_exported(tmp_path):
    """The Hugging Face round trip through a run: a run that moves the selection bias
    (--router-bias-rate) keeps it as router state, starting from the checkpoint's
    e_score_correction_bias, not from zero, and export writes it back. After 0 steps on
    circular stages (its 2 MoE layers and 2 empty ones as pp x repeats = 4 chunks, stored
    (repeats, layers / repeats); the dense prefix outside them, stored as it is), every
    tensor is the golden's, bit for bit, the empty layers are not among them, and the
    export gives transformers' logits."""
    golden, run, out = GOLDENS / "deepseek-v3", tmp_path / "run", tmp_path / "hf"
    for argv in (["spmd.train", "--init-from", str(golden), "--mesh", "pp=2,ep=2", "--pp-schedule", "circular",
                  "--pp-repeats", "2", "--empty-layers", "2", "--router-bias-rate", "0.001", "--steps", "0", "--batch", "8", "--seq", "16",
                  "--out", str(run)],
                 ["spmd.export", "--checkpoint", str(run), "--format", "hf", "--out", str(out)]):
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    want, got = ({name: f.read(name) for f in [SafeTensors(d / "model.safetensors")] for name in f.names()}
                 for d in (golden, out))
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k].view(np.uint32), want[k].view(np.uint32)) for k in want)
    assert np.abs(want["model.layers.2.mlp.gate.e_score_correction_bias"]).max() > 0.1
    assert Directory(out).cfg == Directory(golden).cfg  # config.json says the same model
    logits = np.asarray(from_pretrained(out)(np.load(golden / "tokens.npy")))
    np.testing.assert_allclose(logits, np.load(golden / "logits.npy"), rtol=0, atol=1e-4)  # test_hf.py's bound


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-q"])
def test_every_tensor_goes_in_and_back_out_bit_for_bit(name):
    """The layout's two directions are inverses on each published tensor: the rotary rows'
    permutation (of q_b_proj, or q_proj without a query rank, and kv_a_proj_with_mqa)
    included. (test_hf.py's round trip runs the whole import and export on deepseek-v3.)"""
    directory = Directory(GOLDENS / name)
    for t in directory.tensors:
        for i in range(t.stacked or 1):
            published = [directory.files[directory.where[n]].read(n) for n in t.names(i)]
            back = t.to_hf(t.to_ours(published))
            assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(back, published, strict=True))


def test_deepseeks_recomputation_keeps_the_latents_not_the_heads(capsys):
    """`--remat mla`, the report's recomputation (section 3.2.3): the gradients of remat
    "none", and of the residuals the backward pass reads, none per head (queries, keys,
    values: (..., heads, head_dim)), where "none" keeps them; the latents they are made
    from (q_rank, kv_rank + rope_dim numbers a token) are kept instead."""
    cfg = PRESETS["deepseek-v3-tiny"]
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab)

    def residuals_and_gradients(remat):
        make = lambda: DeepSeekV3(cfg, remat=remat, rngs=nnx.Rngs(params=jax.random.key(0)))  # noqa: E731
        graphdef = nnx.graphdef(nnx.eval_shape(make))
        params = jax.jit(lambda: nnx.state(make()), compiler_options={"xla_backend_optimization_level": 0})()
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)  # noqa: E731
        capsys.readouterr()
        print_saved_residuals(loss, params)
        printed = capsys.readouterr().out
        shapes = [tuple(int(n) for n in dims.split(",")) for dims in re.findall(r"^f32\[([0-9,]+)\]", printed, re.MULTILINE)]
        return shapes, jax.tree.leaves(jax.jit(jax.grad(loss))(params))

    (mla, got), (none, want) = residuals_and_gradients("mla"), residuals_and_gradients("none")
    rows = tokens.shape  # (batch, seq): an activation's leading dimensions, after the layers'
    per_head = lambda shapes: [s for s in shapes if s[-4:] == (*rows, cfg.heads, cfg.head_dim)]  # noqa: E731
    latents = lambda shapes: [s for s in shapes if s[-3:] in ((*rows, cfg.q_rank), (*rows, cfg.latent_dim))]  # noqa: E731
    assert per_head(none) and not per_head(mla)
    assert len(latents(mla)) >= 2  # (the query's and the keys' and values')
    for a, b in zip(got, want, strict=True):  # recomputing repeats the same float32 operations (test_model's bound)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
