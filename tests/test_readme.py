"""Every `python -m spmd.…` command that README.md and the pages of docs/ show runs as
written, in one order (the README's, then the pages' in PAGES, each page's own order), in one
working directory: what one example makes (runs/a) a later one reads. A command shown on
two pages runs once, where it is first shown.

The files a reader is assumed to have are stand-ins made here: `Llama-3.2-1B` is the
golden Llama of tests/hf (with its tokenizer), `Llama-3.2-1B-Instruct` the tiny chat model
of tests/sft and chat.jsonl its records, the other .jsonl files and `corpus/` are small
text. One thing is changed: step counts (`--steps`, `--save-every`, `--eval-every` and a
step directory in `--resume`) are a hundredth of what is written, and a run that names no
`--steps` takes 3 instead of its default 300, because every step is the same program and
the flags, the layout, the files and the fit are what a command checks before its first
step. Commands that need an accelerator's memory are expected to be refused on this
CPU-only host in one line, by the fit check, which is what a reader here would see.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cases import tiered

pytestmark = pytest.mark.xdist_group("readme")

ROOT = Path(__file__).parent.parent
DRIVER = Path(__file__).with_name("cli_driver.py")
SCALED = ("--steps", "--save-every", "--eval-every")
# Commands (by a fragment of their text) that ask for more memory than this host has, or a
# compiler the test extra does not install (the CUDA plugin's 3.4 GB).
REFUSED_HERE = {
    "--target h100x8": 'pip install -e ".[aot-gpu]"',
    "--config mesh_configs/llama3-8b-8xh100.yaml --steps": "the step needs",
    "--model llama3-8b --mesh fsdp=8 --dtype bfloat16": "the step needs",
    "--model llama3.2-1b --data tokens.npy": "the step needs",
}


# README.md, then every page of docs/, in an order where a page that writes a file comes
# before the pages that read it: checkpoints.md writes runs/a, which generation.md reads;
# data.md writes tokens.npy, which clusters.md reads. (Within a page, its own order:
# huggingface.md trains runs/ft, then exports it.)
PAGES = ("README.md", "docs/training.md", "docs/planner.md", "docs/parallelism.md", "docs/moe.md",
         "docs/pipelines.md", "docs/checkpoints.md", "docs/huggingface.md", "docs/lora.md", "docs/generation.md",
         "docs/data.md", "docs/clusters.md", "docs/fp8.md", "docs/performance.md", "docs/how-it-works.md",
         "docs/architecture.md", "docs/deepseek.md", "docs/contributing.md", "docs/README.md")
# How many commands ran when they were all in README.md: the split into docs/ keeps every one.
COMMANDS_BEFORE_THE_SPLIT = 39


def readme_commands() -> list[str]:
    """The command lines of every page in PAGES that start with `python -m spmd.`, in
    PAGES order, each once (continuation lines joined, trailing comments and [optional]
    parts dropped)."""
    commands = [command for page in PAGES for command in page_commands(ROOT / page)]
    return list(dict.fromkeys(commands))


def page_commands(path: Path) -> list[str]:
    commands, current = [], None
    for line in path.read_text().splitlines():
        text = line.strip()
        if current is not None:
            current += " " + text.rstrip("\\").strip()
        elif text.startswith("python -m spmd."):
            current = text.rstrip("\\").strip()
        else:
            continue
        if not text.endswith("\\"):
            current = re.sub(r"\s+#.*$", "", current)
            commands.append(re.sub(r"\s*\[[^]]*\]", "", current).strip())
            current = None
    return commands


def scaled(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in SCALED:
            out[i + 1] = str(max(1, int(out[i + 1]) // 100))
        elif arg == "--resume" and re.search(r"/[0-9]+$", out[i + 1]):
            head, step = out[i + 1].rsplit("/", 1)
            out[i + 1] = f"{head}/{int(step) // 100}"
    if out[2] == "spmd.train" and "--steps" not in out:
        out += ["--steps", "3"]
    return out


def stand_ins(work: Path) -> None:
    shutil.copytree(ROOT / "tests" / "hf" / "llama-gqa", work / "Llama-3.2-1B")
    shutil.copy(ROOT / "tests" / "hf" / "llama-gqa" / "tokenizer.json", work / "tokenizer.json")
    (work / "mesh_configs").symlink_to(ROOT / "mesh_configs")
    text = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
    for name in ("notes.jsonl", "held_out.jsonl"):
        (work / name).write_text("".join(json.dumps({"text": text * 8}) + "\n" for _ in range(40)))
    (work / "prompts.jsonl").write_text(json.dumps({"prompt": "the quick brown"}) + "\n"
                                        + json.dumps({"prompt": "a stitch"}) + "\n")
    shutil.copytree(ROOT / "tests" / "sft" / "model", work / "Llama-3.2-1B-Instruct")  # with a chat template
    shutil.copy(ROOT / "tests" / "sft" / "chat.jsonl", work / "chat.jsonl")
    (work / "corpus").mkdir()
    for i in range(3):
        (work / "corpus" / f"{i}.txt").write_text(text * 50)


# Commands that read what an earlier one made: kept in one driver, in the README's order.
CHAINED = re.compile(r"runs/|tokens\.npy|packed\.npy|exported|Llama-3\.2-1B-ft")
COMMANDS = readme_commands()


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """The commands of this session's tests (those of the tier run), with every chained
    command before a chosen one, run in order by one driver (one fork per command): the
    other worker of the run keeps the machine's other core busy."""
    work = tmp_path_factory.mktemp("readme")
    stand_ins(work)
    chosen = {item.callspec.params["command"] for item in request.session.items
              if item.module is request.module and item.originalname == "test_readme_command_runs_as_written"}
    last_chained = max((i for i, c in enumerate(COMMANDS) if c in chosen and CHAINED.search(c)), default=-1)
    commands = [c for i, c in enumerate(COMMANDS) if c in chosen or (i < last_chained and CHAINED.search(c))]
    cases = tmp_path_factory.mktemp("driver") / "cases.json"
    cases.write_text(json.dumps([_case(command, work) for command in commands]))
    with open(cases) as given:
        done = subprocess.run([sys.executable, str(DRIVER)], stdin=given, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(commands, json.loads(done.stdout)))


def _case(command: str, work: Path) -> dict:
    argv = scaled(shlex.split(command))
    if argv[2] == "spmd.launch":  # the launched command is a train run: its steps too
        split = argv.index("--")
        argv = argv[:split + 1] + scaled(argv[split + 1:])
    return {"module": argv[2], "argv": argv[3:], "cwd": str(work)}


def test_the_pages_are_all_run():
    pages = {"README.md"} | {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert set(PAGES) == pages, "a page of docs/ is missing from PAGES (or PAGES names one that is gone)"


def test_the_readme_shows_every_command():
    commands = readme_commands()
    modules = {shlex.split(c)[2] for c in commands}
    assert modules >= {"spmd.train", "spmd.plan", "spmd.export", "spmd.generate", "spmd.eval", "spmd.corpus",
                       "spmd.launch"}, modules
    print(f"{len(commands)} commands from {len(PAGES)} pages")
    assert len(commands) >= COMMANDS_BEFORE_THE_SPLIT, len(commands)


# The gate runs the commands that make and read files (CHAINED: checkpoints, exports, adapters,
# tokens) and the one the fit check refuses here; those that train or plan a layout the gate's
# tests hold are slow.
IN_THE_GATE = ("runs/", "tokens.npy", "packed.npy", "exported", "Llama-3.2-1B-ft", "llama3-8b-8xh100.yaml --steps")


@pytest.mark.parametrize("command", tiered(COMMANDS, lambda c: c.removeprefix("python -m "), gate=[
    c.removeprefix("python -m ") for c in COMMANDS if any(text in c for text in IN_THE_GATE)]))
def test_readme_command_runs_as_written(results, command):
    result = results[command]
    refusal = next((why for fragment, why in REFUSED_HERE.items() if fragment in command), None)
    if refusal:
        assert result["code"] == 2 and result["stderr"].strip().startswith("error: ") and refusal in result["stderr"], \
            result["stderr"][-600:]
    else:
        assert result["code"] == 0, f"exit {result['code']}: {result['stderr'].strip()[-600:]}"
