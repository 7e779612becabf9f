"""The bad-input tables of the inputs that are files and variables, generated from what reads
them, as tests/test_bad_input.py generates the options' from the parsers: every field of a
fine-tuning record of each format (spmd.data.records), chat templates that fail or go past
their bounds (spmd.data.chat), every key of a PEFT adapter_config.json (its schema,
spmd.formats.peft.FIELDS) and its tensors file, data files that are no data, a config.json
whose model_type is not its architecture's, `spmd.launch`'s flags together, commands that are
no program and a process that fails, and every variable that places a process (JAX's and
SLURM's), each given values of the wrong kind, out of bounds and empty. Inputs that only look
wrong (a JSONL file that starts with a byte-order mark) run, and write what their plain twin writes.

Every case runs on the command line (spmd.train, spmd.eval, spmd.generate, spmd.corpus,
spmd.launch), all in one driver, one fork each (tests/cli_driver.py): one `error:` line that
names the input (the file, and its line or key; the variable) and why, exit code 2 (a
launched process's own code when it fails), nothing on stdout, nothing written in the
working directory, no input changed; a launch that a process fails ends within --grace + 2 s.
"""

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.commands import run_cases, snapshot

from spmd.base.cli import MAX_RECORD_BYTES, SEQ
from spmd.base.schema import BOOLEAN, INTEGER, LIST, MAPPING, NUMBER, REQUIRED, STRING
from spmd.data.chat import MAX_STEPS
from spmd.data.records import ROLES
from spmd.formats.peft import CONFIG, FIELDS, MAX_CONFIG_BYTES, WEIGHTS
from spmd.launch import MAX_PROCESSES
from spmd.run.distributed import ENV

pytestmark = pytest.mark.xdist_group("cli")

TESTS = Path(__file__).resolve().parent
# The fixtures, copied into the inputs (a case must change none of them).
FIXTURES = {"model": TESTS / "sft" / "model", "chatml": TESTS / "sft" / "chatml", "base": TESTS / "hf" / "llama-gqa",
            "adapter": TESTS / "hf" / "lora-peft"}
TRAIN = ["--mesh", "dp=1", "--batch", "2", "--seq", "16", "--steps", "1"]
PACK = ["--seq", "16", "--out", "t.npy"]
# What a case is: (module, argv with {input} fields, fragments the error line must hold), and
# optionally "code" (2), "within" (seconds it may take), "env" (variables set, None: unset).
CASES: dict[str, dict] = {}


def case(name: str, module: str, argv: list[str], *fragments: str, **more) -> None:
    assert name not in CASES, name
    CASES[name] = dict(module=module, argv=argv, fragments=fragments, **more)


# ------------------------------------------------------------------------------ records
# A good record of each format; each case breaks one field of one of them, on line 2 of a file
# whose line 1 is the good record (the format is the first record's).
GOOD = {
    "text": {"text": "the lazy dog"},
    "prompt/completion": {"prompt": "2 + 2?", "completion": " 4"},
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "conversational prompt/completion": {"prompt": [{"role": "user", "content": "hi"}],
                                         "completion": [{"role": "assistant", "content": "hello"}]},
}
# JSON values of every kind, for a field that must hold text (or a list of messages).
# (An empty string is text: an empty prompt or document is no mistake.)
WRONG_KINDS = {"a number": 3, "true": True, "null": None, "an object": {"a": 1}, "a list": ["a"]}
RECORD_LINES: dict[str, tuple[str, bytes]] = {}  # case -> (format of line 1, line 2)


def _record(name: str, fmt: str, line2, *fragments: str) -> None:
    line = line2 if isinstance(line2, bytes) else json.dumps(line2).encode()
    RECORD_LINES[name] = (fmt, line)
    file = f"{{records}}/{len(RECORD_LINES)}.jsonl"
    where = f"{len(RECORD_LINES)}.jsonl, line 2"
    if fmt == "text":  # a text record's file is a token stream: training, spmd.corpus without --seq
        case(f"records: {name}", "spmd.corpus", ["--data", file, "--out", "t.npy"], where, *fragments)
    else:
        case(f"records: {name}", "spmd.corpus", ["--data", file, "--tokenizer", "{model}", *PACK], where, *fragments)


def _good_with(fmt: str, value: bytes) -> bytes:
    """The good record of `fmt` as a JSONL line, with `value` (raw JSON) for its first text."""
    record = json.loads(json.dumps(GOOD[fmt]))
    holder, key = (record, next(iter(record)))
    while not isinstance(holder[key], str):
        holder, key = holder[key], 0 if isinstance(holder[key], list) else "content"
    holder[key] = "@@"
    return json.dumps(record).encode().replace(b'"@@"', value)


def _record_cases() -> None:
    for fmt, good in GOOD.items():
        for field, value in good.items():
            kinds = dict(WRONG_KINDS)
            if isinstance(value, list):
                kinds.pop("a list")  # (its items are broken below)
                kinds["an empty list"] = []
            for kind, bad in kinds.items():
                _record(f"{fmt}: {field} is {kind}", fmt, {**good, field: bad},
                        field if fmt != "text" or kind != "null" else "")
            if isinstance(value, list):  # each message of the list, field by field
                messages = {"not an object": "hi", "role missing": {"content": "x"},
                            "content a number": {"role": "user", "content": 3},
                            "content a list": {"role": "user", "content": [1]},
                            "content missing": {"role": "user"}, "content null": {"role": "user", "content": None}}
                # A role outside ROLES: each one's spelling in other case, and the empty one.
                messages |= {f"role {r.upper()!r}": {"role": r.upper(), "content": "x"} for r in ROLES}
                messages |= {"role ''": {"role": "", "content": "x"}, "role a number": {"role": 1, "content": "x"}}
                for part, bad in messages.items():
                    _record(f"{fmt}: {field}[0] {part}", fmt, {**good, field: [bad, *value[1:]]}, f"{field}[0]")
    chat = GOOD["messages"]
    _record("messages: no assistant turn", "messages", {"messages": [{"role": "user", "content": "hi"}]},
            "no assistant turn")
    for kind, tools in {"a number": 3, "an object": {"a": 1}, "a list of numbers": [1, 2], "a list of lists": [[]],
                        "text that is no JSON": "[{", "JSON text of a number": "3"}.items():
        _record(f"messages: tools {kind}", "messages", {**chat, "tools": tools}, "tools")
    for fmt in GOOD:
        _record(f"{fmt}: no field of any format", fmt, {"question": "2 + 2?"},
                "no known fields" if fmt != "text" else "text")
    for fmt, other in (("messages", "prompt/completion"), ("prompt/completion", "messages"), ("messages", "text"),
                       ("prompt/completion", "text")):
        _record(f"{fmt}: a {other} record among them", fmt, GOOD[other], f"a {other} record in a file of {fmt}")
    for fmt in GOOD:
        for name, line, fragment in (
                ("not JSON", b'{"messages": [', "JSON"), ("a JSON list", b"[1, 2]", "not a JSON object"),
                ("a JSON string", b'"hi"', "not a JSON object"), ("a key twice", b'{"text": "a", "text": "b"}',
                                                                  "twice")):
            _record(f"{fmt}: a line {name}", fmt, line, fragment)
        # The first text of a good record, given as JSON that is no text.
        for name, value, fragment in (("not UTF-8", b'"\xff"', "not UTF-8"), ("NaN", b"NaN", "finite"),
                                      ("Infinity", b"1e999", "finite"), ("a lone surrogate", b'"\\ud800"',
                                                                          "surrogate")):
            _record(f"{fmt}: its first text {name}", fmt, _good_with(fmt, value), fragment)


_record_cases()
# A line over --max-record-bytes, in each format (a text that long refused before it is read).
BOUND = 200
for fmt in ("prompt/completion", "messages", "conversational prompt/completion"):  # (text: a token stream)
    _record(f"{fmt}: a line over --max-record-bytes", fmt, {"padding": "x" * BOUND, **GOOD[fmt]},
            f"bytes, more than --max-record-bytes {BOUND}")
    CASES[f"records: {fmt}: a line over --max-record-bytes"]["argv"] += ["--max-record-bytes", str(BOUND)]
# The commands that read records besides spmd.corpus: one case of each format.
for name in ("messages: messages[0] role 'ROBOT'", "messages: messages[0] role 'USER'",
             "prompt/completion: prompt is a number", "conversational prompt/completion: completion[0] not an object",
             "messages: a line not JSON", "messages: tools a list of numbers"):
    if f"records: {name}" not in CASES:
        continue
    c = CASES[f"records: {name}"]
    data = c["argv"][1]
    case(f"records (train): {name}", "spmd.train", ["--init-from", "{model}", "--data", data, *TRAIN], *c["fragments"])
    case(f"records (eval): {name}", "spmd.eval", ["--init-from", "{model}", "--data", data, "--seq", "16"],
         *c["fragments"])
for fmt in ("text",):
    c = CASES[f"records: {fmt}: text is a number"]
    case(f"records (train): {fmt}: text is a number", "spmd.train", ["--data", c["argv"][1], *TRAIN], *c["fragments"])


# ------------------------------------------------------------------------------ chat templates
# Each is the template of a copy of the fixture's model (its tokenizer too). FOREVER: loops of
# loops, each range bounded (100,000), their product not.
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TEMPLATES = {  # name -> (chat_template.jinja's text, fragment, also refused by generate --chat)
    "does not compile": ("{% for %}", "the chat template does not compile", True),
    "unclosed block": ("{% if messages %}", "the chat template does not compile", True),
    "raises": ("{{ raise_exception('no chats here') }}", "fails: no chats here", True),
    "calls what is not there": ("{{ nothing() }}", "fails", True),
    "divides by zero": ("{{ 1 // 0 }}", "fails", True),
    "unbounded nested loops": (FOREVER, f"takes more than {MAX_STEPS:,} steps", False),
    "a macro calling itself twice": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        f"takes more than {MAX_STEPS:,} steps", False),
    "makes a value past the bound": ("{{ 'x' * 10**9 }}", "reaches a value of 1,000,000,000 characters", True),
    # Filters and string methods, run as plain Python: counted, and what they make bounded first.
    "a filter's work in a loop": ("{% for i in range(100000) %}{{ range(100000)|max }}{% endfor %}",
                                  f"takes more than {MAX_STEPS:,} steps", True),
    "a filter of literals past the bound": ("{{ 'x'|center(1000000000) }}",
                                            "reaches a value of 1,000,000,000 characters", True),
    "a join past the bound": ("{{ range(3400)|join('x' * 100000) }}", "reaches a value of 340,000,000", True),
    "a string method past the bound": ("{% set s = 'x' * 10000 %}{{ s.replace('', s) }}", "reaches a value of", True),
    "a printf width past the bound": ("{{ '%1000000000s' % 'x' }}", "reaches a value of 1,000,000,000", True),
    "nested past the compiler": ("{{ " + "(" * 1000 + "1" + ")" * 1000 + " }}", "the chat template does not compile",
                                 True),
    "an integer power past the bound": ("{{ 7 ** 1000000 }}", "", True),
    "renders past --max-record-bytes": ("{% for i in range(1000) %}{{ 'x' * 500 }}{% endfor %}",
                                        f"renders more than {MAX_RECORD_BYTES // 64:,} characters", False),
    "renders nothing": ("", "is not in the rendering of the chat template", False),
    "drops the assistant's content": ("{% for m in messages %}{{ m.role }}{% endfor %}",
                                      "is not in the rendering of the chat template", False),
}
TEMPLATE_FILES = {  # name -> (what chat_template.jinja is, fragment)
    "is a directory": ("directory", "chat_template.jinja is a directory, not a file"),
    "is a FIFO": ("fifo", "chat_template.jinja is a FIFO, not a file"),
    "is a broken link": ("broken", "chat_template.jinja"),
    "is not UTF-8": (b"{{ messages }}\xff", "chat_template.jinja: not UTF-8 text"),
    "is too large": (b" " * ((1 << 26) + 1), "chat_template.jinja"),
}
CONFIG_TEMPLATES = {  # name -> tokenizer_config.json's chat_template (the model has no chat_template.jinja)
    "a number": (3, "chat_template is not a string"), "true": (True, "chat_template is not a string"),
    "an object": ({"template": "x"}, "chat_template is not a string"),
    "a list with no 'default'": ([{"name": "tool_use", "template": "x"}], "none named 'default'"),
    "a list of numbers": ([1, 2], "none named 'default'"),
    "null": (None, "has none"), "empty": ("", "has none"),
    "a default that is no text": ([{"name": "default", "template": 3}], "chat_template"),
}
CONFIG_FILES = {  # name -> tokenizer_config.json's bytes
    "not JSON": b'{"chat_template": ', "a JSON list": b"[]", "not UTF-8": b'{"eos_token": "\xff"}',
    "a key twice": b'{"eos_token": "<|im_end|>", "eos_token": "<|im_end|>"}',
}


def _template_cases() -> None:
    for i, (name, (text, fragment, at_load)) in enumerate(TEMPLATES.items()):
        flags = ["--max-record-bytes", str(MAX_RECORD_BYTES // 64)] if "max-record-bytes" in name else []
        tok = f"{{templates}}/{i}"
        case(f"template: {name}", "spmd.corpus", ["--data", "{chat}", "--tokenizer", tok, *PACK, *flags],
             "chat_template.jinja", fragment)
        if at_load:
            case(f"template (generate --chat): {name}", "spmd.generate",
                 ["--init-from", tok, "--chat", "--prompt", "hi"], "chat_template.jinja", fragment)
    for i, (name, (_, fragment)) in enumerate(TEMPLATE_FILES.items()):
        tok = f"{{template_files}}/{i}"
        case(f"template: chat_template.jinja {name}", "spmd.corpus",
             ["--data", "{chat}", "--tokenizer", tok, *PACK], fragment)
        case(f"template (train): chat_template.jinja {name}", "spmd.train",
             ["--init-from", tok, "--data", "{chat}", *TRAIN], fragment)
        case(f"template (generate --chat): chat_template.jinja {name}", "spmd.generate",
             ["--init-from", tok, "--chat", "--prompt", "hi"], fragment)
    for i, (name, (_, fragment)) in enumerate(CONFIG_TEMPLATES.items()):
        case(f"template: tokenizer_config.json chat_template {name}", "spmd.corpus",
             ["--data", "{chat}", "--tokenizer", f"{{config_templates}}/{i}", *PACK], "tokenizer_config.json"
             if "none" in fragment else "", fragment)
    for i, name in enumerate(CONFIG_FILES):
        case(f"template: tokenizer_config.json {name}", "spmd.corpus",
             ["--data", "{chat}", "--tokenizer", f"{{config_files}}/{i}", *PACK], "tokenizer_config.json")


_template_cases()
# A flag that the data's kind would ignore.
case("corpus: --loss-on for text", "spmd.corpus", ["--data", "{text}", "--out", "t.npy", "--loss-on", "all"],
     "--loss-on applies to fine-tuning records")
case("corpus: --text-field for records", "spmd.corpus",
     ["--data", "{chat}", "--tokenizer", "{model}", *PACK, "--text-field", "body"], "--text-field applies to text data")


# ------------------------------------------------------------------------------ adapters

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
            values["a boolean"] = True
    if not field.nullable:
        values["null"] = None
    return {k: v for k, v in values.items() if not (field.choices and any(v == c for c in field.choices))}


ADAPTER_CONFIGS = {f"{field.name} {what}": (field.name, value)
                   for field in FIELDS for what, value in _wrong_values(field).items()}
ADAPTER_CONFIGS |= {f"{field.name} missing": (field.name, KeyError) for field in FIELDS if field.default is REQUIRED}
ADAPTER_CONFIGS |= {"r disagrees with the tensors": ("r", 2), "target_modules one not in the tensors":
                    ("target_modules", ["q_proj"]), "target_modules unknown": ("target_modules", ["qkv"]),
                    "target_modules empty": ("target_modules", []), "target_modules twice": ("target_modules",
                                                                                             ["q_proj", "q_proj"])}
ADAPTER_FILES = {  # name -> (file, what it is: bytes, "missing", "directory", "fifo", "broken"; fragment)
    f"{WEIGHTS} missing": (WEIGHTS, "missing", f"has no {WEIGHTS}"),
    f"{WEIGHTS} empty": (WEIGHTS, b"", WEIGHTS), f"{WEIGHTS} truncated": (WEIGHTS, 100, "truncated"),
    f"{WEIGHTS} a header past the file": (WEIGHTS, (1 << 40).to_bytes(8, "little") + b"{}", WEIGHTS),
    f"{WEIGHTS} a header that is no JSON": (WEIGHTS, (4).to_bytes(8, "little") + b"abcd", WEIGHTS),
    f"{WEIGHTS} a tensor missing": (WEIGHTS, "drop", WEIGHTS),
    f"{WEIGHTS} a tensor of NaN": (WEIGHTS, "nan", "holds values that are not finite"),
    f"{WEIGHTS} a directory": (WEIGHTS, "directory", "is a directory"),
    f"{WEIGHTS} a FIFO": (WEIGHTS, "fifo", "is a FIFO"), f"{WEIGHTS} a broken link": (WEIGHTS, "broken", WEIGHTS),
    f"{CONFIG} missing": (CONFIG, "missing", f"has no {CONFIG}"),
    f"{CONFIG} a directory": (CONFIG, "directory", CONFIG), f"{CONFIG} a FIFO": (CONFIG, "fifo", CONFIG),
    f"{CONFIG} not JSON": (CONFIG, b'{"r": ', CONFIG), f"{CONFIG} a JSON list": (CONFIG, b"[]", CONFIG),
    f"{CONFIG} empty": (CONFIG, b"", CONFIG), f"{CONFIG} not UTF-8": (CONFIG, b'{"r": "\xff"}', CONFIG),
    f"{CONFIG} larger than a config": (CONFIG, b" " * (MAX_CONFIG_BYTES + 1) + b"{}", CONFIG),
    f"{CONFIG} a key twice": (CONFIG, "twice", "twice"),
}


def _adapter_cases() -> None:
    commands = {"train": ("spmd.train", TRAIN), "generate": ("spmd.generate", ["--prompt", "hi"]),
                "eval": ("spmd.eval", ["--data", "{text}", "--seq", "16"])}
    for group, table in (("adapter_configs", ADAPTER_CONFIGS), ("adapter_files", ADAPTER_FILES)):
        for i, name in enumerate(table):
            fragment = table[name][0] if group == "adapter_configs" else table[name][2]
            fragment = {"target_modules one not in the tensors": "has no place for"}.get(name, fragment)
            for command, (module, flags) in commands.items():
                if group == "adapter_configs" and command != "train" and i % 3:
                    continue  # the config is read by one function for all three: each key's every value once
                case(f"adapter ({command}): {name}", module,
                     ["--init-from", "{base}", "--adapter", f"{{{group}}}/{i}", *flags], f"{group}/{i}", fragment)
    # Another command's output over the adapter's files: refused before anything is written.
    weights = f"{{adapter}}/{WEIGHTS}"
    for name, module, argv in (
            ("generate --output over its tensors", "spmd.generate", ["--prompt", "hi", "--output", weights]),
            ("train --metrics-file over its tensors", "spmd.train", [*TRAIN, "--metrics-file", weights]),
            ("train --out in it", "spmd.train", [*TRAIN, "--out", "{adapter}/run"]),
            ("train --tensorboard in it", "spmd.train", [*TRAIN, "--tensorboard", "{adapter}/tb"]),
            ("train --metrics-file over its README", "spmd.train", [*TRAIN, "--metrics-file", "{adapter}/README.md"])):
        case(f"adapter: {name}", module, ["--init-from", "{base}", "--adapter", "{adapter}", *argv],
             "would write over the input --adapter")
    case("adapter: a file, not a directory", "spmd.train",
         ["--init-from", "{base}", "--adapter", f"{{adapter}}/{CONFIG}", *TRAIN], "--adapter")
    case("adapter: missing", "spmd.train", ["--init-from", "{base}", "--adapter", "{adapter}/none", *TRAIN],
         "--adapter")


_adapter_cases()


# ------------------------------------------------------------------------------ data files
# `--data` that is no data, given to spmd.corpus (a token stream, and packed records) and spmd.train.
DATA = {  # name -> (path under {data}, fragment)
    "a missing file": ("none.txt", "no such file"), "an empty folder": ("empty_folder", "no data files"),
    "a FIFO": ("fifo.jsonl", "is a FIFO"), "a broken link": ("broken.jsonl", "broken.jsonl"),
    "a folder holding a FIFO": ("with_fifo", "is a FIFO"), "a folder of hidden files": ("hidden", "no data files"),
    "a folder of two kinds": ("mixed", "mixes kinds of data"),
    "an empty text file": ("empty.txt", "empty.txt"),
    "an empty JSONL file": ("empty.jsonl", "empty.jsonl holds no records (the file is empty)"),
    "a binary text file": ("binary.txt", "not UTF-8", "--seq packs fine-tuning records"),
    "a binary JSONL file": ("binary.jsonl", "binary.jsonl, line 1"),
    "a .npy that is not one": ("garbage.npy", "garbage.npy"),
    "a JSONL of blank lines": ("blank.jsonl", "blank.jsonl holds no records (only blank lines)"),
    # No records is no records, whatever their format would have been (not "text", not "no 'text' column").
    "an empty Parquet file of prompt/completion": ("empty_pc.parquet", "empty_pc.parquet holds no records (0 rows)"),
    "an empty Parquet file of messages": ("empty_chat.parquet", "empty_chat.parquet holds no records (0 rows)"),
    "a folder of empty JSONL files": ("empty_shards", "holds no records (none of its 2 JSONL files holds one)"),
    "a symbolic link loop": ("loop.jsonl", "loop.jsonl is a symbolic link loop"),
    "a folder holding a symbolic link loop": ("with_loop", "a.jsonl is a symbolic link loop"),
}
# Also through spmd.eval (the same readers).
EVAL_DATA = ("an empty JSONL file", "an empty Parquet file of prompt/completion", "a symbolic link loop")


def _data_cases() -> None:
    for name, (path, fragment, *packed) in DATA.items():
        data = f"{{data}}/{path}"
        case(f"data (corpus): {name}", "spmd.corpus", ["--data", data, "--out", "t.npy"], fragment)
        case(f"data (corpus --seq): {name}", "spmd.corpus", ["--data", data, "--tokenizer", "{model}", *PACK],
             *(packed or [fragment]))
        case(f"data (train): {name}", "spmd.train", ["--data", data, *TRAIN], fragment)
        if name in EVAL_DATA:
            case(f"data (eval): {name}", "spmd.eval", ["--init-from", "{model}", "--data", data, "--seq", "16"],
                 fragment)
    # An empty file left out: the next one's records say what the folder holds (not the empty one, as text).
    case("corpus: records after an empty file, without --seq", "spmd.corpus",
         ["--data", "{data}/after_empty", "--out", "t.npy"], "after_empty holds fine-tuning records: give --seq")
    # --seq with records: values of the wrong kind and out of spmd.base.cli.SEQ's bounds.
    bad_seq = {"zero": str(SEQ.at_least - 1), "negative": "-1", "past the bound": str(int(SEQ.at_most) + 1),
               "a fraction": "1.5", "empty": "", "not finite": "inf", "other digits": "\u0661\u0666"}
    for name, seq in bad_seq.items():
        case(f"corpus: --seq {name} with records", "spmd.corpus",
             ["--data", "{chat}", "--tokenizer", "{model}", "--seq", seq, "--out", "t.npy"], "--seq")
    case("corpus: records without --seq", "spmd.corpus", ["--data", "{chat}", "--tokenizer", "{model}", "--out",
                                                           "t.npy"], "give --seq")
    case("corpus: --seq with text", "spmd.corpus", ["--data", "{text}", *PACK], "--seq packs fine-tuning records")
    case("corpus: records without a tokenizer directory", "spmd.corpus", ["--data", "{chat}", *PACK],
         "need a Hugging Face tokenizer directory")


_data_cases()


# ------------------------------------------------------------------------------ spmd.launch
# --nproc and --grace together: each bad value with the other good, and both bad.
NPROC = {"2": None, "0": "--nproc", "-1": "--nproc", str(MAX_PROCESSES + 1): "--nproc", "1.5": "--nproc",
         "": "--nproc"}
GRACE = {"1": None, "-1": "--grace", "nan": "--grace", "inf": "--grace", "abc": "--grace", "": "--grace"}
for (nproc, n_bad), (grace, g_bad) in itertools.product(NPROC.items(), GRACE.items()):
    if n_bad or g_bad:
        case(f"launch: --nproc {nproc!r} --grace {grace!r}", "spmd.launch",
             ["--nproc", nproc, "--grace", grace, "--", "true"], "", either=[f for f in (n_bad, g_bad) if f])
case("launch: no --", "spmd.launch", ["--nproc", "2", "true"], "the command after --")
case("launch: nothing after --", "spmd.launch", ["--nproc", "2", "--"], "a command must follow --")
case("launch: no such command", "spmd.launch", ["--nproc", "2", "--", "{data}/none"], "command not found")
case("launch: a command that cannot run", "spmd.launch", ["--nproc", "2", "--", "{data}/empty.txt"],
     "permission denied")
case("launch: a directory as the command", "spmd.launch", ["--nproc", "2", "--", "{data}/empty_folder"],
     "empty_folder: it is a directory, not a program")
case("launch: an empty command", "spmd.launch", ["--nproc", "2", "--", ""], "the command after -- is empty")
# A process that fails (exit 9) while the others run on (sleep, or ignore SIGTERM too): the
# launch ends within --grace + 2 s with the failure's code and one line naming the process.
SLEEP = {"sleeps": "sleep 30", "ignores SIGTERM": "trap '' TERM; sleep 30"}
for grace, (failing, index), (how, other) in itertools.product(("0", "0.5"), (("first", 0), ("last", 2)),
                                                               SLEEP.items()):
    script = f'if [ "$JAX_PROCESS_ID" = {index} ]; then exit 9; fi; {other}'
    case(f"launch: the {failing} of 3 exits 9, the others {how}, --grace {grace}", "spmd.launch",
         ["--nproc", "3", "--grace", grace, "--", "sh", "-c", script], f"process {index} of 3 failed (exit code 9)",
         code=9, within=float(grace) + 2)
case("launch: a process killed, the other sleeps", "spmd.launch",
     ["--nproc", "2", "--grace", "0", "--", "sh", "-c", 'if [ "$JAX_PROCESS_ID" = 1 ]; then kill -9 $$; fi; sleep 30'],
     "process 1 of 2 failed (killed by SIGKILL)", code=128 + 9, within=2)


# ------------------------------------------------------------------------------ config.json
# A model_type that is not its architecture's: transformers would build the model model_type
# names, the tensors are the other's. Each a copy of a fixture of tests/hf with one model_type.
MODEL_TYPES = {  # name -> (fixture, model_type, its architecture)
    "Qwen3 weights, model_type llama": ("qwen3", "llama", "Qwen3ForCausalLM"),
    "Llama weights, model_type qwen3": ("llama-gqa", "qwen3", "LlamaForCausalLM"),
    "Mixtral weights, model_type llama": ("mixtral", "llama", "MixtralForCausalLM"),
    "Qwen3-MoE weights, model_type qwen3": ("qwen3-moe", "qwen3", "Qwen3MoeForCausalLM"),
    "Gemma 3 weights, model_type gemma3 (the multimodal one)": ("gemma3", "gemma3", "Gemma3ForCausalLM"),
    "Mistral weights, model_type a number": ("mistral", 7, "MistralForCausalLM"),
}
for i, (name, (_, model_type, architecture)) in enumerate(MODEL_TYPES.items()):
    for command, module, flags in (("train", "spmd.train", TRAIN), ("generate", "spmd.generate", ["--prompt", "hi"])):
        if command == "train" or i == 0:
            case(f"config.json ({command}): {name}", module, ["--init-from", f"{{model_types}}/{i}", *flags],
                 f"model_types/{i}: config.json model_type: {model_type!r} contradicts architectures "
                 f"[{architecture!r}]")


# ------------------------------------------------------------------------------ read as they are
# Inputs that look wrong and are not: each runs (exit 0) and writes what its plain twin writes.
# A JSONL file that starts with a UTF-8 byte-order mark (Windows editors write one) is read past
# it, as utf-8-sig, pyarrow and `datasets` read it: its records (records' first line and their
# index, spmd.corpus --seq) and its texts (a token stream, spmd.corpus).
TWINS = {  # name -> (module, argv, its twin's argv)
    "records with a byte-order mark": ("spmd.corpus", ["--data", "{bom}/chat.jsonl", "--tokenizer", "{model}", *PACK],
                                       ["--data", "{chat}", "--tokenizer", "{model}", *PACK]),
    "texts with a byte-order mark": ("spmd.corpus", ["--data", "{bom}/text.jsonl", "--out", "t.npy"],
                                     ["--data", "{data}/text.jsonl", "--out", "t.npy"]),
}


# ------------------------------------------------------------------------------ the processes' variables
# Every variable that places a process (spmd.run.distributed reads JAX's and SLURM's; JAX's
# SLURM cluster reads SLURM's node list and local id too), each with values of the wrong
# kind, out of range and empty, through spmd.train.
GOOD_PLACES = {
    "JAX": {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
    "SLURM": {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"},
}
PLACE_VARIABLES = (*ENV, "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST",
                   "SLURM_STEP_NUM_NODES")
NOT_INTEGERS = {"empty": "", "text": "two", "a fraction": "1.5", "other digits": "\u0661", "huge": "9" * 40,
                "underscored": "1_0", "blank": " "}
OUT_OF_RANGE = {"negative": "-1", "zero count": "0", "past any cluster": str(1 << 17)}



def _place_cases() -> None:
    def place(name, environ, *fragments, mesh="dp=1", **more):
        case(f"variables: {name}", "spmd.train", [*TRAIN, "--mesh", mesh, "--join-timeout", "1"], *fragments,
             env={**dict.fromkeys(PLACE_VARIABLES), **environ}, **more)

    for source, good in GOOD_PLACES.items():
        for name in good:
            if name in ("SLURM_JOB_ID", "JAX_COORDINATOR_ADDRESS"):
                continue  # read as text: the coordinator's address is checked as host:port below
            for kind, value in {**NOT_INTEGERS, **OUT_OF_RANGE}.items():
                count = name.endswith(("NUM_PROCESSES", "NTASKS"))
                if kind == "zero count" and not count or kind == "past any cluster" and not count:
                    continue
                place(f"{name} {kind}", {**good, name: value}, name)
        index = [n for n in good if n.endswith("ID") and "JOB" not in n][0]
        place(f"{source}: the index past the count", {**good, index: "2"}, index, "not one of 2 processes")
    for address in ("", "h", "h:", ":1", "h:0", "h:65536", "h:1\u0661", "h:-1", " h:1234", "h:1234:5", "h/x:1234"):
        place(f"JAX_COORDINATOR_ADDRESS {address!r}", {**GOOD_PLACES["JAX"], "JAX_COORDINATOR_ADDRESS": address},
              "coordinator", "JAX_COORDINATOR_ADDRESS")
    # A SLURM step of two tasks as JAX's SLURM cluster reads it (jax._src.clusters.slurm_cluster), one
    # of its variables broken: JAX reads these itself, and spmd checks them first.
    slurm = {**GOOD_PLACES["SLURM"], "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "localhost"}
    for name, value in (("SLURM_LOCALID", "x"), ("SLURM_JOB_ID", "x"), ("SLURM_STEP_NODELIST", "")):
        place(f"SLURM: {name} {value!r}", {**slurm, name: value}, name, mesh="dp=2")
    place("SLURM: SLURM_STEP_NODELIST missing", {k: v for k, v in slurm.items() if k != "SLURM_STEP_NODELIST"},
          "SLURM_STEP_NODELIST", mesh="dp=2")
    for missing in ENV:
        place(f"JAX: {missing} missing", {k: v for k, v in GOOD_PLACES["JAX"].items() if k != missing}, missing)


_place_cases()


# ------------------------------------------------------------------------------ the inputs

def _kind(path: Path, what) -> None:
    """Make `path` what a table says: bytes, or a directory, FIFO, broken link or nothing."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if isinstance(what, bytes):
        path.write_bytes(what)
    elif what == "directory":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)  # read, it would block
    elif what == "broken":
        path.symlink_to(path.with_name("nowhere"))
    else:
        assert what == "missing", what


def _safetensors_with_nan(src: Path) -> bytes:
    """`src` with its first tensor's first float32 a NaN (a valid file, a value not finite)."""
    data = bytearray(src.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    first = next(v for k, v in header.items() if k != "__metadata__")
    assert first["dtype"] == "F32", first
    at = 8 + size + first["data_offsets"][0]
    data[at:at + 4] = np.float32(np.nan).tobytes()
    return bytes(data)


def _safetensors_without_one(src: Path) -> bytes:
    """`src`'s tensors less the first (a valid file that lacks one)."""
    data = src.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    first = next(k for k in header if k != "__metadata__")
    del header[first]
    blob, out, at = data[8 + size:], {}, 0
    body = b""
    for name, meta in header.items():
        if name == "__metadata__":
            out[name] = meta
            continue
        start, end = meta["data_offsets"]
        body += blob[start:end]
        out[name] = {**meta, "data_offsets": [at, at + end - start]}
        at += end - start
    text = json.dumps(out).encode()
    return len(text).to_bytes(8, "little") + text + body


def _inputs(tmp: Path) -> dict[str, str]:
    for name, src in FIXTURES.items():
        shutil.copytree(src, tmp / name)
    (tmp / "chat.jsonl").write_bytes((TESTS / "sft" / "chat.jsonl").read_bytes())
    (tmp / "text.txt").write_text("some text " * 100)
    (tmp / "records").mkdir()
    for i, (fmt, line) in enumerate(RECORD_LINES.values(), 1):
        (tmp / "records" / f"{i}.jsonl").write_bytes(json.dumps(GOOD[fmt]).encode() + b"\n" + line + b"\n")
    for group, table in (("templates", TEMPLATES), ("template_files", TEMPLATE_FILES)):
        for i, (text, *_) in enumerate(table.values()):
            shutil.copytree(FIXTURES["model"], tmp / group / str(i))
            _kind(tmp / group / str(i) / "chat_template.jinja", text.encode() if group == "templates" else text)
    for group, table in (("config_templates", CONFIG_TEMPLATES), ("config_files", CONFIG_FILES)):
        for i, value in enumerate(table.values()):
            shutil.copytree(FIXTURES["chatml"], tmp / group / str(i))
            config = tmp / group / str(i) / "tokenizer_config.json"
            if group == "config_files":
                config.write_bytes(value)
            else:
                config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": value[0]}))
    good_config = json.loads((FIXTURES["adapter"] / CONFIG).read_text())
    for group, table in (("adapter_configs", ADAPTER_CONFIGS), ("adapter_files", ADAPTER_FILES)):
        for i, spec in enumerate(table.values()):
            folder = tmp / group / str(i)
            folder.mkdir(parents=True)
            for file in (CONFIG, WEIGHTS):
                shutil.copyfile(FIXTURES["adapter"] / file, folder / file)
            if group == "adapter_configs":
                key, value = spec
                config = {k: v for k, v in good_config.items() if k != key or value is not KeyError}
                if value is not KeyError:
                    config[key] = value
                (folder / CONFIG).write_text(json.dumps(config))
                continue
            file, what, _ = spec
            if isinstance(what, int):
                what = (FIXTURES["adapter"] / file).read_bytes()[:what]
            elif what == "drop":
                what = _safetensors_without_one(FIXTURES["adapter"] / file)
            elif what == "nan":
                what = _safetensors_with_nan(FIXTURES["adapter"] / file)
            elif what == "twice":
                what = (FIXTURES["adapter"] / file).read_bytes().replace(b'"r": 4', b'"r": 4, "r": 4')
            _kind(folder / file, what)
    data = tmp / "data"
    for path in ("empty_folder", "with_fifo", "hidden/.secret", "mixed"):
        (data / path).mkdir(parents=True)
    os.mkfifo(data / "fifo.jsonl")
    os.mkfifo(data / "with_fifo" / "a.jsonl")
    (data / "broken.jsonl").symlink_to(data / "nowhere")
    (data / "hidden" / ".secret" / "a.txt").write_text("hidden")
    (data / "hidden" / ".b.txt").write_text("hidden")
    (data / "mixed" / "a.txt").write_text("text")
    (data / "mixed" / "b.jsonl").write_text('{"text": "text"}\n')
    for name, content in (("empty.txt", b""), ("empty.jsonl", b""), ("binary.txt", bytes(range(256))),
                          ("binary.jsonl", bytes(range(256))), ("garbage.npy", b"\x93NUMPY garbage"),
                          ("blank.jsonl", b"\n  \n\n"), ("empty_shards/a.jsonl", b""),
                          ("empty_shards/b.jsonl", b"\n"), ("after_empty/a.jsonl", b""),
                          ("after_empty/b.jsonl", json.dumps(GOOD["prompt/completion"]).encode() + b"\n"),
                          ("text.jsonl", b'{"text": "the lazy dog"}\n{"text": "jumps"}\n')):
        (data / name).parent.mkdir(exist_ok=True)
        (data / name).write_bytes(content)
    import pyarrow as pa  # (spmd[data], a test extra; imported where Parquet files are made, as tests/test_corpus.py)
    import pyarrow.parquet as pq

    for name, columns in (("empty_pc.parquet", ("prompt", "completion")), ("empty_chat.parquet", ("messages",))):
        pq.write_table(pa.table({c: pa.array([], pa.string()) for c in columns}), data / name)
    (data / "loop.jsonl").symlink_to("loop.jsonl")  # (ln -s x.jsonl x.jsonl)
    (data / "with_loop").mkdir()
    (data / "with_loop" / "a.jsonl").symlink_to("a.jsonl")
    (tmp / "model_types").mkdir()
    for i, (fixture, model_type, _) in enumerate(MODEL_TYPES.values()):
        folder = shutil.copytree(TESTS / "hf" / fixture, tmp / "model_types" / str(i))
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    bom = tmp / "bom"
    bom.mkdir()
    for name, twin in (("chat.jsonl", tmp / "chat.jsonl"), ("text.jsonl", data / "text.jsonl")):
        (bom / name).write_bytes(b"\xef\xbb\xbf" + twin.read_bytes())
    return {p.name: str(p) for p in tmp.iterdir()} | {"text": str(tmp / "text.txt"), "chat": str(tmp / "chat.jsonl")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case, each in its own empty working directory, run by one driver; no input may change."""
    inputs = tmp_path_factory.mktemp("inputs")
    files = _inputs(inputs)
    before = snapshot(inputs)
    twins = {f"{name} ({side})": (module, argv) for name, (module, *sides) in TWINS.items()
             for side, argv in zip(("itself", "its twin"), sides)}
    ran = run_cases({**{name: (c["module"], c["argv"]) for name, c in CASES.items()}, **twins}, files,
                    tmp_path_factory.mktemp("work"), timeout=900,
                    options=lambda name: {"env": CASES[name].get("env") if name in CASES else None, "limit": 60})
    assert snapshot(inputs) == before  # no input was touched
    return ran, files


def test_every_surface_is_covered():
    surfaces = {name.split(":")[0].split(" (")[0] for name in CASES}
    assert surfaces == {"records", "template", "adapter", "data", "corpus", "launch", "config.json", "variables"}, \
        surfaces
    assert {f.name for f in FIELDS} <= {key for key, _ in ADAPTER_CONFIGS.values()}
    assert set(GOOD) <= {fmt for fmt, _ in RECORD_LINES.values()}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_gives_one_error_line(results, name):
    (result, cwd), files = results[0][name], results[1]
    c = CASES[name]
    assert result["code"] == c.get("code", 2), result
    assert result["stdout"] == ""
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]
    for fragment in c["fragments"]:
        assert fragment.format(**files) in lines[0], (fragment, lines[0])
    if "either" in c:
        assert any(flag in lines[0] for flag in c["either"]), lines[0]
    assert not any(cwd.iterdir()), list(cwd.iterdir())  # nothing written
    assert result["seconds"] < c.get("within", 30), result  # bounded: a template's steps take a second or two


@pytest.mark.parametrize("name", TWINS)
def test_what_looks_wrong_and_is_not_reads_as_its_twin(results, name):
    (itself, cwd), (twin, twin_cwd) = results[0][f"{name} (itself)"], results[0][f"{name} (its twin)"]
    assert itself["code"] == twin["code"] == 0, (itself, twin)
    assert (cwd / "t.npy").read_bytes() == (twin_cwd / "t.npy").read_bytes()
