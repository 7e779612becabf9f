"""Fine-tuning records: token ids and loss masks equal what transformers and TRL make
(tests/sft/goldens.json, by tests/sft/make_goldens.py); JSONL, Parquet and a datasets
folder read alike; packed rows hold every example once, in segments that start with no
target; bad records are refused naming the file and the line or row."""

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from spmd.base.errors import UserError
from spmd.data.chat import ChatTemplate
from spmd.data.corpus import TokenSource
from spmd.data import stream
from spmd.data.index import RecordIndex, read_examples
from spmd.data.packing import best_fit_decreasing, pack, positions
from spmd.data.records import Example, example, fine_tuning_format, text_examples
from spmd.data.stream import RecordSource, Rows
from spmd.data.tokenizer import ByteTokenizer, TokenizerDirectory, load_tokenizer, load_tokenizer_directory
from spmd.data.workers import Tokenizing

SFT = Path(__file__).parent / "sft"
GOLDENS = json.loads((SFT / "goldens.json").read_text())
CASES = [(name, i) for name, g in GOLDENS.items() for i in range(len(g["records"]))]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"}]
RECORDS = [{"messages": CHAT}, {"messages": CHAT[1:] + [{"role": "user", "content": "é?"},
                                                         {"role": "assistant", "content": "oui 🐱"}]}]


@pytest.fixture(scope="module")
def tokenizers():
    return {name: TokenizerDirectory(SFT / name) for name in ("chatml", "llama")}


def tokenizer_for(tokenizers, name):
    golden = GOLDENS[name]
    tok = tokenizers[golden.get("directory", name)]
    if "chat_template" in golden:  # the same tokenizer with another template (a copy: the fixture is shared)
        tok = TokenizerDirectory(tok.path)
        tok.chat_template = ChatTemplate(golden["chat_template"], "goldens.json")
    return tok


@pytest.mark.parametrize("name,index", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_ids_and_loss_equal_transformers_and_trl(tokenizers, name, index):
    golden = GOLDENS[name]["records"][index]
    got = example(golden["record"], "golden", tokenizer_for(tokenizers, name))
    assert got.ids.dtype == np.int32 and got.loss.dtype == bool
    assert got.ids.tolist() == golden["input_ids"]
    assert got.loss.astype(int).tolist() == golden["loss"]
    everything = example(golden["record"], "golden", tokenizer_for(tokenizers, name), loss_on="all")
    assert everything.ids.tolist() == golden["input_ids"] and everything.loss.all()


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_a_published_template_is_swapped_for_training_by_its_exact_text_alone(tokenizers, name):
    """Chat records train through spmd's variant of a published template TRL knows (the
    goldens above); one more character, and the template is some other one, rendered as
    written (Qwen3: no thinking block before the last query)."""
    golden = GOLDENS[name]
    record, published = golden["records"][1], golden["chat_template"]
    tok = tokenizer_for(tokenizers, name)
    tok.chat_template = ChatTemplate(published + "\n", "edited")
    edited = example(record["record"], "", tok)
    assert (edited.ids.tolist(), edited.loss.astype(int).tolist()) != (record["input_ids"], record["loss"])


@pytest.mark.parametrize("name", ["chatml", "llama"])
def test_special_tokens_as_transformers_reads_them(tokenizers, name):
    """Legacy special_tokens_map.json counts only without added_tokens_decoder; a special
    token tokenizer.json lacks (<|pad|>) is added after the vocabulary; every "*_token" is
    a template variable."""
    tok, golden = tokenizers[name], GOLDENS[name]
    assert tok.special_tokens == golden["special_tokens"]
    assert {t: tok.token_id(t) for t in golden["ids"]} == golden["ids"]
    assert tok.vocab_size == golden["vocab"]
    assert tok.eos == golden["ids"][golden["special_tokens"]["eos_token"]]


def test_tokenizer_json_truncation_is_not_applied(tmp_path, tokenizers):
    """transformers encodes whole texts whatever tokenizer.json's truncation and padding say."""
    settings = json.loads((SFT / "chatml" / "tokenizer.json").read_text())
    settings["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    shutil.copytree(SFT / "chatml", tmp_path / "chatml")
    (tmp_path / "chatml" / "tokenizer.json").write_text(json.dumps(settings))
    record = {"prompt": "What is the capital of France?", "completion": " Paris."}
    got = example(record, "", load_tokenizer_directory(str(tmp_path / "chatml")))
    assert got.ids.tolist() == example(record, "", tokenizers["chatml"]).ids.tolist() and got.ids.size > 4


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_jsonl_parquet_and_datasets_folders_read_alike(tmp_path, tokenizers):
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    tok = tokenizers["chatml"]
    want = [example(r, "", tok) for r in RECORDS]
    write_jsonl(tmp_path / "chats.jsonl", RECORDS)
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    for path in ("chats.jsonl", "chats.parquet", "saved"):
        got = read_examples(str(tmp_path / path), tok)
        assert [(g.ids.tolist(), g.loss.tolist()) for g in got] == [(w.ids.tolist(), w.loss.tolist()) for w in want]
    datasets.DatasetDict(train=datasets.Dataset.from_list(RECORDS)).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(UserError, match=r"several splits .*splits/train"):
        read_examples(str(tmp_path / "splits"), tok)


def test_corpus_packs_a_datasets_folder_as_it_packs_the_same_records_in_jsonl(tmp_path):
    """spmd.corpus --seq reads what spmd.train reads: a `save_to_disk` folder; a
    DatasetDict is refused in one line naming its splits' folders."""
    import subprocess
    import sys

    datasets = pytest.importorskip("datasets")
    records = [json.loads(line) for line in (SFT / "chat.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(records)).save_to_disk(str(tmp_path / "splits"))

    def corpus(data, out):
        return subprocess.run([sys.executable, "-m", "spmd.corpus", "--data", str(data), "--tokenizer",
                               str(SFT / "model"), "--seq", "64", "--out", str(out)], capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).parents[1])

    for data, out in ((SFT / "chat.jsonl", tmp_path / "jsonl.npy"), (tmp_path / "saved", tmp_path / "saved.npy")):
        assert corpus(data, out).returncode == 0
    np.testing.assert_array_equal(np.load(tmp_path / "saved.npy"), np.load(tmp_path / "jsonl.npy"))
    refused = corpus(tmp_path / "splits", tmp_path / "splits.npy")
    assert refused.returncode == 2 and not (tmp_path / "splits.npy").exists()
    assert refused.stderr.strip() == (f"error: --data {tmp_path / 'splits'} holds several splits (a DatasetDict); "
                                      f"give one split's folder: {tmp_path / 'splits' / 'train'}")


def test_a_null_message_field_is_no_field(tmp_path, tokenizers):
    """A Parquet column of message structs gives every message every field (null where a
    message has none): null fields are dropped before rendering, as transformers does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": [dict(m, name="bob" if m["role"] == "user" else None) for m in CHAT]}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet")
    got = read_examples(str(tmp_path / "chats.parquet"), tokenizers["chatml"])[0]
    assert got.ids.tolist() == example({"messages": CHAT}, "", tokenizers["chatml"]).ids.tolist()


def test_text_and_prompt_completion_with_a_tokenizer_file():
    """Without a directory (here: bytes), a document or a completion ends with the end-of-text id."""
    tok = ByteTokenizer()
    docs = list(text_examples(["ab", "", "c"], tok))
    assert [d.ids.tolist() for d in docs] == [[97, 98, 0], [99, 0]] and all(d.loss.all() for d in docs)
    got = example({"prompt": "ab", "completion": "c"}, "", tok)
    assert got.ids.tolist() == [97, 98, 99, 0] and got.loss.tolist() == [False, False, True, True]


def bad(tmp_path, records, tokenizer, name="bad.jsonl"):
    lines = [json.dumps(r) if not isinstance(r, str) else r for r in records]
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as info:
        read_examples(str(tmp_path / name), tokenizer)
    return str(info.value)


def chat(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


@pytest.mark.parametrize("record,message", [
    ({"id": 3, "answer": "x"}, r"no known fields .*has answer, id"),
    ({"prompt": "only a prompt"}, r"no known fields .*has prompt\)"),
    (chat(("user", "hi"), ("robot", "beep")), r"messages\[1\] has role 'robot'; roles are system, user, assistant"),
    (chat(("system", "s"), ("user", "hi")), r"no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["a", "list"]}]},
     r"messages\[1\]\.content is an array, not a string"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
     r"messages\[1\]\.content is null, not a string"),
    ({"messages": []}, r"messages is an empty list"),
    ({"messages": "hi"}, r"messages is a string, not a list of messages"),
    ({"prompt": "a", "completion": 7}, r"completion is a number, not a string"),
    ({"text": "\ud800"}, r"text holds a lone surrogate"),
    ('{"text": "a", "text": "b"}', r"text: is given twice"),
    ("[1, 2]", r"not a JSON object"),
])
def test_bad_records_name_the_file_and_line(tmp_path, tokenizers, record, message):
    first = ({"text": "fine"} if "text" in str(record) else {"prompt": "p", "completion": "c"}
             if "completion" in str(record) else chat(("user", "a"), ("assistant", "b")))  # a good line first
    text = bad(tmp_path, [first, record], tokenizers["chatml"])
    assert text.startswith(f"--data {tmp_path / 'bad.jsonl'}, line 2: ")
    assert re.search(message, text), text


def test_one_file_holds_one_format(tmp_path, tokenizers):
    text = bad(tmp_path, [{"text": "a"}, {"text": "b"}, {"prompt": "p", "completion": "c"}], tokenizers["chatml"])
    assert text == (f"--data {tmp_path / 'bad.jsonl'}, line 3: a prompt/completion record in a file of text "
                    f"records (--data {tmp_path / 'bad.jsonl'}, line 1); one file holds one format")


def test_chat_needs_a_template(tmp_path, tokenizers):
    record = chat(("user", "a"), ("assistant", "b"))
    assert bad(tmp_path, [record], ByteTokenizer()) == (
        f"--data {tmp_path / 'bad.jsonl'}, line 1: chat records need a chat template, and --tokenizer bytes has "
        f"none (chat_template.jinja, or chat_template in tokenizer_config.json)")
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(SFT / "chatml" / "tokenizer.json", plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    text = bad(tmp_path, [record], load_tokenizer_directory(str(plain)))
    assert text.startswith(f"--data {tmp_path / 'bad.jsonl'}, line 1: chat records need a chat template, "
                           f"and --tokenizer {plain} has none")


def test_a_failing_template_says_why(tmp_path, tokenizers):
    tok = TokenizerDirectory(tokenizers["chatml"].path)
    tok.chat_template = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}"
                                     "{{ raise_exception('System role not supported') }}{% endif %}"
                                     "{{ m.content }}{% endfor %}", "a template")
    text = bad(tmp_path, [chat(("user", "a"), ("assistant", "b")), chat(("system", "s"), ("assistant", "b"))], tok)
    assert text == (f"--data {tmp_path / 'bad.jsonl'}, line 2: the chat template (a template) fails: "
                    f"System role not supported")
    with pytest.raises(UserError, match=r"--tokenizer x: the chat template does not compile"):
        ChatTemplate("{% for %}", "--tokenizer x")


def test_parquet_rows_are_named(tmp_path, tokenizers):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([chat(("user", "a"), ("assistant", "b")), chat(("user", "a"))]),
                   tmp_path / "chats.parquet")
    with pytest.raises(UserError, match=rf"^--data {tmp_path / 'chats.parquet'}, row 1: messages have no assistant"):
        read_examples(str(tmp_path / "chats.parquet"), tokenizers["chatml"])


def test_token_files_hold_no_records(tmp_path, tokenizers):
    np.save(tmp_path / "t.npy", np.zeros(4, np.uint16))
    with pytest.raises(UserError, match="token files hold no records"):
        read_examples(str(tmp_path / "t.npy"), tokenizers["chatml"])


# ------------------------------------------------------------------ packing

def random_examples(count: int, longest: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        size = int(rng.integers(1, longest + 1))
        out.append(Example(rng.integers(1, 1000, size).astype(np.int32), rng.random(size) < 0.7))
    return out


def segments_of(rows: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each segment's (tokens, loss), row after row."""
    found = []
    for tokens, segments, loss in zip(rows["tokens"], rows["segments"], rows["loss_mask"]):
        for s in range(1, segments.max() + 1):
            found.append((tokens[segments == s], loss[segments == s]))
    return found


def check_rows(rows: dict, length: int) -> None:
    tokens, segments, loss = rows["tokens"], rows["segments"], rows["loss_mask"]
    assert tokens.dtype == segments.dtype == np.int32 and loss.dtype == bool and tokens.shape[1] == length
    for seg in segments:
        used = seg[seg > 0]
        assert (np.diff(used) >= 0).all() and (np.diff(used) <= 1).all() and used[0] == 1  # 1, 1, 2, 2, 2, 3, ...
        assert (seg[used.size:] == 0).all()  # padding only at the end
    assert (tokens[segments == 0] == 0).all() and not loss[segments == 0].any()
    starts = positions(segments) == 0
    assert not loss[starts].any()  # no segment's first token is a target
    pos = positions(segments)
    for row_seg, row_pos in zip(segments, pos):
        for s in range(1, row_seg.max() + 1):
            assert row_pos[row_seg == s].tolist() == list(range((row_seg == s).sum()))


@pytest.mark.parametrize("overlong", ["truncate", "split"])
def test_every_example_appears_once_in_segments_that_start_with_no_target(overlong):
    length = 32
    examples = random_examples(300, 80)
    packed = pack(examples, length, overlong)
    rows = packed.batch(range(packed.rows))
    check_rows(rows, length)
    want = []
    for ids, loss in examples:
        cuts = [0] if overlong == "truncate" else range(0, ids.size, length)
        for c in cuts:
            piece, mask = ids[c:c + length], loss[c:c + length].copy()
            mask[0] = False
            if mask.any():
                want.append((tuple(piece.tolist()), tuple(mask.tolist())))
    got = [(tuple(t.tolist()), tuple(m.tolist())) for t, m in segments_of(rows)]
    assert Counter(got) == Counter(want)
    over = sum(e.ids.size > length for e in examples)
    assert (packed.truncated, packed.split) == ((over, 0) if overlong == "truncate" else (0, over))
    dropped = sum(1 for e in examples for c in ([0] if overlong == "truncate" else range(0, e.ids.size, length))
                  if not e.loss[c + 1:c + length].any())
    assert packed.dropped == dropped and packed.targets == rows["loss_mask"].sum()
    assert rows["segments"].astype(bool).sum() >= 0.9 * packed.rows * length  # best fit leaves little padding


def test_best_fit_decreasing_is_deterministic_and_keeps_order():
    assert best_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert best_fit_decreasing([8, 1, 8], 8) == [[0], [1], [2]]
    sizes = [int(s) for s in np.random.default_rng(1).integers(1, 50, 500)]
    bins = best_fit_decreasing(sizes, 64)
    assert bins == best_fit_decreasing(sizes, 64) and sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(sizes[i] for i in b) <= 64 and b == sorted(b) for b in bins)


def test_no_target_tokens_is_refused():
    examples = [Example(np.arange(1, 5, dtype=np.int32), np.array([True, False, False, False]))]
    with pytest.raises(UserError, match="no target tokens: none of its 1 example"):
        pack(examples, 8)
    with pytest.raises(UserError, match="within its first 2 tokens"):
        pack([Example(np.arange(1, 5, dtype=np.int32), np.array([False, False, True, True]))], 2)


def pc_records(count: int, seed: int = 0) -> list[dict]:
    """Prompt/completion records of 1 to 12 words each."""
    rng = np.random.default_rng(seed)
    say = lambda: " ".join(rng.choice(["a", "word", "of", "the", "text", "é"], int(rng.integers(1, 13))))  # noqa: E731
    return [{"prompt": say(), "completion": say()} for _ in range(count)]


def streamed(path: Path, tokenizers, workers: int = 0, seed: int = 7, eval_fraction: float = 0.1) -> RecordSource:
    tokenizing = Tokenizing(tokenizers["chatml"], str(SFT / "chatml"), "completion", workers)
    return RecordSource(RecordIndex(str(path)), tokenizing, Rows(33, batch=8, seed=seed, eval_fraction=eval_fraction),
                        name="pc", tokenizer="chatml")


def pieces(examples) -> Counter:
    """Each example as packing makes it: no target on its first token; none without a target."""
    out = Counter()
    for e in examples:
        loss = e.loss[:33].copy()
        loss[0] = False
        if loss.any():
            out[(tuple(e.ids[:33].tolist()), tuple(loss.tolist()))] += 1
    return out


def as_counter(rows: dict) -> Counter:
    return Counter((tuple(t.tolist()), tuple(m.tolist())) for t, m in segments_of(rows))


def test_records_stream_by_step_whatever_the_processes_and_resume(tmp_path, tokenizers, monkeypatch):
    """200 records (blank lines between some) in windows of 16: every training example
    once an epoch, rows by step whatever the split of the batch, the same rows from
    worker processes, after a resume from a saved position, and held-out rows once each."""
    monkeypatch.setattr(stream, "WINDOW", 16)
    lines = [json.dumps(r) for r in pc_records(200)]
    (tmp_path / "pc.jsonl").write_text("\n".join(line + ("\n  \r" if i % 7 == 0 else "") for i, line in enumerate(lines)))
    examples = read_examples(str(tmp_path / "pc.jsonl"), tokenizers["chatml"])
    assert len(examples) == 200
    source = streamed(tmp_path / "pc.jsonl", tokenizers)
    assert (source.train_examples, source.held_out, source.epoch_windows) == (180, 20, 12)
    whole = source.rows(3, 0, 8, 33)
    halves = [source.rows(3, 0, 4, 33), source.rows(3, 4, 8, 33)]
    for key in ("tokens", "segments", "loss_mask"):
        assert (whole[key] == np.concatenate([h[key] for h in halves])).all()
    check_rows(whole, 33)
    assert source.rows_read == 16
    source._train.locate(10**4)  # past the first epoch: its windows' starts are known
    epoch_rows = source._train.starts[source.epoch_windows]
    rows = source._train.rows(np.arange(epoch_rows), 33)
    assert as_counter(rows) == pieces(examples[:180])  # an epoch: every training example once

    state = source.state(20)
    resumed = streamed(tmp_path / "pc.jsonl", tokenizers)
    assert resumed.resume(json.loads(json.dumps(state)))
    assert not resumed.resume({**state, "seed": 8}) and not resumed.resume(None)
    resumed.resume(state)
    pooled = streamed(tmp_path / "pc.jsonl", tokenizers, workers=2)
    try:
        for step in (20, 21, 37):
            for other in (resumed, pooled):
                got = other.rows(step, 0, 8, 33)
                assert all((got[k] == source.rows(step, 0, 8, 33)[k]).all() for k in got)
        evals = [pooled.rows(j, 0, 8, 33, "eval") for j in range(3)]
    finally:
        pooled.close()
    assert as_counter({k: np.concatenate([e[k] for e in evals]) for k in evals[0]}) == pieces(examples[180:])
    assert source.has_rows(0, "eval") and not source.has_rows(8 * 3, "eval")
    assert source.rows(0, 0, 8, 33).keys() == evals[0].keys()
    other = streamed(tmp_path / "pc.jsonl", tokenizers, seed=8)
    assert (other.rows(0, 0, 8, 33)["tokens"] != source.rows(0, 0, 8, 33)["tokens"]).any()
    text = source.describe(32)
    assert text.startswith("pc: 200 examples (chatml), 20 held out, packed into rows of 32 as training reaches them, "
                           "16 at a time; the first 16: "), text
    with pytest.raises(UserError, match="too few for training and evaluation"):
        streamed(tmp_path / "pc.jsonl", tokenizers, eval_fraction=0.999)


def test_records_pack_end_to_end(tmp_path, tokenizers):
    write_jsonl(tmp_path / "chats.jsonl", RECORDS * 5)
    source = RecordSource(RecordIndex(str(tmp_path / "chats.jsonl")),
                          Tokenizing(tokenizers["llama"], str(SFT / "llama"), "completion", 0), Rows(65, batch=2))
    rows = source.rows(0, 0, 2, 65)
    check_rows(rows, 65)
    assert rows["tokens"][:, 0].tolist() == [tokenizers["llama"].token_id("<|begin_of_text|>")] * 2
    assert source.describe(64).startswith("data: 10 examples (tokens); the 10 for training packed into 8 rows of 64")


def test_a_tokenizer_json_that_truncates_does_not_cut_documents(tmp_path):
    # transformers ignores tokenizer.json's truncation and padding when it tokenizes text.
    spec = json.loads((SFT / "chatml" / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    text = "a sentence of more than four tokens, whatever the vocabulary"
    got = load_tokenizer(str(tmp_path / "tokenizer.json")).encode([text])[0]
    assert got.size > 4
    assert list(got) == list(load_tokenizer(str(SFT / "chatml" / "tokenizer.json")).encode([text])[0])


def test_document_mask_gives_each_document_of_the_stream_its_segment():
    eos = 0
    stream = np.array([5, 6, eos, 7, eos, 8, 9, 10, eos, 11, 12], np.int32)
    source = TokenSource(stream, 6, 2, seed=0, document_end=eos)
    rows = source.rows(0, 0, 2, 6)
    for tokens, segments in zip(rows["tokens"], rows["segments"]):
        # A document's tokens and its end-of-text token share a segment; the next starts after it.
        ends = np.flatnonzero(tokens == eos)
        want = 1 + np.array([np.sum(ends < i) for i in range(tokens.size)])
        assert list(segments) == list(want)
    assert rows["loss_mask"].all() and source.packed
    assert not TokenSource(stream, 6, 2, seed=0).packed


def test_records_of_other_fields_are_text_for_the_token_stream(tmp_path):
    # --text-field names any field: only messages, or a prompt with a completion, are fine-tuning records.
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "some text"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "a", "completion": None, "messages": None}) + "\n")
    (tmp_path / "c.jsonl").write_text("\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    assert [fine_tuning_format(str(tmp_path / n)) for n in ("a.jsonl", "b.jsonl", "c.jsonl")] == \
        [None, None, "prompt/completion"]
