"""Decoding with a key/value cache (spmd.decode, spmd.generate) and spmd.eval.

Greedy decoding must give exactly the tokens of recomputing the whole sequence for each
new token, on one device and on meshes, and transformers' own greedy continuations of the
golden models (tests/hf). Sampling must follow temperature, top-k and top-p, and give the
same text on any mesh.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import one_error_line

from models import PRESETS, Llama
from spmd.config import TrainConfig, validate
from spmd.decode import Decoder, Sampling, bucket, filtered, left_padded, sample
from spmd.hf import Directory, load_params
from spmd.layout import make_layout

pytestmark = pytest.mark.xdist_group("generate")

GOLDENS = Path(__file__).with_name("hf")
DRIVER = Path(__file__).with_name("cli_driver.py")
MESHES = ("dp=1", "tp=2", "dp=2,tp=2", "fsdp=2,tp=2", "tp=8")  # tp=8: beyond the 4 kv heads, which devices share
PROMPT_LENGTHS, NEW = (3, 9, 17), 12


def _layout(mesh: str, **cfg):
    cfg = validate(TrainConfig(mesh=mesh, **cfg))
    devices = int(np.prod([int(p.split("=")[1]) for p in mesh.split(",")]))
    return make_layout(cfg, jax.devices()[:devices], for_training=False)


def _decode(layout, params, prompts, new: int, sampling=Sampling(), seed: int = 0) -> np.ndarray:
    shards = layout.batch_shards
    batch = -(-len(prompts) // shards) * shards
    decoder = Decoder(layout, batch, bucket(max(map(len, prompts))), new, sampling)
    tokens, pads = left_padded(prompts, batch, decoder.prompt_len)
    rows = np.arange(batch, dtype=np.int32)
    key = jax.random.key(seed)
    placed = jax.device_put(params, layout.shardings(layout.rules.params))
    with jax.set_mesh(layout.mesh):
        cache, first = decoder.prefill(placed, tokens, pads, rows, key)
        return np.asarray(decoder.generate(placed, cache, first, pads, rows, key))[:len(prompts)]


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset's parameters (one device), and prompts of three lengths."""
    params = nnx.to_pure_dict(nnx.state(Llama(PRESETS["tiny"], rngs=nnx.Rngs(params=jax.random.key(3))), nnx.Param))
    rng = np.random.default_rng(0)
    return params, [rng.integers(0, 256, n).astype(np.int32) for n in PROMPT_LENGTHS]


def _recomputed(params, prompts, new: int, model: str = "tiny") -> np.ndarray:
    """Greedy tokens by running the whole sequence again for each new token (no cache)."""
    graph = _layout("dp=1", model=model).skeleton.graphdef
    width = max(map(len, prompts)) + new
    forward = jax.jit(lambda p, t: nnx.merge(graph, p)(t))
    rows = np.zeros((len(prompts), width), np.int32)  # right-padded: causal, so the padding is never seen
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    out = []
    for _ in range(new):
        logits = np.asarray(forward(params, rows))
        token = logits[np.arange(len(prompts)), lengths - 1].argmax(-1)
        rows[np.arange(len(prompts)), lengths] = token
        lengths = lengths + 1
        out.append(token)
    return np.stack(out, axis=1)


def test_greedy_with_the_cache_equals_recomputation_on_every_mesh(tiny):
    params, prompts = tiny
    want = _recomputed(params, prompts, NEW)
    for mesh in MESHES:
        got = _decode(_layout(mesh), params, prompts, NEW)
        np.testing.assert_array_equal(got, want, err_msg=mesh)


def test_greedy_with_the_cache_equals_recomputation_with_experts(tiny):
    """An MoE model whose scanned unit is a dense block then an MoE block (moe-tiny), with
    a shared expert; on one device and with its experts over ep."""
    prompts = tiny[1]
    params = nnx.to_pure_dict(nnx.state(Llama(PRESETS["moe-tiny"], rngs=nnx.Rngs(params=jax.random.key(4))),
                                        nnx.Param))
    want = _recomputed(params, prompts, NEW, "moe-tiny")
    for mesh in ("dp=1", "ep=2,tp=2"):
        np.testing.assert_array_equal(_decode(_layout(mesh, model="moe-tiny"), params, prompts, NEW), want,
                                      err_msg=mesh)


@pytest.mark.parametrize("name,mesh", [("llama-gqa", "dp=1"), ("llama-tied-rope", "fsdp=2,tp=2"),
                                       ("mixtral", "dp=1"), ("mixtral", "dp=2,ep=2,tp=2")])
def test_greedy_equals_transformers_generate(name, mesh):
    folder = GOLDENS / name
    layout = _layout(mesh, init_from=str(folder))
    params = jax.device_get(load_params(Directory(folder), layout))
    tokens = np.load(folder / "tokens.npy")
    for length in (1, 7, 20):
        want = np.load(folder / f"greedy-{length}.npy")
        got = _decode(layout, params, list(tokens[:, :length]), want.shape[1])
        np.testing.assert_array_equal(got, want, err_msg=f"{name} on {mesh}, prompts of {length}")


def test_sampling_gives_the_same_tokens_on_any_mesh(tiny):
    params, prompts = tiny
    sampling = Sampling(temperature=1.0, top_k=50, top_p=0.95)
    runs = {mesh: _decode(_layout(mesh), params, prompts, NEW, sampling, seed=7) for mesh in MESHES}
    for mesh, tokens in runs.items():
        np.testing.assert_array_equal(tokens, runs["dp=1"], err_msg=mesh)
    other_seed = _decode(_layout("dp=1"), params, prompts, NEW, sampling, seed=8)
    assert not np.array_equal(other_seed, runs["dp=1"])  # the seed does choose


# A constructed distribution over 5 tokens, and 20,000 draws: a frequency's standard error
# is at most sqrt(0.25 / 20000) = 0.0035, so 0.02 is over 5 of them.
PROBS = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
DRAWS, FREQ_ATOL = 20_000, 0.02


@pytest.mark.parametrize("sampling,expected", [
    (Sampling(1.0), PROBS),
    (Sampling(0.5), PROBS**2 / np.sum(PROBS**2)),  # temperature 0.5 squares the probabilities
    (Sampling(1.0, top_k=2), np.array([0.5, 0.3, 0, 0, 0]) / 0.8),
    (Sampling(1.0, top_p=0.7), np.array([0.5, 0.3, 0, 0, 0]) / 0.8),  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    (Sampling(1.0, top_p=0.5), np.array([1.0, 0, 0, 0, 0])),
    (Sampling(1.0, top_k=3, top_p=0.9), np.array([0.5, 0.3, 0.15, 0, 0]) / 0.95),
])
def test_sampling_follows_temperature_top_k_and_top_p(sampling, expected):
    logits = jnp.log(jnp.broadcast_to(jnp.asarray(PROBS + 1e-30, jnp.float32), (DRAWS, 5)))
    tokens = np.asarray(jax.jit(lambda lg: sample(lg, sampling, jax.random.key(0), 0, jnp.arange(DRAWS)))(logits))
    freq = np.bincount(tokens, minlength=5) / DRAWS
    np.testing.assert_allclose(freq, expected, atol=FREQ_ATOL)
    assert np.all(freq[expected == 0] == 0)  # what the filters drop is never drawn


def test_greedy_is_the_argmax_and_filters_keep_the_best():
    logits = jnp.asarray([[0.1, 2.0, -1.0, 1.9]])
    assert int(sample(logits, Sampling(), jax.random.key(0), 0, jnp.arange(1))[0]) == 1
    assert np.isfinite(np.asarray(filtered(logits, 1, 1.0))).sum() == 4  # filtered to the min, not dropped
    assert (np.asarray(filtered(logits, 1, 1.0)) > -1e30).sum() == 1


# ------------------------------------------------------------------ the commands

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny model trained 30 steps on some text (bytes), saved."""
    root = tmp_path_factory.mktemp("gen")
    (root / "text.txt").write_text("the cat sat on the mat. " * 400)
    done = subprocess.run([sys.executable, "-m", "spmd.train", "--data", str(root / "text.txt"), "--steps", "30",
                           "--batch", "16", "--seq", "32", "--lr", "1e-2", "--warmup", "2", "--mesh", "dp=2",
                           "--out", str(root / "run")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return root


def test_generate_and_eval_commands(run_dir, tmp_path):
    out = tmp_path / "completions.jsonl"
    prompts = ["the cat", "the mat. the", "é"]  # the last: two bytes
    argv = [sys.executable, "-m", "spmd.generate", "--checkpoint", str(run_dir / "run"), "--max-new-tokens", "12",
            "--output", str(out)] + [a for p in prompts for a in ("--prompt", p)]
    one = subprocess.run(argv + ["--mesh", "tp=2"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert "decode:" in one.stdout and "tokens/s" in one.stdout and "key/value cache:" in one.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts
    for r, p in zip(records, prompts):
        assert r["prompt_tokens"] == list(p.encode())
        assert bytes(r["completion_tokens"]).decode(errors="replace") == r["completion"]
    assert records[0]["completion"].startswith(" sat")  # it learned the text
    out.unlink()
    other = subprocess.run(argv + ["--mesh", "dp=2", "--batch-size", "2"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == records  # any mesh, any batch

    losses = []
    for mesh in ("dp=1", "fsdp=2,tp=2"):
        done = subprocess.run([sys.executable, "-m", "spmd.eval", "--checkpoint", str(run_dir / "run"), "--data",
                               str(run_dir / "text.txt"), "--batches", "4", "--mesh", mesh],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        loss, perplexity = (float(done.stdout.split(word)[1].split()[0]) for word in ("loss", "perplexity"))
        assert perplexity == pytest.approx(np.exp(loss), rel=1e-3)
        losses.append(loss)
    assert losses[0] < 1.5  # the text repeats: a trained model predicts it well
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)  # printed to 4 decimals
    # Every batch of the text (600 of 2 x 8) on two devices: with all of them in flight at
    # once, XLA:CPU's collectives aborted the process; the command keeps two in flight.
    done = subprocess.run([sys.executable, "-m", "spmd.eval", "--checkpoint", str(run_dir / "run"), "--data",
                           str(run_dir / "text.txt"), "--batch", "2", "--seq", "8", "--mesh", "dp=2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "(600 batches of 2 x 8" in done.stdout, done.stderr


CASES = {
    "no prompt": (["--checkpoint", "{run}"], "no prompt"),
    "empty prompts file": (["--checkpoint", "{run}", "--prompts", "{empty}"], "holds no prompt"),
    "beyond the context": (["--checkpoint", "{run}", "--prompt", "hi", "--max-new-tokens", "40"],
                           "beyond the model's trained context of 32 tokens"),
    "no new tokens": (["--checkpoint", "{run}", "--prompt", "hi", "--max-new-tokens", "0"],
                      "--max-new-tokens must be at least 1"),
    "negative temperature": (["--checkpoint", "{run}", "--prompt", "hi", "--temperature", "-0.5"],
                             "--temperature must be at least 0"),
    "top-p zero": (["--checkpoint", "{run}", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    "top-p above one": (["--checkpoint", "{run}", "--prompt", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    "no checkpoint": (["--checkpoint", "no/such/run", "--prompt", "hi"], "--checkpoint no/such/run does not exist"),
    "heads do not divide": (["--checkpoint", "{run}", "--prompt", "hi", "--mesh", "tp=16"],
                            "tp=16 must divide heads=8"),
    "two sources": (["--checkpoint", "{run}", "--init-from", "{run}", "--prompt", "hi"], "give one of"),
    "eval: no checkpoint": (["--checkpoint", "no/such/run", "--data", "{text}"], "does not exist"),
    "eval: no data": (["--checkpoint", "{run}"], "the following arguments are required: --data"),
}


def test_bad_input_gives_one_error_line_and_exit_2(run_dir, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    files = {"run": str(run_dir / "run"), "empty": str(tmp_path / "empty.jsonl"), "text": str(run_dir / "text.txt")}
    batch = []
    for i, (name, (argv, _)) in enumerate(CASES.items()):
        (tmp_path / str(i)).mkdir()
        module = "spmd.eval" if name.startswith("eval:") else "spmd.generate"
        batch.append({"module": module, "cwd": str(tmp_path / str(i)), "argv": [a.format(**files) for a in argv]})
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    for (name, (_, fragment)), result in zip(CASES.items(), json.loads(done.stdout)):
        assert result["code"] == 2, (name, result)
        assert fragment in one_error_line(result["stderr"]), name
