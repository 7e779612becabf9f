"""The data path under hostile input (issue #52): each case gives one `error:` line, exit
code 2 and nothing written, in seconds and small memory, where it used to hang, crash or
train on nothing.

- A chat template's work is bounded (spmd.data.chat): loops of loops, macros that call
  themselves, values and renderings too large; refused naming the template file, in
  spmd.train, spmd.corpus --seq, spmd.eval and spmd.generate --chat.
- A record is bounded before it is read or tokenized (--max-record-bytes); a data worker
  that runs out of memory under a real limit (prlimit), or is killed, is named in one
  line, and a run's last checkpoint stays where a rerun resumes.
- --data-workers is bounded by the CPUs, --seq by spmd.base.cli.SEQ.
- Pre-packed rows that spmd.corpus could not have made are refused.
- A chat_template.jinja that is a directory or a FIFO is refused, not skipped.

The command-line cases run in one driver process, one fork per case (tests/cli_driver.py).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.commands import one_error_line, run_cases, snapshot

from spmd.base.errors import UserError
from spmd.base.hardware import usable_cpus
from spmd.data import chat, stream
from spmd.data.chat import ChatTemplate
from spmd.data.corpus import epoch_order
from spmd.data.index import RecordIndex, read_examples
from spmd.data.packed_file import PackedFileSource, as_packed
from spmd.data.packing import pack
from spmd.data.records import example, fine_tuning_format
from spmd.data.stream import RecordSource, Rows
from spmd.data.tokenizer import ByteTokenizer, TokenizerDirectory, load_tokenizer_directory
from spmd.data.workers import Tokenizing
from spmd.formats.checkpoint import finalized_steps

pytestmark = pytest.mark.xdist_group("data-hardening")

SFT = Path(__file__).parent / "sft"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]
# Loops of loops: each range is bounded (100,000), their product is not.
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
WIDE = "{% for i in range(100000) %}{{ 'x' * 500 }}{% endfor %}"  # 50 MB rendered for every record
HUGE = {"messages": [{"role": "user", "content": "x" * 9_000_000}, {"role": "assistant", "content": "y"}]}
HUGE_LINE = f"{len(json.dumps(HUGE)):,} bytes, more than --max-record-bytes 8,388,608"
TRAIN = ["--mesh", "dp=1", "--batch", "2", "--seq", "32", "--steps", "1"]


def _model_with_template(folder: Path, template: str | None = None) -> Path:
    """A copy of the fixture's model (its tokenizer too) with `template` as chat_template.jinja."""
    shutil.copytree(SFT / "model", folder)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def _packed_rows() -> np.ndarray:
    """chat.jsonl as spmd.corpus --seq 32 packs it."""
    packing = pack(read_examples(str(SFT / "chat.jsonl"), TokenizerDirectory(SFT / "model")), 33)
    return as_packed(packing.batch(range(packing.rows)))


# ------------------------------------------------------------------ the commands, in one driver

# name -> (module, argv, fragment of the one error line). {names} are the fixture's files.
CASES = {
    "train: a template that loops forever": (
        "spmd.train", ["--init-from", "{forever}", "--data", "{chat}", *TRAIN],
        "the chat template (--tokenizer {forever}/chat_template.jinja) takes more than 5,000,000 steps"),
    "corpus --seq: a template that loops forever": (
        "spmd.corpus", ["--data", "{chat}", "--tokenizer", "{forever}", "--seq", "32", "--out", "t.npy"],
        "the chat template (--tokenizer {forever}/chat_template.jinja) takes more than 5,000,000 steps"),
    "eval: a template that loops forever": (
        "spmd.eval", ["--init-from", "{forever}", "--data", "{chat}", "--seq", "32"],
        "the chat template (--tokenizer {forever}/chat_template.jinja) takes more than 5,000,000 steps"),
    "generate --chat: a template that loops forever": (
        "spmd.generate", ["--init-from", "{forever}", "--chat", "--prompt", "hi"],
        "--chat: the chat template (--tokenizer {forever}/chat_template.jinja) takes more than 5,000,000 steps"),
    "train: a template rendering 50 MB a record": (
        "spmd.train", ["--init-from", "{wide}", "--data", "{chat}", *TRAIN],
        "chat_template.jinja) renders more than 8,388,608 characters (--max-record-bytes)"),
    "corpus --seq: a template rendering 50 MB a record": (
        "spmd.corpus", ["--data", "{chat}", "--tokenizer", "{wide}", "--seq", "32", "--out", "t.npy"],
        "chat_template.jinja) renders more than 8,388,608 characters (--max-record-bytes)"),
    "train: a record beyond a lowered --max-record-bytes": (
        "spmd.train", ["--init-from", "{model}", "--data", "{chat}", "--max-record-bytes", "50", *TRAIN],
        "chat.jsonl, line 1: 101 bytes, more than --max-record-bytes 50 "),
    "train: a record beyond --max-record-bytes": (
        "spmd.train", ["--init-from", "{model}", "--data", "{huge}", *TRAIN], f"huge.jsonl, line 2: {HUGE_LINE}"),
    "corpus --seq: a record beyond --max-record-bytes": (
        "spmd.corpus", ["--data", "{huge}", "--tokenizer", "{model}", "--seq", "32", "--out", "t.npy"],
        f"huge.jsonl, line 2: {HUGE_LINE}"),
    "eval: a first record beyond --max-record-bytes": (
        "spmd.eval", ["--init-from", "{model}", "--data", "{huge_first}", "--seq", "32"],
        f"huge_first.jsonl, line 1: {HUGE_LINE}"),
    "train: data workers beyond the CPUs": (
        "spmd.train", ["--data-workers", "10000", *TRAIN],
        f"--data-workers 10000 is more than the {usable_cpus()} CPUs this process may use"),
    "corpus: seq beyond the bound": (
        "spmd.corpus", ["--data", "{chat}", "--tokenizer", "{model}", "--seq", "1000000000", "--out", "t.npy"],
        "--seq must be at least 1 and at most 16777216, got 1000000000"),
    "train: seq beyond the bound": ("spmd.train", [*TRAIN, "--seq", "1000000000"],
                                    "--seq must be at least 1 and at most 16777216, got 1000000000"),
    "train: pre-packed rows with a negative token id": (
        "spmd.train", ["--init-from", "{model}", "--data", "{negative}", *TRAIN],
        "negative.npy: row 0 holds a negative token id"),
    "train: pre-packed rows of segment 0": (
        "spmd.train", ["--init-from", "{model}", "--data", "{unsegmented}", *TRAIN],
        "unsegmented.npy: row 0 does not start with segment 1"),
    "train: pre-packed rows without a target": (
        "spmd.train", ["--init-from", "{model}", "--data", "{untargeted}", *TRAIN],
        "untargeted.npy: no target tokens (loss_mask) in its 8 training row(s)"),
    "train: chat_template.jinja a directory": (
        "spmd.train", ["--init-from", "{template_dir}", "--data", "{chat}", *TRAIN],
        "--tokenizer {template_dir}/chat_template.jinja is a directory, not a file"),
    "corpus --seq: chat_template.jinja a FIFO": (
        "spmd.corpus", ["--data", "{chat}", "--tokenizer", "{template_fifo}", "--seq", "32", "--out", "t.npy"],
        "--tokenizer {template_fifo}/chat_template.jinja is a FIFO, not a file"),
    "generate --chat: chat_template.jinja a FIFO": (
        "spmd.generate", ["--init-from", "{template_fifo}", "--chat", "--prompt", "hi"],
        "--tokenizer {template_fifo}/chat_template.jinja is a FIFO, not a file"),
}


def _inputs(tmp: Path) -> dict[str, str]:
    (tmp / "huge.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps(HUGE) + "\n")
    (tmp / "huge_first.jsonl").write_text(json.dumps(HUGE) + "\n" + json.dumps({"messages": CHAT}) + "\n")
    rows = _packed_rows()
    for name, spoil in (("negative", lambda r: r["tokens"].__setitem__((0, 1), -5)),
                        ("unsegmented", lambda r: r["segments"].__setitem__(slice(None), 0)),
                        ("untargeted", lambda r: r["loss_mask"].__setitem__(slice(None), False))):
        spoiled = rows.copy()
        spoil(spoiled)
        np.save(tmp / f"{name}.npy", spoiled)
    _model_with_template(tmp / "forever", FOREVER)
    _model_with_template(tmp / "wide", WIDE)
    (_model_with_template(tmp / "template_dir") / "chat_template.jinja").mkdir()
    os.mkfifo(_model_with_template(tmp / "template_fifo") / "chat_template.jinja")  # read, it would block
    names = {name: str(tmp / name) for name in ("forever", "wide", "template_dir", "template_fifo")}
    names |= {name: str(tmp / f"{name}.jsonl") for name in ("huge", "huge_first")}
    names |= {name: str(tmp / f"{name}.npy") for name in ("negative", "unsegmented", "untargeted")}
    return names | {"chat": str(SFT / "chat.jsonl"), "model": str(SFT / "model")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case, each in its own empty working directory, run by one driver; the inputs
    must be untouched."""
    inputs = tmp_path_factory.mktemp("inputs")
    files = _inputs(inputs)
    before = snapshot(inputs)
    cases = run_cases(CASES, files, tmp_path_factory.mktemp("work"), timeout=600)
    return cases, files, before == snapshot(inputs)


def test_bad_data_touches_no_input(results):
    assert results[2]


@pytest.mark.parametrize("case", CASES)
def test_bad_data_gives_one_error_line_exit_2_and_writes_nothing(results, case):
    (result, cwd), files = results[0][case], results[1]
    assert result["code"] == 2, result
    assert result["stdout"] == ""
    line = one_error_line(result["stderr"])
    assert CASES[case][2].format(**files) in line, line
    assert not any(cwd.iterdir()), list(cwd.iterdir())
    assert result["seconds"] < 60, result  # bounded: a second or two of a template's steps at most


# ------------------------------------------------------------------ chat templates

@pytest.fixture
def few_steps(monkeypatch):
    """A rendering's bound lowered (the commands above run the real one), for speed."""
    monkeypatch.setattr(chat, "MAX_STEPS", 100_000)


@pytest.mark.parametrize("template", [
    FOREVER,
    # A macro that calls itself twice: 2**60 calls, no loop at all.
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    # A loop inside a loop's recursion: each level's items are counted.
    "{% for x in [[1] * 100000] recursive %}{{ loop(x) if x is iterable else '' }}{% endfor %}",
    # A string grown in a namespace: its reads count by their size.
    "{% set ns = namespace(s='x' * 4000) %}{% for i in range(100000) %}{% set ns.s = ns.s[1:] ~ 'y' %}{% endfor %}",
    # Loops over the messages, read again and again.
    "{% for i in range(1000) %}{% for m in messages %}{% for n in messages %}{{ '' }}{% endfor %}{% endfor %}"
    "{% endfor %}",
], ids=["loops of loops", "macro recursion", "recursive loop", "growing namespace", "message loops"])
def test_a_templates_work_is_bounded(few_steps, template):
    rendering = ChatTemplate(template, "--tokenizer tok/chat_template.jinja")
    started = time.monotonic()
    with pytest.raises(UserError) as info:
        rendering.render(CHAT * 10, {}, "--data d.jsonl, line 3")
    assert str(info.value) == ("--data d.jsonl, line 3: the chat template (--tokenizer tok/chat_template.jinja) takes "
                               "more than 100,000 steps (loop items, reads, calls) in one rendering; a template's "
                               "work is bounded")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("template,message", [
    ("{{ 'x' * 1000000000 }}", "reaches a value of 1,000,000,000 characters (or items), more than the 1,000 a "
                               "rendering may hold (--max-record-bytes)"),
    ("{{ [0] * 1000000000 }}", "reaches a value of 1,000,000,000 characters"),
    ("{{ 10 ** 1000000000 }}", "computes a power of more than 65,536 bits (10 ** 1000000000)"),
    ("{% for m in messages %}{{ m.content * 10 }}{% endfor %}",
     "renders more than 1,000 characters (--max-record-bytes)"),
])
def test_a_templates_values_and_text_are_bounded(template, message):
    with pytest.raises(UserError, match=re.escape(message)):
        ChatTemplate(template, "t").render(CHAT * 10, {}, "w", max_chars=1000)
    # Within the bounds, the same operators work.
    assert ChatTemplate("{{ 'ab' * 2 }}{{ [1] * 2 }}{{ 2 ** 10 }}", "t").render([], {}, "w")[0] == "abab[1, 1]1024"


def test_a_template_that_is_no_regular_file_is_refused(tmp_path):
    for kind, make in (("a directory", Path.mkdir), ("a FIFO", os.mkfifo),
                       ("a broken symbolic link", lambda path: path.symlink_to("nowhere"))):
        folder = _model_with_template(tmp_path / kind.split()[-1])
        make(folder / "chat_template.jinja")
        with pytest.raises(UserError, match=rf"^--tokenizer {folder}/chat_template.jinja is {kind}, not a file$"):
            load_tokenizer_directory(str(folder))


# ------------------------------------------------------------------ records

def test_a_records_text_is_bounded_before_it_is_tokenized(tmp_path):
    with pytest.raises(UserError, match=r"^w: 100 characters of text, more than --max-record-bytes 50 "):
        example({"text": "x" * 100}, "w", ByteTokenizer(), max_record_bytes=50)
    with pytest.raises(UserError, match=r"^w: 60 characters of prompt and completion, more than --max-record-bytes 50"):
        example({"prompt": "x" * 30, "completion": "y" * 30}, "w", ByteTokenizer(), max_record_bytes=50)
    assert example({"text": "x" * 50}, "w", ByteTokenizer(), max_record_bytes=50).ids.size == 51
    # A first line beyond the bound is counted to its end, not held: its size is said.
    line = json.dumps({"prompt": "p" * 5000, "completion": "c"})
    (tmp_path / "long.jsonl").write_text(line + "\n" + line + "\n")
    with pytest.raises(UserError, match=rf"long.jsonl, line 1: {len(line):,} bytes, more than --max-record-bytes 1,"):
        fine_tuning_format(str(tmp_path / "long.jsonl"), 1000)
    assert fine_tuning_format(str(tmp_path / "long.jsonl"), len(line)) == "prompt/completion"


def test_a_record_beyond_the_bound_stops_training_when_it_is_reached(tmp_path, monkeypatch):
    """A worker process reads the next windows ahead: a record over its bound there fails
    when its window is reached, as a bad record does, not while the windows before train."""
    monkeypatch.setattr(stream, "WINDOW", 16)
    records = [{"prompt": f"question {i}", "completion": "an answer"} for i in range(64)]
    records[40]["prompt"] = "long " * 100
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # 57 training examples (7 held out); a seed that puts record 40 in the second training
    # window, which is read ahead as the first is packed.
    seed = next(s for s in range(100) if 40 in epoch_order(s, 0, 57)[16:32])
    tokenizer = TokenizerDirectory(SFT / "model")
    tokenizing = Tokenizing(tokenizer, str(SFT / "model"), "completion", 1, 300)
    try:
        source = RecordSource(RecordIndex(str(tmp_path / "pc.jsonl"), 300), tokenizing,
                              Rows(33, batch=2, seed=seed, eval_fraction=0.1))
        assert source.rows(0, 0, 2, 33)["loss_mask"].any()
        # In order, the rows of windows 0 and 1 come, then record 40's window stops them.
        before = sum(pack([example(r, "", tokenizer) for r in records[w:w + 16]], 33).rows for w in (0, 16))
        with pytest.raises(UserError) as info:
            for j in range(before):
                source.rows(j, 0, 2, 33, "in order")
        assert 2 * j <= before < 2 * j + 2
    finally:
        tokenizing.close()
    assert str(info.value).startswith(f"--data {tmp_path / 'pc.jsonl'}, line 41: {len(json.dumps(records[40])):,} "
                                      f"bytes, more than --max-record-bytes 300 ")


def _data_workers(pid: int) -> list[int]:
    """The data worker processes of process `pid` (multiprocessing's spawned children, not its resource tracker)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            parent = re.search(r"^PPid:\s+(\d+)$", status.read_text(), re.M)
            command = (status.parent / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if parent and int(parent[1]) == pid and b"spawn_main" in command:
            found.append(int(status.parent.name))
    return found


def test_a_killed_data_worker_ends_the_run_in_one_line_and_the_rerun_resumes(tmp_path):
    run = tmp_path / "run"
    flags = ["--init-from", str(SFT / "model"), "--data", str(SFT / "chat.jsonl"), "--mesh", "dp=1", "--batch", "2",
             "--seq", "32", "--log-every", "1", "--out", str(run), "--save-every", "3"]
    proc = subprocess.Popen([sys.executable, "-m", "spmd.train", *flags, "--steps", "100000", "--data-workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not re.match(r"\[\s*4/", proc.stdout.readline()):  # step 3 is saved (or saving)
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        (worker,) = _data_workers(proc.pid)
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2, err
    found = re.fullmatch(rf"error: data worker 1 of 1 \(pid {worker}\) was killed by SIGKILL \(out of memory, or "
                         rf"killed by hand\?\); .*; last checkpoint: {run}/(\d+) \(a rerun resumes there\)",
                         one_error_line(err))
    assert found, err
    step = int(found[1])
    assert step >= 3 and finalized_steps(run)[-1] == step
    again = subprocess.run([sys.executable, "-m", "spmd.train", *flags, "--steps", str(step + 1),
                            "--resume-with-changes", "--data-workers", "0"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run / str(step)}" in again.stdout
    assert finalized_steps(run)[-1] == step + 1


@pytest.mark.parametrize("records", [1, stream.WINDOW + 1])  # tokenized by the trainer's process, by a worker
def test_a_huge_record_is_refused_before_it_is_tokenized_whatever_the_bound(tmp_path, records):
    """Under a real address-space limit (1 GB): a 9 MB record is refused by the default
    bound before it is read; with the bound raised, it is refused before it is tokenized
    (some 3 GB, which would abort the process without a word: SIGABRT, nothing printed),
    naming the record and the memory, in the trainer's process or a data worker's."""
    rows = [{"prompt": f"question {i}", "completion": "an answer"} for i in range(records - 1)]
    rows.append({"prompt": "word " * 1_800_000, "completion": "ok"})
    (tmp_path / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    size = len(json.dumps(rows[-1]))
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # under the limit whatever the CPUs
    command = ["prlimit", "--as=1000000000", sys.executable, "-m", "spmd.corpus", "--data", "big.jsonl",
               "--tokenizer", str(SFT / "model"), "--seq", "32", "--out", "t.npy"]
    refused = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and refused.stdout == ""
    assert one_error_line(refused.stderr) == (
        f"error: --data big.jsonl, line {records}: {size:,} bytes, more than --max-record-bytes 8,388,608 (a record "
        "is tokenized whole, in up to 512 times its size of memory: 4.3 GiB); give a larger bound to read it where "
        "that much memory is free")
    raised = subprocess.run(command + ["--max-record-bytes", "10000000"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=env)
    assert raised.returncode == 2 and raised.stdout == ""
    line = one_error_line(raised.stderr)
    assert re.fullmatch(rf"error: --data big.jsonl, line {records}: tokenizing its 9,000,002 bytes of text takes up to "
                        r"4.3 GiB of memory, and this process has [0-9.]+ MiB free; split it into smaller records, or "
                        r"tokenize it where more memory is free \(--max-record-bytes refuses such records before they "
                        r"are read\)", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_a_huge_document_of_text_is_refused_before_it_is_tokenized(tmp_path):
    """Text data is tokenized in batches, each checked against the memory free (here 1 GB of
    address space): a 9 MB document would take some 3 GB and abort the process silently."""
    (tmp_path / "doc.txt").write_text("word " * 1_800_000)
    command = ["prlimit", "--as=1000000000", sys.executable, "-m", "spmd.corpus", "--data", "doc.txt", "--tokenizer",
               str(SFT / "model" / "tokenizer.json"), "--out", "t.npy"]
    refused = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env=os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert refused.returncode == 2 and refused.stdout == ""
    line = one_error_line(refused.stderr)
    assert re.fullmatch(r"error: --data doc.txt: tokenizing its 9,000,000 bytes of text takes up to 4.3 GiB of memory, "
                        r"and this process has [0-9.]+ MiB free; make token files \(.npy\) of it with python -m "
                        r"spmd.corpus on a larger host, or give less text", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]


# ------------------------------------------------------------------ pre-packed rows

@pytest.mark.parametrize("spoil,message", [
    (lambda r: r["tokens"].__setitem__((2, 3), -1), "row 2 holds a negative token id"),
    (lambda r: r["tokens"].__setitem__((2, 3), 408), "row 2 holds a token id outside the model's vocabulary of 408"),
    (lambda r: r["segments"].__setitem__(2, -1), "row 2 does not start with segment 1"),
    (lambda r: r["segments"].__setitem__((2, 0), 0), "row 2 does not start with segment 1"),
    (lambda r: r["segments"].__setitem__((2, slice(5, None)), 3), "row 2 numbers its segments out of order"),
    (lambda r: r["segments"].__setitem__((2, -1), 9), "row 2 numbers its segments out of order"),
    (lambda r: r["loss_mask"].__setitem__((2, 0), True), "row 2 has a target on a segment's first token"),
    (lambda r: r["loss_mask"].__setitem__(slice(None), False), "no target tokens (loss_mask) in its 8 training row(s)"),
], ids=["negative token", "token beyond the vocabulary", "negative segment", "segment 0 first", "segments skipping",
        "segment after padding", "target on a segment's start", "no target"])
def test_pre_packed_rows_that_no_packing_makes_are_refused(spoil, message):
    rows = _packed_rows()
    PackedFileSource(rows, 33, 2, 0, name="p.npy", vocab=408)  # as spmd.corpus made them: accepted
    spoil(rows)
    with pytest.raises(UserError, match=rf"^--data p.npy: {re.escape(message)}"):
        PackedFileSource(rows, 33, 2, 0, name="p.npy", vocab=408)


def test_held_out_pre_packed_rows_without_a_target_are_refused():
    rows = _packed_rows()
    rows["loss_mask"][-1] = False
    with pytest.raises(UserError, match="no target tokens in the held-out examples"):
        PackedFileSource(rows, 33, 2, 0, eval_fraction=0.1, name="p.npy", vocab=408)


@pytest.mark.parametrize("data", ["text", "records"])
def test_an_evaluation_reads_no_more_than_the_held_out_data(tmp_path, data):
    """--eval-batches a million over a few held-out windows (or records): each evaluation
    reads what is held out, once, and the run ends (it used to take as long as asked)."""
    if data == "text":
        (tmp_path / "d.txt").write_text("some words of text, " * 400)
        flags = ["--data", str(tmp_path / "d.txt")]
    else:
        flags = ["--data", str(SFT / "chat.jsonl"), "--init-from", str(SFT / "model")]
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "spmd.train", *TRAIN, "--steps", "2", *flags, "--eval-every", "1",
                           "--eval-batches", "1000000", "--log-every", "1", "--metrics-file", str(metrics)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    losses = [json.loads(line).get("eval_loss") for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(loss) for loss in losses), losses
