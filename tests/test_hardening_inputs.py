"""Issue #52: every input of every command is protected from its outputs (an adapter, a
tokenizer and the files read beside it, a config file, a checkpoint's run and the directory
it started from): an output onto or inside one is refused in one `error:` line, exit 2,
the input unchanged. Also: spmd.launch keeps its `--grace` whichever process fails, the
process count and index of the environment are checked against their bounds, and a YAML
`--config` that gives a key twice is refused.

The command cases run in one driver process, one fork each (tests/cli_driver.py), and are
all refused before anything compiles. A checkpoint here is a run directory holding one
step's record (`meta`) and no arrays: all that the commands read before they claim their
outputs.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import one_error_line, run_cases, snapshot

from spmd.base.errors import UserError
from spmd.config import TrainConfig, validate
from spmd.formats.checkpoint import FORMAT
from spmd.run.distributed import processes

pytestmark = pytest.mark.xdist_group("hardening_inputs")

TESTS = Path(__file__).parent

# name -> (module, argv, fragment of the one error line). {names} are the fixture's inputs.
CASES = {
    # The two commands: an adapter is an input like any other.
    "generate: --output over the adapter's config": (
        "spmd.generate", ["--init-from", "{base}", "--adapter", "{adapter}", "--prompt", "abc", "--max-new-tokens",
                          "2", "--output", "{adapter}/adapter_config.json"], "would write over the input --adapter"),
    "generate: --output new in the adapter": (
        "spmd.generate", ["--init-from", "{base}", "--adapter", "{adapter}", "--prompt", "abc", "--output",
                          "{adapter}/completions.jsonl"], "would write over the input --adapter"),
    "train: --metrics-file over the adapter's config": (
        "spmd.train", ["--init-from", "{base}", "--adapter", "{adapter}", "--steps", "1", "--metrics-file",
                       "{adapter}/adapter_config.json"], "would write over the input --adapter"),
    "train: --tensorboard in the adapter": (
        "spmd.train", ["--init-from", "{base}", "--adapter", "{adapter}", "--steps", "1", "--tensorboard",
                       "{adapter}/tb"], "would write over the input --adapter"),
    "train: --profile-dir in --init-from": (
        "spmd.train", ["--init-from", "{base}", "--steps", "1", "--profile-steps", "1:1", "--profile-dir",
                       "{base}/trace"], "would write over the input --init-from"),
    # A tokenizer.json brings its directory's config and chat template.
    "train: --metrics-file over the chat template beside --tokenizer": (
        "spmd.train", ["--data", "{text}", "--tokenizer", "{tokenizer}/tokenizer.json", "--metrics-file",
                       "{tokenizer}/chat_template.jinja"], "would write over the chat_template.jinja beside --tokenizer"),
    "train: --metrics-file over the tokenizer config beside --tokenizer": (
        "spmd.train", ["--data", "{text}", "--tokenizer", "{tokenizer}/tokenizer.json", "--metrics-file",
                       "{tokenizer}/tokenizer_config.json"],
        "would write over the tokenizer_config.json beside --tokenizer"),
    "train: --metrics-file over --init-from's tokenizer": (
        "spmd.train", ["--init-from", "{base}", "--data", "{text}", "--metrics-file", "{base}/tokenizer.json"],
        "would write over the input --init-from"),
    "corpus: --out over the chat template beside --tokenizer": (
        "spmd.corpus", ["--data", "{text}", "--tokenizer", "{tokenizer}/tokenizer.json", "--out",
                        "{tokenizer}/chat_template.jinja"], "would write over the chat_template.jinja beside --tokenizer"),
    "corpus: --out in a --tokenizer directory": (
        "spmd.corpus", ["--data", "{records}", "--seq", "16", "--tokenizer", "{tokenizer}", "--out",
                        "{tokenizer}/t.npy"], "would write over the input --tokenizer"),
    # Data, pre-packed rows and the config file.
    "train: --out in the data folder": (
        "spmd.train", ["--data", "{text_folder}", "--steps", "1", "--out", "{text_folder}/run"],
        "would write over the input --data"),
    "train: --metrics-file over pre-packed rows": (
        "spmd.train", ["--data", "{packed}", "--steps", "1", "--metrics-file", "{packed}"],
        "would write over the input --data"),
    "train: --metrics-file over the --config file": (
        "spmd.train", ["--config", "{good_yaml}", "--metrics-file", "{good_yaml}"],
        "would write over the input --config"),
    # A checkpoint: its run, the directory it started from (a LoRA run's base, read again)
    # and its tokenizer with the files beside it.
    "train: resuming a LoRA run, --metrics-file in the base it reads again": (
        "spmd.train", ["--resume", "{lora_run}", "--lora-rank", "2", "--metrics-file", "{base}/m.jsonl"],
        "would write over the resumed run's --init-from"),
    "generate: --output over the chat template beside the run's tokenizer": (
        "spmd.generate", ["--checkpoint", "{lora_run}", "--prompt", "abc", "--output",
                          "{tokenizer}/chat_template.jinja"],
        "would write over the chat_template.jinja beside the run's tokenizer"),
    "generate: --output in the run's --init-from": (
        "spmd.generate", ["--checkpoint", "{lora_run}", "--prompt", "abc", "--output", "{base}/c.jsonl"],
        "would write over the run's --init-from"),
    "generate: --output in the checkpoint's run": (
        "spmd.generate", ["--checkpoint", "{lora_run}/1", "--prompt", "abc", "--output", "{lora_run}/c.jsonl"],
        "would write over the input --checkpoint"),
    "export: --out in the run's --init-from": (
        "spmd.export", ["--checkpoint", "{lora_run}", "--format", "peft", "--out", "{base}/adapter"],
        "would write over the run's --init-from"),
    "export: --out in the adapter": (
        "spmd.export", ["--init-from", "{base}", "--adapter", "{adapter}", "--format", "hf", "--out",
                        "{adapter}/merged"], "would write over the input --adapter"),
    # A YAML key given twice: refused, not the last one winning.
    "config: a key twice": (
        "spmd.train", ["--config", "{twice_yaml}"], "twice.yaml: steps is given twice (again on line 3)"),
    "config: a key twice in the mesh's mapping": (
        "spmd.train", ["--config", "{twice_mesh_yaml}"], "twice_mesh.yaml: dp is given twice (again on line 3)"),
    "config: one option in two spellings": (
        "spmd.train", ["--config", "{two_spellings_yaml}"], "grad_accum and grad-accum are one option, given twice"),
    "plan: a key twice": (
        "spmd.plan", ["--config", "{twice_yaml}"], "twice.yaml: steps is given twice"),
}


def _checkpoint(run: Path, cfg: TrainConfig) -> None:
    """`run` holding step 1's record of a run of `cfg` (as spmd.formats.checkpoint.make_meta
    writes it), without its arrays."""
    meta = run / "1" / "meta"
    meta.mkdir(parents=True)
    record = {"format": FORMAT, "step": 1, "model": cfg.model.name, "config": cfg.record()}
    (meta / "metadata").write_text(json.dumps(record))


def _inputs(tmp: Path) -> dict[str, str]:
    """Copies of the test models (an output must never land in the repository's own), the
    data and the config files; a LoRA run's checkpoint started from the base, with the
    tokenizer directory's tokenizer.json."""
    shutil.copytree(TESTS / "hf" / "llama-gqa", tmp / "base")
    shutil.copytree(TESTS / "hf" / "lora-peft", tmp / "adapter")
    shutil.copytree(TESTS / "sft" / "llama", tmp / "tokenizer")
    (tmp / "text.txt").write_text("some text " * 100)
    (tmp / "text").mkdir()
    (tmp / "text" / "a.txt").write_text("a document " * 50)
    shutil.copy(TESTS / "sft" / "prompt_completion.jsonl", tmp / "records.jsonl")
    (tmp / "packed.npy").write_bytes(b"")  # refused as an output before it is read as rows
    (tmp / "good.yaml").write_text("steps: 1\n")
    (tmp / "twice.yaml").write_text("steps: 10\nbatch: 8\nsteps: 1000\n")
    (tmp / "twice_mesh.yaml").write_text("mesh:\n  dp: 1\n  dp: 2\n")
    (tmp / "two_spellings.yaml").write_text("grad_accum: 1\ngrad-accum: 2\n")
    lora = validate(TrainConfig.of(init_from=str(tmp / "base"), lora_rank=2, mesh="dp=1", data=str(tmp / "text.txt"),
                                tokenizer=str(tmp / "tokenizer" / "tokenizer.json")))
    _checkpoint(tmp / "lora_run", lora)
    names = {"base": "base", "adapter": "adapter", "tokenizer": "tokenizer", "text": "text.txt",
             "text_folder": "text", "records": "records.jsonl", "packed": "packed.npy", "good_yaml": "good.yaml",
             "twice_yaml": "twice.yaml", "twice_mesh_yaml": "twice_mesh.yaml",
             "two_spellings_yaml": "two_spellings.yaml", "lora_run": "lora_run"}
    return {key: str(tmp / name) for key, name in names.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case, each in its own empty working directory, run by one driver; the inputs
    must be as they were."""
    inputs = tmp_path_factory.mktemp("inputs")
    files = _inputs(inputs)
    before = snapshot(inputs)
    cases = run_cases(CASES, files, tmp_path_factory.mktemp("work"), timeout=300)
    return cases, before, snapshot(inputs)


def test_refused_outputs_leave_every_input_as_it_was(results):
    _, before, after = results
    assert after == before


@pytest.mark.parametrize("case", CASES)
def test_an_output_onto_an_input_is_refused_in_one_line(results, case):
    result, cwd = results[0][case]
    assert result["code"] == 2, result
    assert result["stdout"] == ""
    line = one_error_line(result["stderr"])
    assert CASES[case][2] in line, line
    assert not any(cwd.iterdir()), list(cwd.iterdir())


# --- spmd.launch: --grace, whichever process fails


def _launch(tmp_path: Path, nproc: int, grace: float, script: str):
    """spmd.launch of `nproc` copies of the sh `script`; process 1 notes when, and
    `exit 9`s first. Each notes its id, its process group's (the launcher starts each in
    its own). -> (the launch, seconds from the failure to the launch's end, the live
    processes of those groups once it ended: killed here)"""
    failing = f'if [ "$JAX_PROCESS_ID" = 1 ]; then date +%s.%N > {tmp_path}/failed; exit 9; fi; '
    command = [sys.executable, "-m", "spmd.launch", "--nproc", str(nproc), "--grace", str(grace), "--",
               "sh", "-c", f"echo $$ > {tmp_path}/pid.$JAX_PROCESS_ID; {failing}{script}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        seconds = time.time() - float((tmp_path / "failed").read_text())
    finally:
        groups = {int(p.read_text()) for p in tmp_path.glob("pid.*")}
        left = _alive_in(groups)
        for pid in left:  # what the launch left behind (the test fails on it)
            os.kill(pid, signal.SIGKILL)
    return done, seconds, left


def _alive_in(groups: set[int]) -> list[int]:
    """The live processes of these process groups (a zombie is dead: this machine's init
    may never reap an orphan)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:  # ended meanwhile
            continue
        if int(group) in groups and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.mark.parametrize("script", ["sleep 60", 'trap "" TERM; sleep 60'], ids=["stops on SIGTERM", "ignores it"])
def test_a_failure_in_any_process_gives_the_others_grace_then_ends_them(tmp_path, script):
    """Process 1 fails while process 0 (first in the launcher's list) and 2 run on: the
    launch ends within --grace + 2 s of the failure, with its exit code, every process
    and what it started gone (one that ignores SIGTERM is killed)."""
    grace = 1.0
    done, seconds, left = _launch(tmp_path, 3, grace, script)
    assert done.returncode == 9, done.stderr
    assert one_error_line(done.stderr) == "error: process 1 of 3 failed (exit code 9)"
    assert grace <= seconds < grace + 2, seconds
    assert left == []
    assert len(list(tmp_path.glob("pid.*"))) == 3


# --- the process environment's bounds


@pytest.mark.parametrize("environ, message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES=0: the number of processes must be 1 to 65,536"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     r"JAX_PROCESS_ID=2 is not one of 2 processes \(JAX_NUM_PROCESSES=2\): it must be 0 to 1"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "-1"},
     r"JAX_PROCESS_ID=-1 is not one of 2 processes"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "4"},
     r"SLURM_PROCID=4 is not one of 4 processes \(SLURM_NTASKS=4\): it must be 0 to 3"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "-1"}, r"SLURM_PROCID=-1 is not one of 4 processes"),
], ids=["no processes", "id = count", "negative id", "SLURM id = tasks", "negative SLURM id"])
def test_a_process_environment_out_of_bounds_is_refused_naming_the_variable(environ, message):
    with pytest.raises(UserError, match=message):
        processes(TrainConfig.of(), environ)


def test_the_flags_bounds_name_the_flags():
    with pytest.raises(UserError, match=r"--process-id 2 is not one of 2 processes \(--num-processes 2\)"):
        processes(TrainConfig.of(coordinator="h:1", num_processes=2, process_id=2), {})
    assert processes(TrainConfig.of(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
                                         "SLURM_STEP_NODELIST": "n[1-4]"}).index == 3


def test_the_command_says_so_in_one_line_before_joining(tmp_path):
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"}
    done = subprocess.run([sys.executable, "-m", "spmd.train", "--steps", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == "error: JAX_NUM_PROCESSES=0: the number of processes must be 1 to 65,536"
    assert not any(tmp_path.iterdir())
