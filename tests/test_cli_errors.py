"""Bad input: one `error: ...` line on stderr, exit code 2, nothing written."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# One worker runs them all: the module's fixture runs every case, through one driver.
pytestmark = [pytest.mark.xdist_group("cli"),
              pytest.mark.floor]  # what can differ between JAX versions
DRIVER = Path(__file__).with_name("cli_driver.py")
HF = Path(__file__).with_name("hf")

CASES = {
    "mesh product is not the device count": (["--mesh", "dp=3", "--cpu-devices", "8"], "needs 3 devices"),
    "unknown axis": (["--mesh", "xp=2"], "unknown mesh axis 'xp'"),
    "non-integer size": (["--mesh", "dp=two"], "must be an integer"),
    "heads not divisible by tp": (["--mesh", "tp=3"], "tp=3 must divide heads=8 and either divide kv_heads=4"),
    "batch not divisible by batch axes": (["--mesh", "dp=2,fsdp=2", "--batch", "6"], "does not divide by the batch axes"),
    "unknown model": (["--model", "gpt-17"], "unknown model 'gpt-17'"),
    "negative steps": (["--steps", "-1"], "--steps must be at least 0 and at most 2147483647, got -1"),
    "missing config file": (["--config", "no/such/file.yaml"], "config file not found"),
    "malformed yaml": (["--config", "{bad}"], "is not valid YAML"),
    "unknown option in yaml": (["--config", "{unknown}"], "unknown option 'warp'"),
    "unknown flag": (["--wrap", "3"], "unrecognized arguments"),
    "microbatches not a multiple of pp": (["--mesh", "pp=2", "--microbatches", "3"], "--microbatches 3 must be a multiple of pp=2"),
    "interleaved 1f1b with one chunk": (["--mesh", "pp=2", "--pp-schedule", "interleaved-1f1b"],
                                        "interleaved-1f1b needs --pp-repeats 2 or more"),
    "zb-v with layers not in 2 x pp chunks": (["--mesh", "pp=2", "--pp-schedule", "zb-v", "--layers", "6"],
                                              "6 layers do not divide into 2 x pp = 4 chunks (each stage runs one "
                                              "going down and one coming back): give --empty-layers 2"),
    "unknown hardware": (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    "sequence not in 2 x sp chunks": (["--mesh", "sp=4", "--seq", "12"], "does not divide into 2 x sp = 8 chunks"),
    "megatron-sp sequence": (["--mesh", "tp=4", "--megatron-sp", "--seq", "6"], "does not divide by sp x tp = 4"),
    "unknown attention mode": (["--attention", "flash"], "invalid choice: 'flash'"),
    "experts not divisible by ep": (["--model", "moe-tiny", "--experts", "6", "--mesh", "ep=4"], "experts=6 does not divide by ep=4"),
    "top-k above experts": (["--model", "moe-tiny", "--top-k", "9"], "--top-k 9 is more than the 8 experts"),
    "capacity factor not positive": (["--model", "moe-tiny", "--capacity-factor", "0"], "--capacity-factor must be positive"),
    "experts on a dense model": (["--experts", "4"], "tiny is dense"),
    "redundant experts without ep": (["--model", "moe-tiny", "--redundant-experts", "2", "--mesh", "dp=2"],
                                     "--redundant-experts 2 spreads copies of busy experts over ep devices; the mesh has ep=1"),
    "redundant experts not fitting the slots": (["--model", "moe-tiny", "--redundant-experts", "2", "--mesh", "ep=4"],
                                                "8 experts + 2 copies = 10 slots do not split over ep=4 devices"),
    "rebalancing without redundant experts": (["--model", "moe-tiny", "--rebalance-every", "5"],
                                              "--rebalance-every applies to --redundant-experts"),
    "rebalancing every 0 steps": (["--model", "moe-tiny", "--redundant-experts", "4", "--mesh", "ep=4",
                                   "--rebalance-every", "0"], "--rebalance-every must be at least 1 and at most 2147483647, got 0"),
    "router bias on a dense model": (["--router-bias-rate", "0.001"], "--router-bias-rate applies to MoE models"),
    "DeepSeek-V3 within its dense prefix": (["--model", "deepseek-v3-tiny", "--layers", "2"],
                                            "MoE in every layer after its 2 dense ones, and at least one: 2 layers"),
    "DeepSeek-V3's groups and top-k": (["--model", "deepseek-v3-tiny", "--experts", "10"],
                                       "10 experts do not split into 4 groups"),
    "DeepSeek-V3's MoE layers over stages": (["--model", "deepseek-v3-tiny", "--mesh", "pp=4", "--layers", "8"],
                                             "6 MoE layers (its 2 dense ones run before the stages) do not divide"),
    "LoRA on latent attention": (["--model", "deepseek-v3-tiny", "--lora-rank", "4"],
                                 "which deepseek-v3-tiny's latent attention does not have"),
    "missing data path": (["--data", "no/such/corpus"], "--data no/such/corpus: no such file or directory"),
    "empty data folder": (["--data", "{empty_dir}"], "no data files"),
    "empty data file": (["--data", "{empty_file}"], "0 tokens make 0 sample(s) of 64 tokens; too few for training"),
    "tokenizer larger than the model": (["--data", "{corpus}", "--tokenizer", "{big_tokenizer}"],
                                        "has token ids up to 299, beyond the model's vocabulary of 256"),
    # 11 tokens, one of them numbered 1000: the ids decide, not the count.
    "tokenizer with an id beyond the model": (["--data", "{corpus}", "--tokenizer", "{gap_tokenizer}"],
                                              "has token ids up to 1,000, beyond the model's vocabulary of 256"),
    "token file of the wrong dtype": (["--data", "{int64_tokens}"], "holds a 1-d int64 array"),
    "dcn that does not divide the mesh": (["--dcn", "dp=4"], "--dcn dp=4 does not divide the mesh's dp=2"),
    "some process flags missing": (["--num-processes", "2"], "several processes need all of --coordinator"),
    "lora target the model lacks": (["--lora-rank", "4", "--lora-targets", "q_proj,w1"],
                                    "--lora-targets q_proj,w1: w1 is not a projection of tiny"),
    "lora rank 0": (["--lora-rank", "0"], "--lora-rank must be at least 1 and at most 65536, got 0"),
    "lora rank above a projection's smaller side": (["--lora-rank", "33"],
                                                    "--lora-rank 33 is more than k_proj's smaller side (64 -> 32 in tiny)"),
    "lora flag without a rank": (["--lora-alpha", "16"], "--lora-alpha applies to LoRA runs; give --lora-rank R"),
    "lora on experts": (["--model", "moe-tiny", "--lora-rank", "4", "--lora-targets", "q_proj,gate_proj"],
                        "--lora-targets gate_proj: the MLPs of moe-tiny are experts, which take no adapters"),
    "adapter without its base": (["--adapter", str(HF / "lora-peft")], "--adapter needs --init-from"),
    # peft's adapter of llama-gqa (queries 4 heads x 8) on Qwen3's golden (4 heads x 16).
    "adapter whose shapes do not fit the base": (
        ["--init-from", str(HF / "qwen3"), "--adapter", str(HF / "lora-peft")],
        "self_attn.q_proj.lora_B.weight has shape [32, 4]; --init-from's config.json makes it [64, 4]"),
}
# spmd.plan takes the same flags; these are its own.
PLAN_CASES = {
    "plan: unknown hardware": (["--hardware", "abacus"], "unknown hardware 'abacus'"),
    "plan: mesh that does not divide the model": (["--mesh", "tp=3"], "tp=3 must divide heads=8"),
    "plan: too large for every layout": (
        ["--model", "llama3-70b", "--auto", "--devices", "8", "--hardware", "v6e"], "does not fit on 8 x v6e in any layout"),
    "plan: auto without hardware": (["--auto", "--devices", "8"], "--auto needs --hardware"),
    "plan: unknown target": (["--target", "tpu-9000"], "--target tpu-9000: unknown; give a TPU slice"),
    "plan: target and devices": (["--target", "v5p-8", "--devices", "8"], "--target names its devices"),
    # the test extra installs libtpu, not the 3.4 GB of CUDA wheels
    "plan: target without its compiler": (["--target", "h100x8"], 'pip install -e ".[aot-gpu]"'),
}
# spmd.launch checks its own flags before it starts anything.
LAUNCH_CASES = {"launch: no command": (["--nproc", "2"], "the command after --")}
CORPUS_CASES = {"corpus: output not .npy": (["--data", "{corpus}", "--out", "tokens.bin"], "--out must name a .npy file")}
ALL = {**CASES, **PLAN_CASES, **LAUNCH_CASES, **CORPUS_CASES}
MODULES = {**dict.fromkeys(PLAN_CASES, "spmd.plan"), **dict.fromkeys(LAUNCH_CASES, "spmd.launch"),
           **dict.fromkeys(CORPUS_CASES, "spmd.corpus")}


def _files(tmp) -> dict[str, str]:
    """The files that the cases' {placeholders} name."""
    from tokenizers import Tokenizer, models

    (tmp / "bad.yaml").write_text("mesh: [dp=2\nsteps: 3\n")
    (tmp / "unknown.yaml").write_text("warp: 9\n")
    (tmp / "empty").mkdir()
    (tmp / "empty.txt").write_text("")
    (tmp / "corpus.txt").write_text("some text " * 100)
    np.save(tmp / "int64.npy", np.arange(100, dtype=np.int64))
    vocab = {f"w{i}": i for i in range(299)} | {"</s>": 299}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp / "big.json"))
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)} | {"</s>": 1000}, unk_token="w0")).save(
        str(tmp / "gap.json"))
    names = {"bad": "bad.yaml", "unknown": "unknown.yaml", "empty_dir": "empty", "empty_file": "empty.txt",
             "corpus": "corpus.txt", "int64_tokens": "int64.npy", "big_tokenizer": "big.json",
             "gap_tokenizer": "gap.json"}
    return {f"{{{key}}}": str(tmp / name) for key, name in names.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case as its own process, forked by one driver (tests/cli_driver.py) that has
    imported the commands once."""
    tmp = tmp_path_factory.mktemp("cli")
    files = _files(tmp)
    batch, metrics = [], {}
    for i, (name, (args, _)) in enumerate(ALL.items()):
        module = MODULES.get(name, "spmd.train")
        metrics[name] = tmp / f"{i}.jsonl"
        records = ["--metrics-file", str(metrics[name])] if module in ("spmd.train", "spmd.plan") else []
        (tmp / "work" / str(i)).mkdir(parents=True)
        batch.append({"module": module, "cwd": str(tmp / "work" / str(i)),
                      "argv": [files.get(a, a) for a in args] + records})
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return {name: ((r["stdout"], r["stderr"]), r["code"], metrics[name]) for name, r in zip(ALL, json.loads(done.stdout))}


@pytest.mark.parametrize("case", ALL)
def test_bad_input_gives_one_error_line_and_exit_2(results, case):
    (out, err), code, metrics = results[case]
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert ALL[case][1] in lines[0]
    assert not metrics.exists()  # nothing written
