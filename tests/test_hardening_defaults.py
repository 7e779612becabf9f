"""Issue #52 (hardening), the defaults and the bounds:

- Without --mesh, spmd.train, spmd.eval and spmd.generate use every device found, in a
  default layout (spmd.parallel.defaults) that their first line names, on 1, 2, 4 and 8
  devices (XLA_FLAGS' forced count, set per process); the numbers do not depend on it, and
  spmd.train on a bare CPU host still emulates 8 devices for its 3-D default.
- A sliding window wider than any sequence (config.json's `sliding_window: 1e15`, an
  integer) is clamped and changes nothing; written as a float it is refused in one line.
- Every size option is bounded before anything is allocated, named with its bound.
- A resume whose --empty-layers or --lora-targets differ from its checkpoint's names the
  flag and both values; --empty-layers without pipeline stages is refused, and a depth
  that does not divide asks for the fewest empty layers that even it out.

The command cases run in one driver per device count (tests/cli_driver.py: one fork a
case); the refusals are all made before anything compiles. A checkpoint here is a run
directory holding one step's record (`meta`) and no arrays: all that a resume reads before
it is refused.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.commands import one_error_line

from models.llama.hf import WIDEST_WINDOW
from spmd.base.errors import UserError
from spmd.config import TrainConfig, validate
from spmd.formats.checkpoint import make_meta
from spmd.formats.hf import Directory
from spmd.parallel.defaults import default_layout
from spmd.parallel.mesh import format_mesh
from spmd.parallel.skeleton import skeleton_for

pytestmark = pytest.mark.xdist_group("hardening_defaults")

TESTS = Path(__file__).parent
DRIVER = TESTS / "cli_driver.py"
SFT_MODEL, CHAT, GQA = TESTS / "sft" / "model", TESTS / "sft" / "chat.jsonl", TESTS / "hf" / "llama-gqa"
COUNTS = (1, 2, 4, 8)

# Each command without --mesh (small: a step, a batch, two tokens), and the layout it takes
# on each device count: the tiny preset trains FSDP, or the 3-D mesh on 8; the two small
# Hugging Face models (4 heads, 2 kv heads) serve with tp as wide as their heads allow.
DEFAULT_RUNS = {
    "train": ("spmd.train", ["--steps", "1", "--batch", "8", "--seq", "16"],
              {1: "single device", 2: "fsdp=2", 4: "fsdp=4", 8: "dp=2,fsdp=2,tp=2"}),
    "eval": ("spmd.eval", ["--init-from", str(SFT_MODEL), "--data", str(CHAT), "--seq", "32"],
             {1: "single device", 2: "tp=2", 4: "tp=4", 8: "fsdp=2,tp=4"}),
    "generate": ("spmd.generate", ["--init-from", str(GQA), "--prompt", "hello", "--max-new-tokens", "2"],
                 {1: "single device", 2: "tp=2", 4: "tp=4", 8: "fsdp=2,tp=4"}),
}
# A Mistral model whose window hides nothing, as a huge integer and as none: the same numbers.
WINDOW_RUNS = {
    "train": ("spmd.train", ["--steps", "1", "--batch", "2", "--seq", "16", "--init-from"]),
    "generate": ("spmd.generate", ["--prompt", "hello", "--max-new-tokens", "2", "--init-from"]),
}

RESUME = ["--batch", "8", "--seq", "16", "--steps", "2"]
# name -> (module, argv, fragment of the one error line); {names}: the fixture's files.
REFUSED = {
    # Bounds, before anything is allocated.
    "plan: a preset's seq of 10**12": ("spmd.plan", ["--config", "{huge_seq}"],
                                       "--seq must be at least 1 and at most 16777216, got 1000000000000"),
    "plan: a preset with --batch 10**12": (
        "spmd.plan", ["--config", str(TESTS.parent / "mesh_configs" / "llama3-8b-8xh100.yaml"), "--batch",
                      "1000000000000"], "--batch must be at least 1 and at most 1073741824, got 1000000000000"),
    "train: tokens a step": ("spmd.train", ["--batch", "100000000"],
                             "--batch 100000000 x --seq 64 is 6,400,000,000 tokens a step; at most 1,073,741,824"),
    "eval: --batch": ("spmd.eval", ["--init-from", str(SFT_MODEL), "--data", str(CHAT), "--batch", "1000000000000"],
                      "--batch must be at least 1 and at most 1073741824"),
    "generate: --max-new-tokens": ("spmd.generate", ["--init-from", str(GQA), "--prompt", "hi", "--max-new-tokens",
                                                     "1000000000"],
                                   "--max-new-tokens must be at least 1 and at most 16777216, got 1000000000"),
    "train: --warmup": ("spmd.train", ["--warmup", "2147483648"], "--warmup must be at least 0 and at most 2147483647"),
    "train: --layers": ("spmd.train", ["--layers", "1000000000"], "--layers must be at least 1 and at most 65536"),
    "train: --experts": ("spmd.train", ["--model", "moe-tiny", "--experts", "1000000"],
                         "--experts must be at least 1 and at most 65536"),
    "train: --mtp-depth on a model without it": ("spmd.train", ["--mtp-depth", "1"],
                                                 "--mtp-depth: multi-token prediction is DeepSeek-V3's; tiny has none"),
    "train: --mtp-weight-later": ("spmd.train", ["--model", "deepseek-v3-tiny", "--mtp-depth", "1",
                                                 "--mtp-weight-later", "0.1@5000"],
                                  "--mtp-weight-later must be STEP:WEIGHT (e.g. 5000:0.1), got '0.1@5000'"),
    "train: --join-timeout": ("spmd.train", ["--join-timeout", "1000000000000"],
                              "--join-timeout must be at least 1 and at most 604800"),
    "train: a float sliding window": (
        "spmd.train", ["--init-from", "{float_window}", "--steps", "1"],
        "config.json sliding_window: must be a positive integer or null (got 1000000000000000.0)"),
    # Resumes whose options shape other parameters than the checkpoint's.
    "resume without the empty layers": (
        "spmd.train", ["--resume", "{empty_run}", "--model", "tiny", "--layers", "4", "--mesh", "pp=2", *RESUME],
        "was trained with --empty-layers 2; this run has --empty-layers 0, whose stacked layers differ: give "
        "--empty-layers 2"),
    "resume with other lora targets": (
        "spmd.train", ["--resume", "{lora_run}", "--model", "tiny", "--lora-rank", "4", "--mesh", "dp=1", *RESUME],
        "was trained with --lora-targets q_proj,v_proj; this run has --lora-targets q_proj,k_proj,v_proj,o_proj, "
        "whose adapters are on other projections: give --lora-targets q_proj,v_proj"),
    "resume a lora run without lora": (
        "spmd.train", ["--resume", "{lora_run}", "--model", "tiny", "--mesh", "dp=1", *RESUME],
        "give --lora-rank 4 --lora-targets q_proj,v_proj"),
    # Empty layers even out pipeline stages only, as few as that takes.
    "empty layers without --mesh": ("spmd.train", ["--empty-layers", "1", "--steps", "1"],
                                    "--empty-layers 1 evens out pipeline stages, and the mesh has none (pp=1)"),
    "empty layers without pp": ("spmd.train", ["--mesh", "fsdp=2", "--empty-layers", "2", "--steps", "1"],
                                "--empty-layers 2 evens out pipeline stages, and the mesh has none (pp=1)"),
    "plan: empty layers without pp": ("spmd.plan", ["--empty-layers", "1"],
                                      "--empty-layers 1 evens out pipeline stages, and the mesh has none"),
    "empty layers beyond the fewest": (
        "spmd.train", ["--mesh", "pp=2", "--layers", "3", "--empty-layers", "2"],
        "3 layers and 2 empty ones do not divide into pp x repeats = 2 x 1 pipeline chunks: give --empty-layers 1 "),
    "empty layers where none are needed": (
        "spmd.train", ["--mesh", "pp=2", "--layers", "4", "--empty-layers", "1"],
        "the 4 layers divide without --empty-layers; give none"),
}


def _checkpoint(run: Path, cfg: TrainConfig) -> None:
    """`run` holding step 1's record of a run of `cfg` (spmd.formats.checkpoint.make_meta:
    the shapes of what it trains), without its arrays."""
    skeleton = skeleton_for(cfg.step)
    (run / "1" / "meta").mkdir(parents=True)
    (run / "1" / "meta" / "metadata").write_text(
        json.dumps(make_meta(cfg.record(), cfg.model.name, 1, skeleton.trained(skeleton.shapes))))


def _mistral(directory: Path, window) -> str:
    """tests/hf/mistral with `sliding_window: window` (its text written as given), and
    llama-gqa's tokenizer (the same 128 ids)."""
    shutil.copytree(TESTS / "hf" / "mistral", directory)
    shutil.copy(GQA / "tokenizer.json", directory)
    config = json.loads((directory / "config.json").read_text())
    text = json.dumps(config | {"sliding_window": "WINDOW"}).replace('"WINDOW"', window)
    (directory / "config.json").write_text(text)
    return str(directory)


def _files(tmp: Path) -> dict[str, str]:
    preset = (TESTS.parent / "mesh_configs" / "llama3-8b-8xh100.yaml").read_text()
    (tmp / "huge_seq.yaml").write_text(re.sub(r"(?m)^seq: [0-9]+$", "seq: 1000000000000", preset))
    _checkpoint(tmp / "empty_run", validate(TrainConfig.of(model="tiny", layers=4, empty_layers=2, mesh="pp=2", batch=8,
                                                        seq=16, steps=2)))
    _checkpoint(tmp / "lora_run", validate(TrainConfig.of(model="tiny", lora_rank=4, lora_targets="q_proj,v_proj",
                                                       mesh="dp=1", batch=8, seq=16, steps=2)))
    return {"huge_seq": str(tmp / "huge_seq.yaml"), "empty_run": str(tmp / "empty_run"),
            "lora_run": str(tmp / "lora_run"), "float_window": _mistral(tmp / "float_window", "1e15"),
            "huge_window": _mistral(tmp / "huge_window", "1000000000000000"),
            "no_window": _mistral(tmp / "no_window", "null")}


def _env(devices: int | None) -> dict[str, str]:
    """This process's environment with XLA forced to `devices` CPU devices (None: a bare
    host, which forces none)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases of each device count (None: a bare host), by name: one driver per count,
    all of them at once. -> {count: {name: (result, its working directory)}}"""
    tmp = tmp_path_factory.mktemp("defaults")
    files = _files(tmp)
    cases: dict = {n: {f"{name} on {n}": (module, argv) for name, (module, argv, _) in DEFAULT_RUNS.items()}
                   for n in COUNTS}
    cases[1] |= {f"{name} of a window of {w}": (module, [*argv, files[f"{w}_window"]])
                 for name, (module, argv) in WINDOW_RUNS.items() for w in ("huge", "no")}
    cases[None] = {"train by default": ("spmd.train", ["--steps", "1"]),
                   "eval by default": DEFAULT_RUNS["eval"][:2],
                   **{name: (module, [a.format(**files) for a in argv]) for name, (module, argv, _) in REFUSED.items()}}
    drivers = {}
    for n, named in cases.items():
        batch = []
        for name, (module, argv) in named.items():
            cwd = tmp / "work" / str(n) / name.replace(" ", "_")
            cwd.mkdir(parents=True)
            batch.append({"module": module, "argv": argv, "cwd": str(cwd)})
        proc = subprocess.Popen([sys.executable, str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(n))
        drivers[n] = proc, batch
    results = {}
    for n, (proc, batch) in drivers.items():
        out, err = proc.communicate(json.dumps(batch), timeout=900)
        assert proc.returncode == 0, err[-3000:]
        results[n] = {name: (r, Path(c["cwd"])) for name, r, c in zip(cases[n], json.loads(out), batch)}
    return results


def _ok(result: dict) -> list[str]:
    assert result["code"] == 0, result["stderr"][-3000:]
    return result["stdout"].splitlines()


@pytest.mark.parametrize("devices", COUNTS)
@pytest.mark.parametrize("command", DEFAULT_RUNS)
def test_without_mesh_every_command_lays_out_the_devices_found_and_says_so_first(runs, command, devices):
    lines = _ok(runs[devices][f"{command} on {devices}"][0])
    layout = DEFAULT_RUNS[command][2][devices]
    assert lines[0].startswith(f"layout without --mesh: {layout} on "), lines[0]
    assert ("the one device" if devices == 1 else f"the {devices} devices found") in lines[0]
    if command == "train":
        assert lines[1].startswith(f"mesh: {layout} over {devices} x cpu")


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_the_default_layouts_give_the_same_numbers(runs, command):
    """The loss (printed to 4 decimals) and the greedy completion of each device count."""
    def numbers(devices):
        lines = _ok(runs[devices][f"{command} on {devices}"][0])
        return float(re.search(r"loss ([0-9.]+)", lines[-1])[1]) if command == "eval" else lines[1:3]
    one = numbers(1)
    for devices in COUNTS[1:]:
        assert numbers(devices) == (pytest.approx(one, abs=2e-4) if command == "eval" else one), devices


def test_train_on_a_bare_cpu_host_still_emulates_its_3d_mesh(runs):
    """The default run's layout and first loss, as before (test_default_run trains it out);
    a served model takes the one CPU device a bare host has."""
    lines = _ok(runs[None]["train by default"][0])
    assert lines[0] == ("layout without --mesh: dp=2,fsdp=2,tp=2 on the 8 devices found: spmd's default on 8: "
                        "replicas, fully sharded data parallel and tensor parallel")
    assert lines[1].startswith("mesh: dp=2,fsdp=2,tp=2 over 8 x cpu")
    assert any(line.startswith("[1/1 100%] loss 6.0486 ") for line in lines), lines
    assert _ok(runs[None]["eval by default"][0])[0].startswith("layout without --mesh: single device on the one device")


@pytest.mark.parametrize("command", WINDOW_RUNS)
def test_a_window_wider_than_any_sequence_changes_nothing(runs, command):
    """config.json's sliding_window 10**15 (JAX overflowed on it at the first step) trains
    and generates as no window does: the step's loss, the completion."""
    def output(window):
        lines = _ok(runs[1][f"{command} of a window of {window}"][0])
        return re.search(r"\[1/1 100%\] loss (\S+)", "\n".join(lines))[1] if command == "train" else lines[1:3]
    assert output("huge") == output("no")


def test_a_huge_window_is_clamped_to_what_positions_can_reach(tmp_path):
    assert Directory(_mistral(tmp_path / "m", "1000000000000000")).cfg.window == WIDEST_WINDOW == 2**31 - 1
    assert Directory(_mistral(tmp_path / "n", "4096")).cfg.window == 4096


@pytest.mark.parametrize("case", REFUSED)
def test_refused_in_one_line_before_anything_is_written(runs, case):
    result, cwd = runs[None][case]
    assert result["code"] == 2 and result["stdout"] == "", result
    assert REFUSED[case][2] in one_error_line(result["stderr"])
    assert not any(cwd.iterdir())


def test_the_forced_device_count_is_read_once_checked_and_a_mesh_takes_what_it_names(tmp_path):
    """XLA_FLAGS' forced count of 0 is refused in one line whatever the mesh (JAX failed on
    it with a traceback); on a host set up with 8 devices, a mesh of one takes one of them
    (it was refused, where fsdp=2 took 2), in training and in serving."""
    zero, eight = (_env(0) | {"XLA_FLAGS": "--xla_force_host_platform_device_count=0"}, _env(8))
    small = ["--steps", "1", "--batch", "2", "--seq", "16"]
    cases = [("spmd.train", small, zero), ("spmd.train", ["--mesh", "dp=1", *small], zero),
             ("spmd.generate", ["--init-from", str(GQA), "--prompt", "hi", "--max-new-tokens", "2"], zero),
             ("spmd.train", ["--mesh", "dp=1", *small], eight),
             ("spmd.generate", ["--init-from", str(GQA), "--prompt", "hi", "--max-new-tokens", "2", "--mesh", "dp=1"],
              eight)]
    batch = []
    for i, (module, argv, env) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        batch.append({"module": module, "argv": argv, "cwd": str(tmp_path / str(i)),
                      "env": {"XLA_FLAGS": env["XLA_FLAGS"]}})
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=600, env=_env(None))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    for result in results[:3]:
        assert result["code"] == 2 and result["stdout"] == "", result
        assert one_error_line(result["stderr"]) == (
            "error: XLA_FLAGS' --xla_force_host_platform_device_count must be at least 1 and at most 4096, got 0")
    train, generate = (_ok(result) for result in results[3:])
    assert train[0].startswith("mesh: single device over 1 x cpu"), train
    assert any(" (Hugging Face) on single device, placed in " in line for line in generate), generate


# The default layouts' choices, in-process (no devices: the run's checks decide). The tiny
# preset: 8 heads, 4 kv heads, embed 64.
@pytest.mark.parametrize(("devices", "serving", "batch", "want"), [
    (8, True, 32, "tp=8"),  # tp over all
    (16, True, 32, "fsdp=2,tp=8"),  # tp as wide as the heads allow, the rest fsdp
    (12, True, 32, "dp=3,tp=4"),  # ... or replicas, where the weights do not split 3 ways
    (3, True, 32, "dp=3"),  # nothing splits 3 ways: replicas
    (8, False, 32, "dp=2,fsdp=2,tp=2"),  # training's 3-D default
    (4, False, 32, "fsdp=4"),  # training elsewhere: FSDP
    (6, False, 36, "dp=6"),  # ... or replicas, where the weights do not split 6 ways
    (4, False, 2, "fsdp=2,tp=2"),  # ... with tp, where the batch does not split 4 ways
])
def test_the_default_layout_is_the_first_the_run_holds(devices, serving, batch, want):
    cfg = validate(TrainConfig.of(model="tiny", batch=batch))
    assert format_mesh(default_layout(cfg.step, devices, serving, for_training=not serving)[0]) == want


def test_no_default_layout_names_why_the_replicas_do_not_hold_the_run():
    """16 devices: the batch of 3 splits over none of the batch axes, the 8 heads not 16 ways."""
    cfg = validate(TrainConfig.of(model="tiny", batch=3))
    with pytest.raises(UserError, match=r"without --mesh, no layout of the 16 devices holds the run \(dp=16: --batch 3 "
                                        r"does not divide by the batch axes .*\); give --mesh"):
        default_layout(cfg.step, 16)
