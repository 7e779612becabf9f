"""Local data: every kind of file gives the same packed stream; token files are mapped,
not loaded, and checked; the sample order is a seeded permutation per epoch that no
mesh or process count changes."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from spmd.base.errors import UserError
from spmd.data.corpus import TokenSource, token_stream
from spmd.data.feed import global_batch
from spmd.data.tokenizer import load_tokenizer
from spmd.parallel.mesh import build_mesh, resolve_mesh

DOCS = ["the cat sat on the mat", "a dog ran to the big red house", "small blue door, é and ü"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same three documents as a text folder, a JSONL file and a Parquet file, plus a
    Hugging Face tokenizer.json and a SentencePiece model trained on them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("sources")
    text = tmp / "text"
    (text / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS[:2]):
        (text / f"{i}.txt").write_text(doc)
    (text / "sub" / "2.md").write_text(DOCS[2])  # folders are read recursively, in sorted order
    (text / ".hidden.txt").write_text("never read")
    (text / "notes.csv").write_text("not a data file")
    (tmp / "docs.jsonl").write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(DOCS)) + "\n")
    pq.write_table(pa.table({"body": DOCS}), tmp / "docs.parquet")

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(DOCS * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    hf.save(str(tmp / "tokenizer.json"))
    spm.SentencePieceTrainer.train(sentence_iterator=iter(DOCS * 20), model_prefix=str(tmp / "sp"), vocab_size=60,
                                   hard_vocab_limit=False, minloglevel=2)
    return tmp


def test_text_jsonl_and_parquet_pack_the_same_documents(sources):
    want = np.frombuffer(b"".join(d.encode() + b"\0" for d in DOCS), np.uint8)
    for path in ("text", "docs.jsonl", "docs.parquet"):
        np.testing.assert_array_equal(token_stream(str(sources / path), text_field="body"), want)
    for name in ("tokenizer.json", "sp.model"):
        tokenizer = load_tokenizer(str(sources / name))
        streams = [token_stream(str(sources / p), tokenizer, "body") for p in ("text", "docs.jsonl", "docs.parquet")]
        np.testing.assert_array_equal(streams[0], streams[1])
        np.testing.assert_array_equal(streams[0], streams[2])
        assert np.sum(streams[0] == tokenizer.eos) == len(DOCS)  # one separator after each document
        assert streams[0][-1] == tokenizer.eos and streams[0].max() < tokenizer.vocab_size
        assert len(streams[0]) < len(want)  # pieces of words, not bytes


def test_token_files_are_memory_mapped_and_checked(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 250
    np.save(tmp_path / "t.npy", tokens)
    tokens.astype(np.uint32).tofile(tmp_path / "t32.bin")
    mapped = token_stream(str(tmp_path / "t.npy"), vocab=256)
    assert isinstance(mapped, np.memmap)
    np.testing.assert_array_equal(mapped, tokens)
    np.testing.assert_array_equal(token_stream(str(tmp_path / "t32.bin"), token_dtype="uint32", vocab=256), tokens)
    (tmp_path / "parts").mkdir()
    for i, part in enumerate(np.split(tokens, [300, 301])):
        np.save(tmp_path / "parts" / f"{i}.npy", part)
    parts = token_stream(str(tmp_path / "parts"), vocab=256)  # files in order, each still mapped
    assert all(isinstance(p, np.memmap) for p in parts.parts) and parts.size == tokens.size
    np.testing.assert_array_equal(parts[250:700], tokens[250:700])  # a window across all three files
    np.save(tmp_path / "wide.npy", tokens.astype(np.int64))
    tokens[:999].tofile(tmp_path / "odd.bin")
    tokens.tofile(tmp_path / "t16.bin")
    for path, dtype, message in (("wide.npy", "uint16", "holds a 1-d int64 array"),
                                 ("odd.bin", "uint32", "not a whole number of uint32 tokens"),
                                 ("t16.bin", "uint32", "outside the model's vocabulary of 256")):
        with pytest.raises(UserError, match=message):
            token_stream(str(tmp_path / path), token_dtype=dtype, vocab=256)


def test_each_epoch_is_a_new_permutation_of_the_training_samples():
    source = TokenSource(np.arange(3301) % 256, length=33, batch=8, seed=0, eval_fraction=0.1)
    n = source.train_samples
    assert (n, source.eval_samples) == (92, 11)  # (3301 - 1) // 32 = 103 samples, the last 11 held out
    order = np.concatenate([source.samples(step, 0, 8) for step in range(2 * n // 8 + 1)])
    first, second = order[:n], order[n:2 * n]
    assert sorted(first) == sorted(second) == list(range(n))  # every training sample once per epoch
    assert not np.array_equal(first, second)  # reshuffled
    held_out = np.concatenate([source.samples(j, 0, 8, "eval") for j in range(3)])
    assert set(held_out) == set(range(n, n + 11))
    rows = source.rows(7, 0, 8, 33)
    np.testing.assert_array_equal(source.rows(7, 3, 6, 33), rows[3:6])  # a row is indexed by (step, row) alone
    s = source.samples(7, 0, 1)[0]
    np.testing.assert_array_equal(rows[0], np.arange(s * 32, s * 32 + 33) % 256)  # windows share one token
    assert not np.array_equal(TokenSource(np.arange(3301) % 256, 33, 8, seed=1).rows(7, 0, 8, 33), rows)


def test_a_batch_is_the_same_on_every_mesh_and_each_shard_reads_its_rows():
    want = TokenSource(np.arange(5000) % 256, 33, 16, seed=0).rows(2, 0, 16, 33)
    for sizes, distinct in (({"dp": 8}, 16), ({"fsdp": 2, "tp": 4}, 16), ({"tp": 8}, 16)):
        source = TokenSource(np.arange(5000) % 256, 33, 16, seed=0)
        sharding = jax.sharding.NamedSharding(build_mesh(resolve_mesh(sizes, 8)), jax.P(("dp", "fsdp", "ep"), None))
        np.testing.assert_array_equal(np.asarray(global_batch(source, 2, 16, 33, sharding)), want)
        assert source.rows_read == distinct  # rows that devices share along tp are read once


def test_too_little_data_is_refused(tmp_path):
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(UserError, match="too few for training"):
        TokenSource(token_stream(str(tmp_path / "short.txt")), 33, 8, seed=0)


def test_tokenizing_once_writes_the_stream_that_training_would_build(sources, tmp_path):
    out = tmp_path / "tokens" / "docs.npy"
    args = ["--data", str(sources / "docs.jsonl"), "--text-field", "body", "--tokenizer", str(sources / "tokenizer.json")]
    done = subprocess.run([sys.executable, "-m", "spmd.corpus", *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    want = token_stream(str(sources / "docs.jsonl"), load_tokenizer(str(sources / "tokenizer.json")), "body")
    np.testing.assert_array_equal(token_stream(str(out), vocab=256), want)
    assert [p.name for p in out.parent.iterdir()] == ["docs.npy"]  # no temporary file left
