"""Decoding with a key/value cache (spmd.inference.decode, spmd.generate) and spmd.eval.

Greedy decoding must give exactly the tokens of recomputing the whole sequence for each
new token, on one device and on meshes, and transformers' own greedy continuations of the
golden models (tests/hf). Sampling must follow temperature, top-k and top-p, and give the
same text on any mesh. The commands: bad input and outputs that cannot be claimed give one
line before any work, --output streams to a FIFO or stdout and never replaces a special
file, and a signal stops them in one line.
"""

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.commands import one_error_line, snapshot

from models import PRESETS, Llama, attention
from spmd.config import TrainConfig, validate
from spmd.formats.hf import Directory, load_params
from spmd.inference.decode import Decoder, Sampling, bucket, filtered, left_padded, sample
from spmd.layout import make_layout

pytestmark = pytest.mark.xdist_group("generate")
# The gate holds the goldens' generation (a dense and an MoE family) and the sampling's
# filters; the other tests here (`pytest.mark.slow`) repeat it on more meshes, families and commands.

GOLDENS = Path(__file__).with_name("hf")
DRIVER = Path(__file__).with_name("cli_driver.py")
MESHES = ("dp=1", "tp=2", "dp=2,tp=2", "fsdp=2,tp=2", "tp=8")  # tp=8: beyond the 4 kv heads, which devices share
PROMPT_LENGTHS, NEW = (3, 9, 17), 12


def _layout(mesh: str, **cfg):
    cfg = validate(TrainConfig.of(mesh=mesh, **cfg))
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


@pytest.mark.slow
def test_greedy_with_the_cache_equals_recomputation_on_every_mesh(tiny):
    params, prompts = tiny
    want = _recomputed(params, prompts, NEW)
    for mesh in MESHES:
        got = _decode(_layout(mesh), params, prompts, NEW)
        np.testing.assert_array_equal(got, want, err_msg=mesh)


@pytest.mark.slow
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


@pytest.mark.parametrize("name,mesh", [  # the gate keeps a dense and an MoE golden; the other families are slow
    ("llama-gqa", "dp=1"), *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("llama-tied-rope", "fsdp=2,tp=2"), ("mixtral", "dp=1")]],
    ("mixtral", "dp=2,ep=2,tp=2"), *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("qwen3", "fsdp=2,tp=2"), ("qwen2", "fsdp=2,tp=4"), ("mistral", "dp=1"), ("mistral", "fsdp=2,tp=2"),
        ("qwen3-moe", "ep=2,tp=2"), ("qwen3-moe-dense", "ep=2,tp=2"), ("gemma3", "dp=1"), ("gemma3", "fsdp=2,tp=2"),
        ("deepseek-v3", "dp=1"), ("deepseek-v3-q", "fsdp=2,ep=2,tp=2"), ("olmo2", "dp=1"), ("olmo2", "fsdp=2,tp=4")]]])
def test_greedy_equals_transformers_generate(name, mesh):
    folder = GOLDENS / name
    layout = _layout(mesh, init_from=str(folder))
    params = jax.device_get(load_params(Directory(folder), layout))
    tokens = np.load(folder / "tokens.npy")
    for length in (1, 7, 20):
        want = np.load(folder / f"greedy-{length}.npy")
        got = _decode(layout, params, list(tokens[:, :length]), want.shape[1])
        np.testing.assert_array_equal(got, want, err_msg=f"{name} on {mesh}, prompts of {length}")


@pytest.mark.parametrize("name,mesh", [("mistral", "dp=1"), ("gemma3", "fsdp=2,tp=2")])
@pytest.mark.slow
def test_greedy_reading_the_cache_in_small_chunks(monkeypatch, tiny, name, mesh):
    """Decoding reads the cache a chunk at a time, up to the newest token (the online
    softmax of models.attention.cached_attention). Chunks of 8 slots make the goldens'
    caches (32 prompt slots + new tokens) several chunks, the last overlapping the one
    before; the windows of Mistral and of Gemma 3's local layers skip the chunks before
    them. The tokens stay transformers' and recomputation's."""
    monkeypatch.setattr(attention, "DECODE_CHUNK", 8)
    test_greedy_equals_transformers_generate(name, mesh)
    params, prompts = tiny
    np.testing.assert_array_equal(_decode(_layout("dp=2,tp=2"), params, prompts, NEW),
                                  _recomputed(params, prompts, NEW))


@pytest.mark.slow
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


@pytest.mark.slow
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
                           "beyond the model's trained context of 32 tokens; give at most 30"),
    "no new tokens": (["--checkpoint", "{run}", "--prompt", "hi", "--max-new-tokens", "0"],
                      "--max-new-tokens must be at least 1"),
    "negative temperature": (["--checkpoint", "{run}", "--prompt", "hi", "--temperature", "-0.5"],
                             "--temperature must be at least 0"),
    "top-p zero": (["--checkpoint", "{run}", "--prompt", "hi", "--top-p", "0"],
                   "--top-p must be positive and at most 1"),
    "top-p above one": (["--checkpoint", "{run}", "--prompt", "hi", "--top-p", "1.5"],
                        "--top-p must be positive and at most 1"),
    "no checkpoint": (["--checkpoint", "no/such/run", "--prompt", "hi"], "--checkpoint no/such/run does not exist"),
    "heads do not divide": (["--checkpoint", "{run}", "--prompt", "hi", "--mesh", "tp=16"],
                            "tp=16 must divide heads=8"),
    "two sources": (["--checkpoint", "{run}", "--init-from", "{run}", "--prompt", "hi"], "give one of"),
    # --output never over what is read (the checkpoint's run, the prompts, the model's directory).
    "output over the prompts": (["--checkpoint", "{run}", "--prompts", "{prompts}", "--output", "{prompts}"],
                                "would write over the input --prompts"),
    "output over a checkpoint's file": (["--checkpoint", "{run}", "--prompt", "hi", "--output", "{checkpoint_file}"],
                                        "would write over the input --checkpoint"),
    "output inside the run": (["--checkpoint", "{run}/30", "--prompt", "hi", "--output", "{run}/out.jsonl"],
                              "would write over the input --checkpoint"),
    "output over the model's config": (["--init-from", "{gqa}", "--prompt", "hi", "--output", "{gqa}/config.json"],
                                       "would write over the input --init-from"),
    "output under a file": (["--checkpoint", "{run}", "--prompt", "hi", "--output", "{prompts}/out.jsonl"],
                            "prompts.jsonl is a file, not a directory"),
    "output is a directory": (["--checkpoint", "{run}", "--prompt", "hi", "--output", "{gqa}"],
                              "is a directory, not a file"),
    "prompts is a directory": (["--checkpoint", "{run}", "--prompts", "{run}"], "is a directory, not a regular file"),
    "prompts is a FIFO": (["--checkpoint", "{run}", "--prompts", "{fifo}"], "is a FIFO, not a regular file"),
    "seed beyond 64 bits": (["--checkpoint", "{run}", "--prompt", "hi", "--seed", str(2**64 + 5)],
                            "argument --seed: must be a 64-bit integer"),
    "empty prompt": (["--checkpoint", "{run}", "--prompt", ""], "argument --prompt: the value is empty"),
    "top-k beyond the vocabulary": (["--checkpoint", "{run}", "--prompt", "hi", "--temperature", "1", "--top-k",
                                     "1000"], "is more than the model's vocabulary of 256 tokens"),
    "top-k beyond 64 bits": (["--checkpoint", "{run}", "--prompt", "hi", "--top-k", str(10**30)],
                             "argument --top-k: must be a 64-bit integer"),
    "prompt as long as the context": (["--checkpoint", "{run}", "--prompt", "x" * 32],
                                      "prompt 1 is too long: 32 tokens, and the model's trained context is 32"),
    "prompt longer than the context, new tokens given": (
        ["--checkpoint", "{run}", "--prompt", "hi", "--prompt", "y" * 40, "--max-new-tokens", "4"],
        "prompt 2 is too long: 40 tokens"),
    # The command line's bytes b"ab\xff", as Python hands them over (surrogate escapes).
    "prompt not UTF-8": (["--checkpoint", "{run}", "--prompt", "ab\udcff"], "prompt 1 is not UTF-8 text"),
    "prompts file with a lone surrogate": (["--checkpoint", "{run}", "--prompts", "{surrogate}"],
                                           "line 1: the text field 'prompt' holds a lone surrogate"),
    "tokenizer beyond the vocabulary": (["--init-from", "{big_tokenizer}", "--prompt", "hi"],
                                        "the tokenizer tokenizer.json has token ids up to 139, beyond the model's "
                                        "vocabulary of 128"),
    "max positions not a number": (["--init-from", "{positions_abc}", "--prompt", "hi"], "max_position_embeddings"),
    "max positions negative": (["--init-from", "{positions_negative}", "--prompt", "hi"], "max_position_embeddings"),
    "max positions fractional": (["--init-from", "{positions_fraction}", "--prompt", "hi"], "max_position_embeddings"),
    # A cache four times this host's memory: refused from XLA's plan, before the weights are placed.
    "batch beyond the memory": (["--init-from", "{long_context}", "--prompts", "{many}", "--batch-size", "1000000",
                                 "--max-new-tokens", "{new}"], "generating needs"),
    "eval: no checkpoint": (["--checkpoint", "no/such/run", "--data", "{text}"], "does not exist"),
    "eval: no data": (["--checkpoint", "{run}"], "the following arguments are required: --data"),
}
PROMPTS_FOR_THE_FIT = 10_000
CACHE_BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # llama-gqa: keys and values x 2 layers x 2 kv heads x 8 dims x float32


def _model_dir(root: Path, name: str, positions=256, extra_tokens: int = 0) -> str:
    """A copy of the llama-gqa golden with its config's max_position_embeddings set, and
    `extra_tokens` more tokens in its tokenizer."""
    import shutil

    import tokenizers

    folder = root / name
    shutil.copytree(GOLDENS / "llama-gqa", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": positions}))
    if extra_tokens:
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.add_tokens([f"<extra{i}>" for i in range(extra_tokens)])
        tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.mark.slow
def test_bad_input_gives_one_error_line_and_exit_2(run_dir, tmp_path):
    from spmd.base.hardware import host_memory_bytes

    new = -(-4 * host_memory_bytes() // (PROMPTS_FOR_THE_FIT * CACHE_BYTES_PER_TOKEN))
    assert new < 2**30, "a host this large needs more prompts here"
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the cat"}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"prompt": "a\\ud800b"}\n')
    (tmp_path / "many.jsonl").write_text('{"prompt": "hello"}\n' * PROMPTS_FOR_THE_FIT)
    os.mkfifo(tmp_path / "fifo")
    files = {"run": str(run_dir / "run"), "empty": str(tmp_path / "empty.jsonl"), "text": str(run_dir / "text.txt"),
             "prompts": str(tmp_path / "prompts.jsonl"), "many": str(tmp_path / "many.jsonl"),
             "surrogate": str(tmp_path / "surrogate.jsonl"),
             "fifo": str(tmp_path / "fifo"), "checkpoint_file": str(run_dir / "run" / "30" / "_CHECKPOINT_METADATA"),
             "gqa": _model_dir(tmp_path, "gqa"), "big_tokenizer": _model_dir(tmp_path, "big", extra_tokens=20),
             "positions_abc": _model_dir(tmp_path, "abc", "abc"), "positions_negative": _model_dir(tmp_path, "neg", -5),
             "positions_fraction": _model_dir(tmp_path, "frac", 64.7),
             "long_context": _model_dir(tmp_path, "long", new + 64), "new": str(new)}
    batch = []
    for i, (name, (argv, _)) in enumerate(CASES.items()):
        (tmp_path / "work" / str(i)).mkdir(parents=True)
        module = "spmd.eval" if name.startswith("eval:") else "spmd.generate"
        batch.append({"module": module, "cwd": str(tmp_path / "work" / str(i)),
                      "argv": [a.format(**files) for a in argv]})
    before = snapshot(run_dir), snapshot(tmp_path)
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    for (name, (_, fragment)), result in zip(CASES.items(), json.loads(done.stdout)):
        assert result["code"] == 2, (name, result)
        line = one_error_line(result["stderr"])
        assert fragment in line, (name, line)
        if name.startswith("max positions") or name.startswith("prompt"):
            assert "--max-new-tokens" not in line, (name, line)  # not blamed on a flag nobody gave
    assert (snapshot(run_dir), snapshot(tmp_path)) == before  # nothing written, the inputs as they were


def _mknod(path: Path, major: int, minor: int) -> None:
    """A character device node of our own, in a temporary directory (never /dev's)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("making a device node needs root")


@pytest.mark.slow
def test_output_streams_to_a_fifo_stdout_or_the_null_device_and_never_replaces_a_special_file(run_dir, tmp_path):
    _mknod(tmp_path / "full", 1, 7)  # /dev/full: every write fails with ENOSPC
    _mknod(tmp_path / "null", 1, 3)
    os.mkfifo(tmp_path / "fifo")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket"))
    kinds = {name: stat.S_IFMT((tmp_path / name).stat().st_mode) for name in ("full", "null", "fifo", "socket")}
    cases = {"full": ("full", 2), "socket": ("socket", 2), "null": ("null", 0), "fifo": ("fifo", 0),
             "stdout": ("/dev/stdout", 0)}
    batch = [{"module": "spmd.generate", "cwd": str(tmp_path), "argv": [
        "--checkpoint", str(run_dir / "run"), "--prompt", "the cat", "--max-new-tokens", "4", "--output", output]}
        for output, _ in cases.values()]
    with open(tmp_path / "read.jsonl", "wb") as read:
        reader = subprocess.Popen(["cat", str(tmp_path / "fifo")], stdout=read)  # the FIFO's reader, waiting
        done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                              timeout=300)
        reader.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    results = dict(zip(cases, json.loads(done.stdout)))
    for name, (_, code) in cases.items():
        assert results[name]["code"] == code, (name, results[name])
    assert one_error_line(results["full"]["stderr"]).startswith(
        "error: --output full is a character device (1:7), not a regular file")
    assert "--output socket is a socket, not a regular file" in one_error_line(results["socket"]["stderr"])
    assert {name: stat.S_IFMT((tmp_path / name).stat().st_mode) for name in kinds} == kinds  # none replaced
    record = json.loads((tmp_path / "read.jsonl").read_text())
    assert record["prompt"] == "the cat" and len(record["completion_tokens"]) == 4
    # Its stdout is the records alone (the text and the report go to stderr), ready for a pipe.
    assert json.loads(results["stdout"]["stdout"]) == record
    assert "--- 1: 7 + 4 tokens" in results["stdout"]["stderr"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "full", "null", "read.jsonl", "socket"]


def _serving_signals(pid: int) -> bool:
    """Whether the process blocks SIGINT and SIGTERM in its main thread (spmd.base.signals serves them)."""
    with contextlib.suppress(OSError):
        blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text(), re.M)[1], 16)
        return all(blocked >> (sig - 1) & 1 for sig in (signal.SIGINT, signal.SIGTERM))
    return False


def _threads(pid: int) -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/task"))
    return 0


def _stopped(command: list[str], signum: int, ready) -> tuple[int, str, str]:
    """Run `command`, send it `signum` once `ready(pid)`; -> (exit code, stdout, stderr)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "it ended before the signal"
            time.sleep(0.002)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out, err


@pytest.mark.slow
def test_a_signal_stops_generate_in_one_line(run_dir, tmp_path):
    command = [sys.executable, "-m", "spmd.generate", "--checkpoint", str(run_dir / "run"), "--prompt", "the cat",
               "--max-new-tokens", "4", "--output", str(tmp_path / "out.jsonl")]
    # Ctrl-C once JAX's threads run (the model is being placed, compiled or decoded).
    assert _stopped(command, signal.SIGINT, lambda pid: _threads(pid) > 4) == \
        (130, "", "SIGINT: stopped; nothing was written\n")
    # SIGTERM as soon as the signals are served: a failure too (143), in one line.
    assert _stopped(command, signal.SIGTERM, _serving_signals) == (143, "", "SIGTERM: stopped; nothing was written\n")
    assert list(tmp_path.iterdir()) == []
