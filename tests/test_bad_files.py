"""The bad-input tables of the inputs that are files and variables, generated from what reads
them, as tests/test_bad_input.py generates the options' from the parsers: every field of a
fine-tuning record of each format, every key of a PEFT adapter_config.json (its schema,
spmd.formats.peft.FIELDS), every variable that places a process (JAX's and SLURM's), each
given values of the wrong kind, out of bounds and empty. Each is refused in one line that
names the input (the record's file and line, the file and key, the variable) and why.

The cases call the readers in this process (microseconds each); tests/test_bad_input.py and
the hardening tests hold that a refusal reaches the command line as one `error:` line with
exit code 2 and nothing written.
"""

import json
import shutil
from pathlib import Path

import pytest

from spmd.base.errors import UserError
from spmd.base.schema import BOOLEAN, INTEGER, LIST, MAPPING, NUMBER, REQUIRED, STRING
from spmd.data.records import example
from spmd.data.tokenizer import TokenizerDirectory
from spmd.formats.peft import CONFIG, FIELDS, read_adapter_config
from spmd.run.distributed import ENV, processes

pytestmark = pytest.mark.xdist_group("cli")

ROOT = Path(__file__).resolve().parents[1]
WHERE = "data.jsonl:7"  # where a record is, as the readers name it

# ------------------------------------------------------------------------------ records
# Good records of each format; each case below breaks one field of one of them.
GOOD = {
    "text": {"text": "the lazy dog"},
    "prompt/completion": {"prompt": "2 + 2?", "completion": " 4"},
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "conversational prompt/completion": {"prompt": [{"role": "user", "content": "hi"}],
                                         "completion": [{"role": "assistant", "content": "hello"}]},
}
# JSON values of every kind, for a field that must hold text (or a list of messages).
WRONG_KINDS = {"a number": 3, "true": True, "null": None, "an object": {"a": 1}, "a list": ["a"]}


def _record_cases() -> dict[str, tuple[dict, str]]:
    """name -> (record, a fragment the error must hold)."""
    cases = {}
    for fmt, good in GOOD.items():
        for field, value in good.items():
            kinds = dict(WRONG_KINDS)
            if isinstance(value, list):
                kinds.pop("a list")  # (its items are broken below)
                kinds["an empty list"] = []
            for kind, bad in kinds.items():
                cases[f"{fmt}: {field} is {kind}"] = ({**good, field: bad}, field)
            if isinstance(value, list):  # each message of the list, field by field
                for part, bad in (("not an object", "hi"), ("role unknown", {"role": "robot", "content": "x"}),
                                  ("role missing", {"content": "x"}), ("content a number", {"role": "user", "content": 3}),
                                  ("content a list", {"role": "user", "content": [1]})):
                    cases[f"{fmt}: {field}[0] {part}"] = ({**good, field: [bad, *value[1:]]}, f"{field}[0]")
    cases["messages: no assistant turn"] = ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn")
    cases["messages: tools a number"] = ({**GOOD["messages"], "tools": 3}, "tools")
    cases["messages: tools text that is no JSON"] = ({**GOOD["messages"], "tools": "[{"}, "tools")
    cases["no field of any format"] = ({"question": "2 + 2?"}, "no known fields")
    return cases


RECORDS = _record_cases()


@pytest.fixture(scope="module")
def chat_tokenizer():
    return TokenizerDirectory(ROOT / "tests" / "sft" / "model")


@pytest.mark.parametrize("case", RECORDS)
def test_a_bad_record_is_refused_naming_its_line_and_field(chat_tokenizer, case):
    record, fragment = RECORDS[case]
    with pytest.raises(UserError) as refused:
        example(record, WHERE, chat_tokenizer)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(WHERE) and fragment in line, line


def test_every_field_of_every_record_format_is_broken_by_the_table():
    broken = {case.split(":")[0] for case in RECORDS}
    assert set(GOOD) <= broken
    assert len(RECORDS) >= 45


# ------------------------------------------------------------------- adapter_config.json

def _wrong_values(field) -> dict[str, object]:
    """Values a schema field must refuse: another kind, out of its bounds, not a choice."""
    other_kind = {INTEGER: "four", NUMBER: "four", STRING: 4, BOOLEAN: "yes", MAPPING: [1], LIST: {"a": 1}}
    values = {"of another kind": other_kind.get(field.kind, "anything")}
    if field.choices:
        values["not a choice"] = {str: "other", bool: True, dict: {"a": 1}}.get(type(field.choices[0]), "other")
    elif field.kind in (INTEGER, NUMBER):
        b = field.bounds
        for name, edge in (("below its bound", b.at_least - 1 if b.at_least is not None else b.above),
                           ("above its bound", b.at_most + 1 if b.at_most is not None else b.below)):
            if edge is not None:
                values[name] = edge
        if field.kind is INTEGER:
            values["not whole"] = 4.5
    if not field.nullable:
        values["null"] = None
    return {k: v for k, v in values.items() if not (field.choices and any(v == c for c in field.choices))}


ADAPTER = {f"{field.name} {what}": (field.name, value) for field in FIELDS for what, value in _wrong_values(field).items()}
ADAPTER |= {f"{field.name} missing": (field.name, KeyError) for field in FIELDS if field.default is REQUIRED}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.mark.parametrize("case", ADAPTER)
def test_a_bad_adapter_config_is_refused_naming_the_file_and_key(adapter, case):
    key, value = ADAPTER[case]
    directory = adapter / str(sorted(ADAPTER).index(case))
    shutil.copytree(ROOT / "tests" / "hf" / "lora-peft", directory)
    config = json.loads((directory / CONFIG).read_text())
    if value is KeyError:
        del config[key]
    else:
        config[key] = value
    (directory / CONFIG).write_text(json.dumps(config))
    with pytest.raises(UserError) as refused:
        read_adapter_config(str(directory))
    line = str(refused.value)
    assert "\n" not in line and CONFIG in line and key in line, line


def test_every_key_of_the_adapter_schema_is_broken_by_the_table():
    assert {field.name for field in FIELDS} <= {key for key, _ in ADAPTER.values()}


# ---------------------------------------------------------------- the processes' variables

class _NoFlags:
    coordinator = num_processes = process_id = None


GOOD_PLACES = {
    "JAX": {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
    "SLURM": {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"},
}
NOT_INTEGERS = {"empty": "", "text": "two", "a fraction": "1.5", "other digits": "\u0661", "huge": "9" * 40}
OUT_OF_RANGE = {"negative": "-1", "zero count": "0"}


def _place_cases() -> dict[str, tuple[dict, str]]:
    cases = {}
    for source, good in GOOD_PLACES.items():
        for name in good:
            if name in ("SLURM_JOB_ID", "JAX_COORDINATOR_ADDRESS"):
                continue  # read as text: the coordinator's address is checked as host:port below
            for kind, value in {**NOT_INTEGERS, **OUT_OF_RANGE}.items():
                if kind == "zero count" and not name.endswith(("NUM_PROCESSES", "NTASKS")):
                    continue
                cases[f"{name} {kind}"] = ({**good, name: value}, name)
        cases[f"{source}: the index past the count"] = ({**good, [n for n in good if n.endswith(("ID", "PROCID"))
                                                                    and "JOB" not in n][0]: "2"}, "")
    for address in ("", "h", "h:", ":1", "h:0", "h:65536", "h:1\u0661"):
        cases[f"JAX_COORDINATOR_ADDRESS {address!r}"] = ({**GOOD_PLACES["JAX"], "JAX_COORDINATOR_ADDRESS": address},
                                                         "coordinator")
    cases["JAX: a variable missing"] = ({k: v for k, v in GOOD_PLACES["JAX"].items() if k != ENV[2]}, ENV[2])
    return cases


PLACES = _place_cases()


@pytest.mark.parametrize("case", PLACES)
def test_a_bad_process_variable_is_refused_naming_it(case):
    environ, fragment = PLACES[case]
    with pytest.raises(UserError) as refused:
        processes(_NoFlags(), environ)
    line = str(refused.value)
    assert "\n" not in line and fragment in line, line
