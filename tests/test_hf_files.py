"""Every file a Hugging Face directory holds passes its schema (spmd.base.schema) before any
per-layer work or allocation: each bad directory below is a copy of a golden (tests/hf/)
broken in one way, refused with one line that names the file, the field and the value.

Most cases call spmd.formats.hf.Directory in this process (milliseconds each); those that would
hang or allocate without the checks run as commands, in one subprocess with a timeout, so
a regression fails by timing out instead of holding the suite.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.commands import one_error_line

from models import PRESETS, hf_layout
from spmd.base.errors import UserError
from spmd.formats.hf import Directory, companions, max_positions, tokenizer_of
from spmd.formats.safetensors import SafeTensors, Writer
from spmd.hf import from_pretrained

pytestmark = pytest.mark.xdist_group("hf")

GOLDENS = Path(__file__).with_name("hf")
DRIVER = Path(__file__).with_name("cli_driver.py")
TIED, SHARDED, MIXTRAL = "llama-tied-rope", "llama-gqa", "mixtral"
FIRST_SHARD = "model-00001-of-00007.safetensors"  # llama-gqa's; it holds model.embed_tokens.weight


def copy(root: Path, name: str, golden: str) -> Path:
    target = root / name
    shutil.copytree(GOLDENS / golden, target, ignore=shutil.ignore_patterns("*.npy"))
    return target


def edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def config(**fields):
    return lambda d: edit_json(d / "config.json", lambda c: c.update(fields))


def rope(**fields):
    return lambda d: edit_json(d / "config.json", lambda c: c["rope_parameters"].update(fields))


def replace_in(file: str, old: str, new: str):
    """An edit of a file's text (how JSON that json.dumps would not write is made)."""
    def edit(d: Path):
        text = (d / file).read_text()
        assert old in text, (file, old)
        (d / file).write_text(text.replace(old, new, 1))
    return edit


def header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, text: str, data: bytes) -> None:
    path.write_bytes(len(text.encode()).to_bytes(8, "little") + text.encode() + data)


def entry(key: str, **fields):
    """An edit of one entry of model.safetensors's header (a tensor's, or __metadata__)."""
    def edit(d: Path):
        head, data = header(d / "model.safetensors")
        head.setdefault(key, {}).update(fields)
        write_header(d / "model.safetensors", json.dumps(head), data)
    return edit


def header_text(edit_text):
    """An edit of model.safetensors's header as text."""
    def edit(d: Path):
        head, data = header(d / "model.safetensors")
        write_header(d / "model.safetensors", edit_text(json.dumps(head)), data)
    return edit


def with_tensors(**more):
    """model.safetensors rewritten with more tensors (name -> array; `__` for `.`)."""
    def edit(d: Path):
        tensors = {n: f.read(n) for f in [SafeTensors(d / "model.safetensors")] for n in f.names()}
        tensors |= {name.replace("__", "."): value(tensors) for name, value in more.items()}
        writer = Writer(d / "model.safetensors", [(k, v.shape) for k, v in tensors.items()], np.float32)
        for k, v in tensors.items():
            writer.write(k, v)
        writer.close()
    return edit


def weight_map(tensor: str, value):
    return lambda d: edit_json(d / "model.safetensors.index.json", lambda i: i["weight_map"].update({tensor: value}))


def in_subdirectory(d: Path):
    """The first shard moved to sub/, as the index says."""
    (d / "sub").mkdir()
    (d / FIRST_SHARD).rename(d / "sub" / FIRST_SHARD)
    edit_json(d / "model.safetensors.index.json", lambda i: i["weight_map"].update(
        {k: f"sub/{v}" for k, v in i["weight_map"].items() if v == FIRST_SHARD}))


def unlisted(tensor: str):
    return lambda d: edit_json(d / "model.safetensors.index.json", lambda i: i["weight_map"].pop(tensor))


def linked_from_outside(d: Path) -> None:
    (d / FIRST_SHARD).rename(d.parent / "blob")
    (d / FIRST_SHARD).symlink_to(d.parent / "blob")


def shard_is(make):
    """The first shard replaced by what `make(path)` creates there."""
    def edit(d: Path):
        (d / FIRST_SHARD).unlink()
        make(d / FIRST_SHARD)
    return edit


def char_device(path: Path) -> None:
    """A character device node of our own, in the temporary directory, with /dev/null's
    numbers (harmless if a regression opened it): never a real /dev node."""
    try:
        os.mknod(path.with_name("null-device"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")
    path.symlink_to(path.with_name("null-device"))


def symlink_loop(path: Path) -> None:
    path.with_name("loop-b").symlink_to(path.name)
    path.symlink_to("loop-b")


# name -> (golden, edit, fragment of the error)
BAD = {
    # 5: a safetensors header, field by field
    "offsets are strings": (TIED, entry("model.norm.weight", data_offsets=["0", "128"]),
                            "tensor model.norm.weight data_offsets: must be a list of 2 non-negative integers "
                            "(got ['0', '128'])"),
    "offsets are floats": (TIED, entry("model.norm.weight", data_offsets=[0.0, 128.0]), "(got [0.0, 128.0])"),
    "three offsets": (TIED, entry("model.norm.weight", data_offsets=[0, 64, 128]), "data_offsets: must be a list of 2"),
    "shape of floats": (TIED, entry("model.norm.weight", shape=[32.0]), "shape: must be a list of non-negative"),
    "shape of bools": (TIED, entry("model.norm.weight", shape=[True]), "(got [True])"),
    "negative shape": (TIED, entry("model.norm.weight", shape=[-32]), "(got [-32])"),
    "unknown dtype": (TIED, entry("model.norm.weight", dtype="F8_E4M3"), "dtype: 'F8_E4M3' is not supported (F64 or"),
    "entry field unknown": (TIED, entry("model.norm.weight", quantized=True),
                            "tensor model.norm.weight quantized: is not a field of a tensor's entry"),
    "metadata not strings": (TIED, entry("__metadata__", format=1),
                             "model.safetensors: __metadata__: must be a mapping of names to strings or null "
                             "(got {'format': 1})"),
    "offsets overlap": (TIED, entry("model.norm.weight", data_offsets=[0, 128]),
                        "(tensors must be contiguous, not overlapping)"),
    "bytes after the last tensor": (TIED, lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes() + b"\0" * 16), "has 16 bytes after its last tensor"),
    "header not JSON": (TIED, header_text(lambda t: t[:-1] + "]"), "the header is not valid JSON"),
    # 16: a key twice, in each JSON file
    "tensor named twice": (TIED, header_text(lambda t: '{"model.norm.weight": {}, ' + t[1:]),
                           "model.norm.weight: is given twice"),
    "config field twice": (TIED, replace_in("config.json", '"vocab_size": 128', '"vocab_size": 128, "vocab_size": 64'),
                           "config.json vocab_size: is given twice"),
    "index entry twice": (SHARDED, replace_in("model.safetensors.index.json", '"weight_map": {',
                                              '"weight_map": {"lm_head.weight": "x.safetensors", '),
                          "model.safetensors.index.json lm_head.weight: is given twice"),
    # 6: the index
    "weight_map value a number": (SHARDED, weight_map("model.norm.weight", 7),
                                  "index.json weight_map.model.norm.weight: must be a file name (got 7)"),
    "weight_map value null": (SHARDED, weight_map("model.norm.weight", None), "must be a file name (got None)"),
    "weight_map a list": (SHARDED, lambda d: edit_json(d / "model.safetensors.index.json",
                                                       lambda i: i.update(weight_map=["a"])),
                          "index.json weight_map: must be a mapping of names to file names (got ['a'])"),
    "index field unknown": (SHARDED, lambda d: edit_json(d / "model.safetensors.index.json",
                                                         lambda i: i.update(format="pt")),
                            "index.json format: is not a field of an index"),
    "index entry outside": (SHARDED, weight_map("model.norm.weight", "../model.safetensors"),
                            "'../model.safetensors' names a file outside the directory"),
    "index entry absolute": (SHARDED, weight_map("model.norm.weight", "/etc/passwd"),
                             "'/etc/passwd' names a file outside the directory"),
    "index entry in the wrong shard": (SHARDED, weight_map("model.norm.weight", FIRST_SHARD),
                                       "holds tensor model.norm.weight, which model.safetensors.index.json places "
                                       f"in {FIRST_SHARD}"),
    # 7, 18: numbers, finite and in range
    "rope_theta a string": (TIED, rope(rope_theta="big"),
                            "config.json rope_parameters.rope_theta: must be a positive finite number (got 'big')"),
    "rope_theta negative": (TIED, rope(rope_theta=-5.0), "rope_parameters.rope_theta: must be a positive"),
    "rope_theta NaN": (TIED, replace_in("config.json", '"rope_theta": 500000.0', '"rope_theta": NaN'),
                       "config.json rope_theta: must be finite (got nan)"),
    "rope_theta Infinity": (TIED, replace_in("config.json", '"rope_theta": 500000.0', '"rope_theta": Infinity'),
                            "config.json rope_theta: must be finite (got inf)"),
    "rope_theta 1e999": (TIED, replace_in("config.json", '"rope_theta": 500000.0', '"rope_theta": 1e999'),
                         "rope_theta: must be finite (got inf)"),
    "top-level rope_theta a string": (MIXTRAL, config(rope_theta="1e6", rope_parameters=None),
                                      "config.json rope_theta: must be a positive finite number (got '1e6')"),
    "rms_norm_eps Infinity": (TIED, replace_in("config.json", '"rms_norm_eps": 1e-06', '"rms_norm_eps": Infinity'),
                              "config.json rms_norm_eps: must be finite (got inf)"),
    "rms_norm_eps zero": (TIED, config(rms_norm_eps=0), "rms_norm_eps: must be a positive finite number (got 0)"),
    "llama3 factors equal": (TIED, rope(high_freq_factor=1.0),
                             "rope_parameters.high_freq_factor: 1.0 must be more than low_freq_factor 1.0"),
    "llama3 factor missing": (TIED, lambda d: edit_json(d / "config.json", lambda c: c["rope_parameters"].pop(
        "factor")),
                              "config.json rope_parameters.factor: is missing"),
    "rope field unknown": (TIED, rope(rope_type="default"),
                           "rope_parameters.factor: is not a field of rope_type default"),
    # 8: max_position_embeddings (read by generate through spmd.formats.hf.max_positions)
    "max positions a string": (TIED, config(max_position_embeddings="abc"),
                               "config.json max_position_embeddings: must be a positive integer (got 'abc')"),
    "max positions negative": (TIED, config(max_position_embeddings=-5), "(got -5)"),
    "max positions fractional": (TIED, config(max_position_embeddings=64.7), "(got 64.7)"),
    "max positions a bool": (TIED, config(max_position_embeddings=True), "(got True)"),
    "layers a bool": (TIED, config(num_hidden_layers=True), "num_hidden_layers: must be a positive integer (got True)"),
    "head_dim zero": (TIED, lambda d: edit_json(d / "config.json", lambda c: (c.pop("head_dim"), c.update(
        num_attention_heads=64, num_key_value_heads=64))), "head_dim: must be a positive even number (got 0"),
    # 4: sizes against what the files hold, before any per-layer work
    "layers beyond the files": (TIED, config(num_hidden_layers=3),
                                "config.json describes 29 tensors (num_hidden_layers 3); the files hold 20"),
    "vocabulary beyond the files": (TIED, config(vocab_size=256), "tensor model.embed_tokens.weight has shape "
                                                                  "[128, 32]; config.json makes it [256, 32]"),
    # 17: tensors the model has no place for
    "a third layer in a 2-layer model": (TIED, with_tensors(model__layers__2__input_layernorm__weight=lambda t: np.ones(
        32, np.float32)), "holds tensor model.layers.2.input_layernorm.weight, which the model of config.json has no "
                          "place for"),
    "a head bias": (TIED, with_tensors(lm_head__bias=lambda t: np.zeros(128, np.float32)), "tensor lm_head.bias"),
    "a tied head that differs": (TIED, with_tensors(lm_head__weight=lambda t: t["model.embed_tokens.weight"] + 1),
                                 "tensor lm_head.weight differs from model.embed_tokens.weight, which config.json "
                                 "ties it to"),
    "a tensor the index leaves out": (SHARDED, unlisted("model.layers.0.input_layernorm.weight"),
                                      "shard model-00004-of-00007.safetensors holds tensor model.layers.0.input_"
                                      "layernorm.weight, which model.safetensors.index.json does not list"),
    "a shard the index leaves out": (SHARDED, unlisted("lm_head.weight"),  # its only tensor: the shard is not read
                                     "config.json describes 21 tensors (num_hidden_layers 2); the files hold 20"),
    # 14, 15: what a path is, said as it is
    "config.json a directory": (TIED, lambda d: (d / "config.json").unlink() or (d / "config.json").mkdir(),
                                "config.json is a directory, not a file"),
    "shard a directory": (SHARDED, shard_is(Path.mkdir), f"{FIRST_SHARD} is a directory, not a file"),
    "shard a symlink loop": (SHARDED, shard_is(symlink_loop),
                             f"{FIRST_SHARD} is a symbolic link loop, not a file"),
    "shard a broken symlink": (SHARDED, shard_is(lambda p: p.symlink_to("nowhere")),
                               "is a broken symbolic link, not a file"),
    "shard a character device": (SHARDED, shard_is(char_device), f"{FIRST_SHARD} is a character device, not a file"),
    "index a directory": (SHARDED, lambda d: (d / "model.safetensors.index.json").unlink() or (
        d / "model.safetensors.index.json").mkdir(), "model.safetensors.index.json is a directory, not a file"),
    "shard missing in sub/": (SHARDED, lambda d: in_subdirectory(d) or (d / "sub" / FIRST_SHARD).unlink(),
                              f"shard sub/{FIRST_SHARD} is missing (it holds model.embed_tokens.weight)"),
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    made = {}
    for i, (name, (golden, edit, _)) in enumerate(BAD.items()):
        made[name] = copy(root, str(i), golden)
        try:
            edit(made[name])
        except pytest.skip.Exception as why:  # that case only
            made[name] = why
    return made


@pytest.mark.parametrize("case", BAD)
def test_a_bad_directory_is_refused_naming_the_file_field_and_value(bad, case):
    if isinstance(bad[case], pytest.skip.Exception):
        pytest.skip(str(bad[case]))
    with pytest.raises(UserError) as refused:
        Directory(bad[case])
    assert BAD[case][2] in str(refused.value)
    assert "\n" not in str(refused.value)


# What a loader must accept, though it is not as the goldens are written.
GOOD = {
    "a shard in a subdirectory": (SHARDED, in_subdirectory),  # 15: inside is inside
    "an index entry spelled ./name": (SHARDED, lambda d: edit_json(d / "model.safetensors.index.json", lambda i: i[
        "weight_map"].update({k: f"./{v}" for k, v in i["weight_map"].items()}))),
    # The Hugging Face cache's snapshot directories link each file to a blob outside them.
    "a shard linked from outside": (SHARDED, linked_from_outside),
    # 17: a tied model that ships its head as an equal copy (Qwen3-0.6B does): transformers re-ties it.
    "a tied head that is a copy": (TIED, with_tensors(lm_head__weight=lambda t: t["model.embed_tokens.weight"])),
    "rope_type under its old key": (TIED, lambda d: edit_json(d / "config.json", lambda c: c["rope_parameters"].update(
        type=c["rope_parameters"].pop("rope_type")))),
}


@pytest.mark.parametrize("case", GOOD)
def test_a_directory_laid_out_otherwise_loads_the_same_tensors(tmp_path, case):
    golden, edit = GOOD[case]
    edit(copy(tmp_path, "d", golden))
    got, want = Directory(tmp_path / "d"), Directory(GOLDENS / golden)
    assert got.cfg == want.cfg
    for t in want.tensors:
        np.testing.assert_array_equal(got.layer(t, 1 if t.stacked else 0), want.layer(t, 1 if t.stacked else 0))


def test_tensor_count_is_the_number_of_tensors_named():
    configs = [Directory(GOLDENS / name).cfg for name in (TIED, SHARDED, MIXTRAL, "qwen3")]
    for cfg in configs + [c for c in PRESETS.values() if hf_layout(c).supported(c) is None]:
        layout = hf_layout(cfg)
        named = sum(len(t.names(i)) for t in layout.tensors(cfg) for i in range(t.stacked or 1))
        assert layout.tensor_count(cfg)[0] == named, cfg


def test_max_positions_is_checked_and_defaults_to_2048(tmp_path):
    assert max_positions(str(GOLDENS / TIED)) == 256
    config(max_position_embeddings=None)(copy(tmp_path, "null", TIED))
    with pytest.raises(UserError, match="max_position_embeddings: must be a positive integer"):
        max_positions(str(tmp_path / "null"))
    edit_json(copy(tmp_path, "absent", TIED) / "config.json", lambda c: c.pop("max_position_embeddings"))
    assert max_positions(str(tmp_path / "absent")) == 2048


def test_tokenizer_files_are_files_holding_json(tmp_path):
    (copy(tmp_path, "dir", TIED) / "tokenizer.json").mkdir()  # 20: said, not skipped
    with pytest.raises(UserError, match="tokenizer.json is a directory, not a file"):
        tokenizer_of(tmp_path / "dir")
    replace_in("tokenizer.json", '"model": {', '"model": 5, "x": {')(copy(tmp_path, "model", SHARDED))
    with pytest.raises(UserError, match=r"tokenizer.json model: must be a mapping \(got 5\)"):
        tokenizer_of(tmp_path / "model")
    replace_in("tokenizer.json", '"vocab": {', '"vocab": {"</s>": 7, ')(copy(tmp_path, "twice", SHARDED))
    with pytest.raises(UserError, match="tokenizer.json </s>: is given twice"):
        tokenizer_of(tmp_path / "twice")
    (copy(tmp_path, "config", SHARDED) / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(UserError, match="tokenizer_config.json is not valid JSON"):
        companions(tmp_path / "config", "tokenizer_from")
    assert tokenizer_of(GOLDENS / TIED) is None
    assert sorted(companions(GOLDENS / SHARDED, "x")) == ["generation_config.json", "tokenizer.json"]


def test_from_pretrained_refuses_a_damaged_header_in_one_line(bad):
    with pytest.raises(UserError, match="data_offsets: must be a list of 2 non-negative integers"):
        from_pretrained(bad["offsets are strings"])


# ------------------------------------------------------------------ as commands

def theirs(d: Path, mode: int, *files: str) -> None:
    """`files` of d (d itself when none) made another user's, whom the test's namespace
    does not map, with `mode`: unreadable to us there although we are its root."""
    for path in [d / f for f in files] or [d]:
        os.chown(path, 12345, 12345)
        path.chmod(mode)


# name -> (golden, edit, extra flags, fragment). Each would once run, hang or allocate
# before saying anything (or give a traceback).
COMMANDS = {
    "layers 10^9": (SHARDED, config(num_hidden_layers=10**9), [],
                    "config.json describes 9000000003 tensors (num_hidden_layers 1000000000); the files hold 21"),
    "experts 10^9": (MIXTRAL, config(num_local_experts=10**9), [],
                     "(num_hidden_layers 2, num_local_experts 1000000000); the files hold 41"),
    "offsets are strings": (TIED, BAD["offsets are strings"][1], [], BAD["offsets are strings"][2]),
    "weight_map value a number": (SHARDED, weight_map("model.norm.weight", 7), [], "must be a file name (got 7)"),
    "rope_theta a string": (TIED, rope(rope_theta="big"), [], "rope_parameters.rope_theta: must be a positive finite"),
    "directory unreadable": (TIED, lambda d: theirs(d, 0o700), [], "config.json cannot be read (Permission denied)"),
    "shard unreadable": (SHARDED, lambda d: theirs(d, 0o600, FIRST_SHARD), [],
                         f"{FIRST_SHARD} cannot be read (Permission denied)"),
    "shard a FIFO": (SHARDED, shard_is(os.mkfifo), [], f"{FIRST_SHARD} is a FIFO, not a file"),
    "tokenizer.json a directory": (TIED, lambda d: (d / "tokenizer.json").mkdir(), ["--data", "{corpus}"],
                                   "tokenizer.json is a directory, not a file"),
}


def test_commands_refuse_in_one_line_before_any_work(tmp_path):
    """Through `spmd.train --init-from`, as the user runs it: exit 2, one line, nothing
    written, and fast (the subprocess's timeout fails a regression instead of waiting)."""
    (tmp_path / "corpus.txt").write_text("some text\n" * 50)
    batch = []
    for i, (golden, edit, flags, _) in enumerate(COMMANDS.values()):
        made = copy(tmp_path, f"d{i}", golden)
        edit(made)
        (tmp_path / f"w{i}").mkdir()
        argv = ["--init-from", str(made), *[f.format(corpus=tmp_path / "corpus.txt") for f in flags],
                "--steps", "1", "--batch", "8", "--seq", "16"]
        batch.append({"module": "spmd.train", "cwd": str(tmp_path / f"w{i}"), "argv": argv})
    done = subprocess.run(["unshare", "-r", sys.executable, str(DRIVER)], input=json.dumps(batch),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for i, (name, result) in enumerate(zip(COMMANDS, json.loads(done.stdout))):
        assert result["code"] == 2, (name, result)
        assert COMMANDS[name][3] in one_error_line(result["stderr"]), name
        assert not any((tmp_path / f"w{i}").iterdir()), name


def test_a_model_larger_than_the_host_is_refused_before_allocating(tmp_path):
    """A tied one-layer model whose embedding alone is twice this host's memory in
    float32, in a sparse file (its bytes are never written, so it costs no disk): every
    header and shape is right, and from_pretrained refuses it before allocating."""
    from spmd.base.hardware import host_memory_bytes

    embed = 1 << 16
    vocab = -(-host_memory_bytes() // (2 * embed))  # float16 in the file: as many bytes as the host has
    cfg = json.loads((GOLDENS / TIED / "config.json").read_text())
    cfg |= {"vocab_size": vocab, "hidden_size": embed, "num_hidden_layers": 1, "num_attention_heads": 1,
            "num_key_value_heads": 1, "head_dim": 2, "intermediate_size": 2}
    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    layer = "model.layers.0."
    shapes = {"model.embed_tokens.weight": [vocab, embed], "model.norm.weight": [embed],
              layer + "input_layernorm.weight": [embed], layer + "post_attention_layernorm.weight": [embed],
              layer + "self_attn.q_proj.weight": [2, embed], layer + "self_attn.k_proj.weight": [2, embed],
              layer + "self_attn.v_proj.weight": [2, embed], layer + "self_attn.o_proj.weight": [embed, 2],
              layer + "mlp.gate_proj.weight": [2, embed], layer + "mlp.up_proj.weight": [2, embed],
              layer + "mlp.down_proj.weight": [embed, 2]}
    head, offset = {}, 0
    for name, shape in shapes.items():
        head[name] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + 2 * int(np.prod(shape))]}
        offset = head[name]["data_offsets"][1]
    write_header(d / "model.safetensors", json.dumps(head), b"")
    os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size + offset)
    script = f"from spmd.hf import from_pretrained\nfrom spmd.base.errors import UserError\ntry:\n" \
             f"    from_pretrained({str(d)!r})\nexcept UserError as exc:\n    print(exc)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "in float32" in done.stdout and "of this host's memory" in done.stdout, done.stdout
