"""Every option of every command (train, plan, export, corpus, launch, generate, eval), given a
bad value: one `error:` line naming the option, exit code 2, no traceback, and nothing
written (the working directory and the inputs are the same after as before).

The table is made from the commands' own parsers, so an option added later is covered
without a new line here: for each, a value out of its range, of the wrong type, not
finite, and empty. Hand-written cases add the values that only make sense for one option
(a mesh in other digits, an output over an input, a config file's wrong types).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.commands import snapshot

from spmd.base.cli import finite, integer, nonempty
from spmd.base.schema import Bounds
from spmd.config import train_parser
from spmd.corpus import corpus_parser
from spmd.eval import BOUNDS as EVAL_BOUNDS
from spmd.eval import eval_parser
from spmd.export import byte_size, export_parser
from spmd.generate import BOUNDS as GENERATE_BOUNDS
from spmd.generate import generate_parser
from spmd.launch import MAX_PROCESSES, launch_parser
from spmd.plan import plan_flags
from spmd.run.config import cli_options

pytestmark = pytest.mark.xdist_group("cli")

DRIVER = Path(__file__).with_name("cli_driver.py")
BOUNDS = {option: f.metadata["bounds"] for option, f in cli_options()} | {
    # The other commands' own numbers.
    "devices": Bounds(at_least=1), "step": Bounds(at_least=0), "nproc": Bounds(at_least=1, at_most=MAX_PROCESSES),
    "port": Bounds(at_least=1, at_most=65535), "grace": Bounds(at_least=0)} | GENERATE_BOUNDS | EVAL_BOUNDS


def _out_of_range(dest: str, kind) -> list[str]:
    """Values just outside the option's bounds."""
    b = BOUNDS.get(dest)
    if b is None:
        return []
    step = 1 if kind is integer else 0.5
    values = [b.at_least - step if b.at_least is not None else b.above,
              b.at_most + step if b.at_most is not None else b.below]
    return [str(int(v) if kind is integer else v) for v in values if v is not None]


def generated(parser: argparse.ArgumentParser, required: list[str] = (), tail: list[str] = ()
              ) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a fragment the error line must hold), for each option of `parser`;
    `required` are good values of the command's required options (replaced when one of
    them is the option tried), `tail` what must end the command line."""
    def argv(flag, *value):
        given = dict(zip(required[::2], required[1::2]))
        given.pop(flag, None)
        return [*(x for pair in given.items() for x in pair), flag, *value, *tail]

    cases = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch: it takes no value
            cases[f"{flag}=yes"] = (argv(f"{flag}=yes"), flag)
            cases[f"{flag}= (empty)"] = (argv(f"{flag}="), flag)
            continue
        values = {"empty": ""}
        if action.choices:
            values["not a choice"] = "nope"
        elif action.type is integer:
            values |= {"wrong type": "1.5", "not finite": "inf", "other digits": "\u0663",
                       "beyond 64 bits": str(2**63), "5,000 digits": NINES}
        elif action.type is finite:
            values |= {"wrong type": "abc", "not finite": "nan", "infinite": "-inf", "beyond float32": "-1e39"}
        elif action.type is byte_size:
            values |= {"wrong type": "5 parsecs", "zero": "0GB", "negative": "-5GB"}
        else:
            assert action.type in (nonempty, str), f"{flag}: every option's type is checked"  # str: a prompt
        for i, v in enumerate(_out_of_range(action.dest, action.type)):
            values[f"out of range {i}"] = v
        for what, value in values.items():
            cases[f"{flag} {what}"] = (argv(flag, value), flag)
    return cases


NINES = "9" * 5000  # more digits than Python's int() reads (4,300)

# Values that are wrong for one option only. {files} are made by the fixture.
TRAIN = {
    "mesh of 5,000 digits": (["--mesh", f"dp={NINES}"], "mesh axis dp must be at least -1 and at most 1048576, got '999"),
    "dcn of 5,000 digits": (["--dcn", f"dp={NINES}"], "mesh axis dp must be at least -1 and at most 1048576"),
    "profile steps of 5,000 digits": (["--profile-steps", f"1:{NINES}"],
                                      "--profile-steps B must be at least 0 and at most 2147483647"),
    "mtp switch beyond int32": (["--model", "deepseek-v3-tiny", "--mtp-depth", "1", "--mtp-weight-later",
                                 "2147483648:0.1"], "--mtp-weight-later's STEP must be at least 0 and at most 2147483647"),
    "mtp switch of 5,000 digits": (["--model", "deepseek-v3-tiny", "--mtp-depth", "1", "--mtp-weight-later",
                                    f"{NINES}:0.1"], "--mtp-weight-later's STEP must be at least 0 and at most"),
    "mtp switch to a weight of 1e300": (["--model", "deepseek-v3-tiny", "--mtp-depth", "1", "--mtp-weight-later",
                                         "1:1e300"], "--mtp-weight-later's WEIGHT must be at least 0 and at most 1000"),
    "mtp weight without mtp": (["--mtp-weight", "0.1"], "--mtp-weight applies to multi-token prediction"),
    "mtp switch without mtp": (["--mtp-weight-later", "5:0.1"], "--mtp-weight-later applies to multi-token prediction"),
    "record bound of 2**63 - 1": (["--max-record-bytes", str(2**63 - 1)],
                                  "--max-record-bytes must be at least 1 and at most 1099511627776"),
    "record bound for text": (["--data", "{corpus}", "--max-record-bytes", "100"],
                              "--max-record-bytes applies to fine-tuning records; --data"),
    "steps of 10**26": (["--steps", "1" + "0" * 26], "must be a 64-bit integer"),
    "target of 5,000 digits": (["--target", f"v5p-{NINES}"], "v5p slices come in powers of two"),
    "empty layers beyond the stages' need": (["--layers", "3", "--empty-layers", "3", "--mesh", "pp=2", "--batch", "4",
                                              "--seq", "16", "--steps", "1"],
                                             "--empty-layers 3 is more than the pp=2 stages need to even out; give "
                                             "--empty-layers 1"),
    "config nested 1,000 deep": (["--config", "{deep_yaml}"], "collections nested more than 16 deep (line 2)"),
    "config of 2 GiB": (["--config", "{huge_yaml}"], "is 2,147,483,648 bytes; an options file holds a few kilobytes"),
    "config: a section that is null": (["--config", "{null_section}"], "training is a section, a mapping of its "
                                                                      "options (steps, batch"),
    "config: a section that is a list": (["--config", "{list_section}"], "optimizer is a section, a mapping of its "
                                                                        "options"),
    "mesh in other digits": (["--mesh", "dp=\u0663"], "must be an integer"),
    "mesh size with underscores": (["--mesh", "dp=1_0"], "must be an integer"),
    "mesh far larger than the batch": (["--mesh", "dp=1000000"], "does not divide by the batch axes"),
    "more devices than can be emulated": (["--mesh", "dp=8192", "--batch", "8192"], "at most 4096"),
    "dcn that does not divide": (["--dcn", "dp=4"], "--dcn dp=4 does not divide"),
    "out is a file": (["--out", "{file}"], "is a file"),
    "out under a file": (["--out", "{file}/run"], "cannot be created"),
    "metrics file is a directory": (["--metrics-file", "{folder}"], "is a directory"),
    "metrics file in a missing directory": (["--metrics-file", "no/such/m.jsonl"], "does not exist"),
    "metrics file over the data": (["--data", "{corpus}", "--metrics-file", "{corpus}"], "would write over the input --data"),
    "out inside the data folder": (["--data", "{folder}", "--out", "{folder}/run"], "would write over the input --data"),
    "metrics file over the config": (["--config", "{good_yaml}", "--metrics-file", "{good_yaml}"],
                                     "would write over the input --config"),
    "resume from nowhere": (["--resume", "no/such/run"], "does not exist"),
    "unknown model": (["--model", "gpt-17"], "unknown model"),
    "unknown hardware": (["--hardware", "tpu-v9"], "unknown hardware"),
    "tokenizer without data": (["--tokenizer", "{file}"], "--tokenizer applies to --data"),
    "coordinator port 0": (["--coordinator", "h:0", "--num-processes", "2", "--process-id", "0"], "a port from 1"),
    "coordinator port too high": (["--coordinator", "h:70000", "--num-processes", "2", "--process-id", "0"],
                                  "a port from 1"),
    "process id out of range": (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
                                "not one of 2 processes"),
    "second config": (["--config", "{good_yaml}", "--config", "{good_yaml}"], "--config is given twice"),
    "empty config after =": (["--config="], "--config needs a file name"),
    "config is a directory": (["--config", "{folder}"], "is a directory"),
    "config is binary": (["--config", "{binary}"], "is not UTF-8"),
    "config: boolean as text": (["--config", "{bool_as_text}"], "scale_lr must be true or false"),
    "config: null where a value is needed": (["--config", "{null_steps}"], "steps must be given a value"),
    "config: list for a number": (["--config", "{list_steps}"], "steps must be a single value"),
    "config: NaN learning rate": (["--config", "{nan_lr}"], "is not a finite number"),
    "config: number for a switch": (["--config", "{number_switch}"], "megatron_sp must be true or false"),
    "config: mesh size true": (["--config", "{bool_mesh}"], "a mapping of axis: size"),
    "beta outside [0, 1)": (["--b2", "1"], "--b2 must be at least 0 and below 1"),
    "unknown attention kernel": (["--attention-kernel", "flash3"], "argument --attention-kernel: invalid choice: 'flash3'"),
    "profile steps backwards": (["--profile-steps", "5:3"], "--profile-steps 5:3: the first step must be at least 1"),
    "profile steps from 0": (["--profile-steps", "0:3"], "--profile-steps 0:3: the first step must be at least 1"),
    "profile steps beyond the run": (["--steps", "4", "--profile-steps", "3:5"],
                                     "--profile-steps 3:5 goes beyond --steps 4"),
    "profile steps not a range": (["--profile-steps", "3"], "--profile-steps must be A:B"),
    "profile dir under a file": (["--profile-steps", "1:2", "--profile-dir", "{file}/trace"],
                                 "file.txt/trace cannot be created: "),
    "profile dir inside out": (["--out", "run", "--profile-steps", "1:2", "--profile-dir", "run/trace"],
                               "--profile-dir run/trace would write into --out run"),
    "tensorboard is a file": (["--tensorboard", "{file}"], "file.txt is a file, not a directory"),
    "tensorboard under a file": (["--tensorboard", "{file}/tb"], "file.txt/tb cannot be created: "),
    "tensorboard inside the data folder": (["--data", "{folder}", "--tensorboard", "{folder}/tb"],
                                           "would write over the input --data"),
    "tensorboard inside out": (["--out", "run", "--tensorboard", "run"],
                               "--tensorboard run would write into --out run"),
    # Outputs that coincide: refused before compiling (the working directory stays empty).
    "tensorboard is the metrics file": (["--tensorboard", "m.jsonl", "--metrics-file", "m.jsonl"],
                                        "--tensorboard m.jsonl and --metrics-file m.jsonl are the same path"),
    "profile dir is the metrics file": (["--profile-steps", "1:1", "--profile-dir", "m", "--metrics-file", "m"],
                                        "--profile-dir m and --metrics-file m are the same path"),
    "tensorboard inside the metrics file": (["--metrics-file", "m", "--tensorboard", "m/tb"],
                                            "--tensorboard m/tb would write into --metrics-file m, a file"),
    "metrics file is out": (["--out", "run", "--metrics-file", "run"],
                            "--metrics-file run would write into --out run, which holds only checkpoints"),
    "metrics file deep in out": (["--out", "run", "--metrics-file", "run/logs/m.jsonl"],
                                 "would write into --out run, which holds only checkpoints"),
    "metrics file is the lock": (["--out", "{folder}", "--metrics-file", "{folder}/.spmd-lock"],
                                 "is the lock file of --out"),
    "lock file is a directory": (["--out", "{locked}"], "holds a directory named .spmd-lock"),
    "lock file is a link": (["--out", "{linked_lock}"], "holds a symbolic link named .spmd-lock"),
    "metrics file under a file": (["--metrics-file", "{file}/m.jsonl"], "file.txt is a file, not a directory"),
    "metrics file links to the data": (["--data", "{corpus}", "--metrics-file", "{data_link}"],
                                       "would write over the input --data"),
    "metrics file is a hard link of the data": (["--data", "{corpus}", "--metrics-file", "{data_hard_link}"],
                                                "would write over the input --data"),
}
PLAN = {
    "devices 0": (["--devices", "0"], "--devices must be positive"),
    "devices beyond emulation": (["--mesh", "dp=-1", "--devices", "100000"], "at most 4096"),
    "auto beyond emulation": (["--auto", "--devices", "100000", "--hardware", "h100"], "at most 4096"),
    "config is binary": (["--config", "{binary}"], "is not UTF-8"),
    "config nested 1,000 deep": (["--config", "{deep_yaml}"], "collections nested more than 16 deep"),
    "target of 5,000 digits": (["--model", "tiny", "--mesh", "fsdp=2,tp=2", "--target", f"v5p-{NINES}"],
                               "v5p slices come in powers of two"),
    "target by a topology of no chips": (["--target", "v5p:0x0x0"], "--target v5p:0x0x0: a side must be at least 1"),
    "target by a 2D topology of no chips": (["--target", "v5e:0x4"], "--target v5e:0x4: a side must be at least 1"),
    "target by a topology beyond any slice": (["--target", "v5p:100000x100000x100000"], "a side must be at least 1 "
                                                                                       "and at most 8960"),
    "target of 10**30 nodes": (["--target", "1" + "0" * 30 + "xh100x8"], "the nodes must be at least 1 and at most 256"),
}


def _files(tmp: Path) -> dict[str, str]:
    files = {
        "file": ("file.txt", "some text\n"), "corpus": ("corpus.txt", "some text " * 100),
        "good_yaml": ("good.yaml", "steps: 3\n"), "bool_as_text": ("t.yaml", 'scale_lr: "false"\n'),
        "null_steps": ("n.yaml", "steps: null\n"), "list_steps": ("l.yaml", "steps: [1, 2]\n"),
        "nan_lr": ("nan.yaml", "lr: .nan\n"), "number_switch": ("s.yaml", "megatron_sp: 1\n"),
        "bool_mesh": ("m.yaml", "mesh: {dp: true}\n"),
        "deep_yaml": ("deep.yaml", "steps: 2\nx: " + "[" * 1000 + "]" * 1000 + "\n"),
        "null_section": ("ns.yaml", "training: null\n"), "list_section": ("ls.yaml", "optimizer: [1, 2]\n"),
    }
    for name, text in files.values():
        (tmp / name).write_text(text)
    (tmp / "binary.yaml").write_bytes(bytes(range(256)))
    with open(tmp / "huge.yaml", "wb") as f:  # sparse: no disk used
        f.truncate(2 << 30)
    (tmp / "folder").mkdir()
    (tmp / "locked" / ".spmd-lock").mkdir(parents=True)  # where a run records its holder
    (tmp / "linked").mkdir()
    (tmp / "linked" / ".spmd-lock").symlink_to(tmp / "file.txt")
    (tmp / "data_link").symlink_to(tmp / "corpus.txt")
    os.link(tmp / "corpus.txt", tmp / "data_hard_link")
    return {f"{{{key}}}": str(tmp / name) for key, (name, _) in files.items()} | {
        "{binary}": str(tmp / "binary.yaml"), "{huge_yaml}": str(tmp / "huge.yaml"), "{folder}": str(tmp / "folder"),
        "{locked}": str(tmp / "locked"),
        "{linked_lock}": str(tmp / "linked"),
        "{data_link}": str(tmp / "data_link"), "{data_hard_link}": str(tmp / "data_hard_link")}


def _plan_parser() -> argparse.ArgumentParser:
    parser = train_parser()
    plan_flags(parser)
    return parser


# The other commands' required options, with good values (the cases replace one at a time).
COMMANDS = {
    "spmd.train": (train_parser(), TRAIN, [], []),
    "spmd.plan": (_plan_parser(), PLAN, [], []),
    "spmd.export": (export_parser(), {}, ["--checkpoint", "{folder}", "--out", "exported"], []),
    "spmd.corpus": (corpus_parser(), {}, ["--data", "{corpus}", "--out", "tokens.npy"], []),
    "spmd.launch": (launch_parser(), {}, ["--nproc", "2"], ["--", "true"]),
    "spmd.generate": (generate_parser(), {"temperature below the least": (
        ["--checkpoint", "{folder}", "--prompt", "hi", "--temperature", "1e-45"],
        "--temperature must be 0 (greedy) or at least 1e-06")}, ["--checkpoint", "{folder}", "--prompt", "hi"], []),
    "spmd.eval": (eval_parser(), {}, ["--checkpoint", "{folder}", "--data", "{corpus}"], []),
}


def all_cases() -> dict[str, tuple[str, list[str], str]]:
    cases = {}
    for module, (parser, hand, required, tail) in COMMANDS.items():
        for name, (argv, fragment) in {**generated(parser, required, tail), **hand}.items():
            cases[f"{module.split('.')[1]}: {name}"] = (module, argv, fragment)
    return cases


CASES = all_cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    inputs = tmp_path_factory.mktemp("inputs")
    files = _files(inputs)
    before = snapshot(inputs)
    work = tmp_path_factory.mktemp("work")
    batch = []
    for i, (module, argv, _) in enumerate(CASES.values()):
        cwd = work / str(i)
        cwd.mkdir()
        batch.append({"module": module, "cwd": str(cwd), "argv": [
            arg.format(**{k.strip("{}"): v for k, v in files.items()}) if "{" in arg else arg for arg in argv]})
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(batch), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert snapshot(inputs) == before  # no input was touched
    return {name: (r, work / str(i)) for i, (name, r) in enumerate(zip(CASES, json.loads(done.stdout)))}


def test_every_option_of_every_command_is_covered():
    for module, (parser, _, _, _) in COMMANDS.items():
        flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
        named = {arg.split("=")[0] for m, argv, fragment in CASES.values() if m == module for arg in argv
                 if arg.split("=")[0] == fragment}
        assert flags <= named, (module, flags - named)
    assert len(CASES) > 1000  # two to eight bad values for each option of the seven commands, and the hand-written ones


@pytest.mark.parametrize("case", CASES)
def test_bad_value_gives_one_error_line(results, case):
    result, cwd = results[case]
    assert result["code"] == 2, result
    assert result["stdout"] == ""
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]
    assert CASES[case][2] in lines[0]
    assert not any(cwd.iterdir()), list(cwd.iterdir())  # nothing written
