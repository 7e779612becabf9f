"""Hugging Face model directories in and out: `config.json` with `model.safetensors`, or
sharded `model-0000i-of-0000n.safetensors` files with their `.index.json`.

Loading places each parameter straight into its sharding, one layer at a time: a layer's
published tensors are read (only their bytes, with plain reads: nothing stays mapped),
converted to our layout, and each device gets its slice. The host holds at most one
layer's tensors of one parameter in both layouts, plus the slices on their way to the
devices: two to three times the largest published tensor (the embedding table, for
Llama), never the model (benchmarks/hf_load.py). Writing gathers one layer of one
parameter at a time to this process.

    from spmd.hf import from_pretrained
    model = from_pretrained("Llama-3.2-1B", mesh="fsdp=4,tp=2")
    logits = model(tokens)  # (batch, seq) -> float32 (batch, seq, vocab)
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path, PurePosixPath

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from models import MAX_CONFIG_BYTES, Tensor, hf_layout, model_class
from spmd.base.console import human_bytes
from spmd.base.errors import UserError, file_kind
from spmd.base.hardware import device_memory
from spmd.base.schema import (ANY, MAPPING, REGULAR, STRING, Field, Invalid, check, list_of, mapping_of, not_a_file,
                              read_json)
from spmd.formats.safetensors import Damaged, SafeTensors, Writer

FLOATS = ("F64", "F32", "F16", "BF16")
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # copied with a model
CHAT_TEMPLATE = "chat_template.jinja"  # a model's chat template as its own file: copied with it too
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
# What the files beside the weights must hold. An index: where each tensor is (other keys
# refused); a tokenizer.json: its model (the rest is the tokenizers library's to read).
MAX_INDEX_BYTES = 100 << 20  # as a safetensors header's limit; real indexes are under 1 MB
MAX_TOKENIZER_BYTES = 1 << 30
ARCHITECTURES = Field("architectures", list_of(STRING, "class names", length=1))  # every config.json's
INDEX_FIELDS = (Field("weight_map", mapping_of(ANY, "file names")), Field("metadata", MAPPING, default=None))
TOKENIZER_FIELDS = (Field("model", MAPPING),)


def _json(path: Path, what: str, limit: int):
    try:
        return read_json(path, limit)
    except Invalid as exc:
        raise UserError(f"{what}: {path.name} {exc}") from None


def what_directory(directory: str, what: str) -> str:
    """`what directory`, checked to be a directory."""
    what = f"{what} {directory}"
    kind = file_kind(Path(directory))
    if kind == "missing":
        raise UserError(f"{what} does not exist")
    if kind != "a directory":
        raise UserError(f"{what} {not_a_file(kind, 'a directory')}")
    return what


@functools.lru_cache(maxsize=8)
def _config_json(directory: str, what: str) -> tuple[dict, object]:
    """config.json checked against its family's schema: (its values, our model config)."""
    what = what_directory(directory, what)
    path = Path(directory) / "config.json"
    if file_kind(path) == "missing":
        raise UserError(f"{what} has no config.json (give a Hugging Face model directory)")
    hf = _json(path, what, MAX_CONFIG_BYTES)
    try:
        check(hf, (ARCHITECTURES,), others=None)  # which family's schema reads the rest
        layout = hf_layout(architectures=hf["architectures"])
        return layout.config_values(hf), layout.config_from_hf(hf)
    except Invalid as exc:
        raise UserError(f"{what}: config.json {exc}") from None


def read_config(directory: str, what: str = "--init-from"):
    """The model config of a Hugging Face directory's config.json (checked: refused with
    the field that cannot be reproduced)."""
    return _config_json(str(directory), what)[1]


def max_positions(directory: str, what: str = "--init-from") -> int:
    """config.json's max_position_embeddings: the longest context the model was made for
    (a positive integer; 2048 when config.json does not say)."""
    return _config_json(str(directory), what)[0]["max_position_embeddings"]


class TensorFiles:
    """Safetensors files in a directory (`path`, named `what` in messages) that hold the
    published tensors of our parameters (`tensors`, models.Tensor), each located (`where`),
    checked and read one layer at a time. `single`: the file's name when there is one;
    `described_by`: what says which tensors there must be; `shaped_by`: their shapes."""

    path: Path
    what: str
    tensors: list[Tensor]
    single: str = SINGLE
    described_by: str = "the model of config.json"
    shaped_by: str = "config.json"
    indexed: bool = False
    # DeepSeek's multi-token prediction layers the files hold, depth 1 first (each a list
    # of tensors): read into a run's own modules (`--mtp-depth`), or dropped, as
    # transformers drops them.
    predictions: tuple = ()

    def _open(self, file: str, holds: str) -> SafeTensors:
        kind = file_kind(self.path / file)
        if kind == "missing":
            raise UserError(f"{self.what}: shard {file} is missing (it holds {holds})")
        if kind != REGULAR:
            raise UserError(f"{self.what}: {file} {not_a_file(kind)}")
        try:
            self.files[file] = SafeTensors(self.path / file)
        except Damaged as exc:
            raise UserError(self._damaged(exc)) from None
        except OSError as exc:
            raise UserError(f"{self.what}: {file} cannot be read ({exc.strerror})") from None
        return self.files[file]

    def _damaged(self, exc: Exception) -> str:
        """The message of a damaged file, named inside the directory (the directory is named first)."""
        return f"{self.what}: " + str(exc).removeprefix(f"{self.path}/")

    def every_tensor(self, depth: int | None = None) -> list[Tensor]:
        """The model's tensors and those of the prediction layers the files hold (the
        first `depth` of them: a run's modules)."""
        return [*self.tensors, *(t for layer in self.predictions[:depth] for t in layer)]

    def _locate(self, held: dict[str, str], copies: dict[str, tuple[str, str]]) -> dict[str, str]:
        """Where each tensor the model needs is; refused: one the files lack, and one the
        model has no place for (a copy only if it differs from what it copies)."""
        needed = [name for t in self.every_tensor() for i in range(t.stacked or 1) for name in t.names(i)]
        for name in needed:
            if name not in held:
                raise UserError(f"{self.what}: " + (f"{INDEX} does not list tensor {name}" if self.indexed else
                                                    f"tensor {name} is not in {self.single}"))
        known = set(needed)
        for name in (name for name in held if name not in known):
            if name not in copies:
                raise UserError(f"{self.what}: {held[name]} holds tensor {name}, which {self.described_by} "
                                "has no place for")
            of, tie = copies[name]
            if not self.files[held[name]].same(name, self.files[held[of]], of):
                raise UserError(f"{self.what}: tensor {name} differs from {of}, which {tie}")
        return {name: held[name] for name in needed}

    def _check_shapes(self) -> None:
        for t in self.every_tensor():
            for i in range(t.stacked or 1):
                for name, shape in zip(t.names(i), t.shapes):
                    file = self.files[self.where[name]]
                    if file.dtype(name) not in FLOATS:
                        raise UserError(f"{self.what}: tensor {name} holds {file.dtype(name)}, not floating point")
                    if file.shape(name) != shape:
                        raise UserError(f"{self.what}: tensor {name} has shape {list(file.shape(name))}; "
                                        f"{self.shaped_by} makes it {list(shape)}")

    def layer(self, t: Tensor, i: int) -> np.ndarray:
        """Our parameter `t` of layer `i` (or the whole of an unstacked one), float32."""
        try:
            parts = [self.files[self.where[name]].read(name).astype(np.float32) for name in t.names(i)]
        except (Damaged, OSError) as exc:
            raise UserError(self._damaged(exc)) from None
        for name, part in zip(t.names(i), parts):
            if not np.isfinite(part).all():  # (training would stop at its first loss; generation emit noise)
                raise UserError(f"{self.what}: tensor {name} holds values that are not finite (NaN or infinity)")
        return t.to_ours(parts)


class Directory(TensorFiles):
    """A Hugging Face model directory, checked whole before anything is read: config.json,
    the index and every header pass their schemas; the tensors the files hold are exactly
    those the config needs (counted first, so a config's depth is checked against the files
    before any per-layer work), each whole and of the right shape."""

    def __init__(self, directory: str | Path, what: str = "--init-from"):
        self.path = Path(directory)
        self.what = f"{what} {directory}"
        self.cfg = read_config(str(directory), what)
        layout = hf_layout(self.cfg)
        held = self._held()  # published name -> file
        count, fields = layout.tensor_count(self.cfg)
        copies = layout.copies(self.cfg)
        predicting = getattr(layout, "prediction_layers", None)
        if predicting:
            self.predictions = predicting(self.cfg, held)
            copies |= layout.prediction_copies(self.cfg, len(self.predictions))
        copies = {name: of for name, of in copies.items() if name in held}
        if count > len(held) - len(copies):
            raise UserError(f"{self.what}: config.json describes {count} tensors ({fields}); the files hold "
                            f"{len(held) - len(copies)}")
        self.tensors = layout.tensors(self.cfg)
        self.where = self._locate(held, copies)
        self._check_shapes()

    def _held(self) -> dict[str, str]:
        """Every tensor the directory's files hold, and its file: the index's weight_map
        (checked against each shard's header) or the one file's header."""
        self.files: dict[str, SafeTensors] = {}
        self.indexed = file_kind(self.path / INDEX) != "missing"
        if not self.indexed:
            if file_kind(self.path / SINGLE) == "missing":
                raise UserError(f"{self.what} has neither {SINGLE} nor {INDEX}")
            return dict.fromkeys(self._open(SINGLE, "the model").names(), SINGLE)
        index = _json(self.path / INDEX, self.what, MAX_INDEX_BYTES)
        try:
            weight_map = check(index, INDEX_FIELDS, others="is not a field of an index")["weight_map"]
        except Invalid as exc:
            raise UserError(f"{self.what}: {INDEX} {exc}") from None
        held = {name: self._shard_name(name, file) for name, file in weight_map.items()}
        first = {}  # file -> a tensor it holds, for the message if it is missing
        for name, file in held.items():
            first.setdefault(file, name)
        for file in sorted(first):
            for name in self._open(file, first[file]).names():
                if held.get(name) != file:
                    raise UserError(f"{self.what}: shard {file} holds tensor {name}, which {INDEX} "
                                    + (f"places in {held[name]}" if name in held else "does not list"))
        for name, file in held.items():
            if name not in self.files[file]:
                raise UserError(f"{self.what}: tensor {name} is not in {file}")
        return held

    def _shard_name(self, tensor: str, file) -> str:
        """An index's file name, normalized; it must name a file inside the directory (a
        subdirectory is fine; a symlink is followed wherever it points, as the Hugging Face
        cache's snapshot directories link to their blobs)."""
        where = f"{self.what}: {INDEX} weight_map.{tensor}"
        if not isinstance(file, str) or not file.strip() or "\0" in file:
            raise UserError(f"{where}: must be a file name (got {file!r})")
        parts = PurePosixPath(file)
        if parts.is_absolute() or ".." in parts.parts:
            raise UserError(f"{where}: {file!r} names a file outside the directory")
        return str(parts)


def tokenizer_of(directory: str | Path, what: str = "--init-from") -> str | None:
    """A Hugging Face directory's tokenizer.json, if it has one (checked: a file, JSON with
    a tokenizer model)."""
    path = Path(directory) / "tokenizer.json"
    if file_kind(path) == "missing":
        return None
    _companion(path, f"{what} {directory}", TOKENIZER_FIELDS, MAX_TOKENIZER_BYTES)
    return str(path)


def companions(directory: str | Path, what: str) -> dict[str, Path]:
    """The tokenizer, chat template and generation files of a model directory that a copy
    of the model takes along, each checked (a regular file; the JSON ones holding a JSON
    mapping); absent ones left out."""
    found = {}
    template = Path(directory) / CHAT_TEMPLATE
    if file_kind(template) != "missing":
        if file_kind(template) != "a regular file":
            raise UserError(f"{what} {directory}: {CHAT_TEMPLATE} is {file_kind(template)}, not a file")
        found[CHAT_TEMPLATE] = template
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
        path = Path(directory) / name
        if file_kind(path) != "missing":
            _companion(path, f"{what} {directory}", TOKENIZER_FIELDS if name == "tokenizer.json" else (),
                       MAX_TOKENIZER_BYTES)
            found[name] = path
    return found


def _companion(path: Path, what: str, fields, limit: int) -> None:
    try:
        check(_json(path, what, limit), fields, others=None)
    except Invalid as exc:
        raise UserError(f"{what}: {path.name} {exc}") from None


# ------------------------------------------------------------------ loading

def load_params(directory: TensorFiles, layout, router: dict | None = None) -> dict:
    """The directory's parameters (a model's, or an adapter's: `TensorFiles`) placed in
    `layout`'s parameter shardings (pure dict). A tensor the layout keeps in its router
    state instead (a selection bias that the run moves: spmd.parallel.balance) goes into
    `router` (flat, by path), host arrays shaped as that state."""
    if isinstance(directory, Directory):  # an adapter is small beside its model
        _check_fits(directory, layout)
    shardings = traverse_util.flatten_dict(layout.shardings(layout.rules.params))
    shapes = traverse_util.flatten_dict(layout.skeleton.shapes)
    router_shapes = traverse_util.flatten_dict(layout.skeleton.router_shapes)
    placed = {}
    depth = getattr(layout.skeleton.model_cfg, "mtp_depth", 0)  # the run's prediction modules, from the files' layers
    for t in directory.every_tensor(depth):
        if t.ours not in shapes and t.ours in router_shapes and router is not None:
            layers = np.stack([directory.layer(t, i) for i in range(t.stacked or 1)])
            shape = router_shapes[t.ours].shape  # (and empty layers after them: LlamaConfig.empty_layers)
            empty = np.zeros((math.prod(shape) // layers[0].size - len(layers), *layers.shape[1:]), layers.dtype)
            router[t.ours] = np.concatenate([layers, empty]).reshape(shape)
            continue
        sharding, shape = shardings[t.ours], shapes[t.ours].shape
        if not t.stacked:
            placed[t.ours] = _place(directory.layer(t, 0), sharding)
            continue
        # (layers, ...), or a circular pipeline's stages' (repeats, layers / repeats, ...)
        lead = 2 if layout.repeats > 1 and t.ours[0] == model_class(layout.skeleton.model_cfg).STACKED else 1
        per_layer = jax.sharding.NamedSharding(sharding.mesh, jax.P(*_padded(sharding.spec, len(shape))[lead:]))
        stacked = _zeros(shape, sharding)
        for i in range(t.stacked):
            stacked = _set_layer(stacked, _place(directory.layer(t, i), per_layer), np.unravel_index(i, shape[:lead]))
        placed[t.ours] = stacked
    return traverse_util.unflatten_dict(placed)


def _check_fits(directory: Directory, layout) -> None:
    """Refuse a model whose float32 parameters could not fit the devices that would hold
    them (emulated CPU devices share the host's memory) even split evenly over all of them,
    before any is allocated: what surely cannot fit, not a plan of the peak."""
    devices = [d for d in layout.mesh.devices.flat if d.process_index == jax.process_index()]
    known = device_memory(devices)
    if known is None:
        return
    each, of = known
    total, count = directory.cfg.num_params() * 4, layout.mesh.devices.size
    if total / count > each:
        split = f", {human_bytes(total / count)} on each of {count} devices" if count > 1 else ""
        raise UserError(f"{directory.what}: the model's {directory.cfg.num_params():,} parameters take "
                        f"{human_bytes(total)} in float32{split}, more than the {human_bytes(each)} of {of}")


def _padded(spec, ndim: int) -> tuple:
    return (*spec, *([None] * (ndim - len(spec))))


def _place(value: np.ndarray, sharding):
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


@functools.cache
def _zeros_fn(shape, sharding):
    return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)


def _zeros(shape, sharding):
    return _zeros_fn(tuple(shape), sharding)()


@functools.cache
def _setter(sharding):
    return jax.jit(lambda stacked, value, index: stacked.at[index].set(value), out_shardings=sharding,
                   donate_argnums=0)


def _set_layer(stacked, value, index):
    return _setter(stacked.sharding)(stacked, value, tuple(int(i) for i in index))


# ------------------------------------------------------------------ writing

def write_hf(out: Path, params: dict, model_cfg, dtype, shard_bytes: int, copies: dict[str, Path]) -> list[str]:
    """Write `params` (our layout, on any mesh) as a Hugging Face directory in `out`:
    config.json, safetensors files of at most `shard_bytes` each (one tensor may exceed it)
    with their index, and `copies` (name in `out` -> file: the tokenizer's). -> files written"""
    layout = hf_layout(model_cfg)
    why_not = layout.supported(model_cfg)
    if why_not:
        raise UserError(f"this model has no Hugging Face layout: {why_not}")
    flat = traverse_util.flatten_dict(params)
    itemsize = np.dtype(dtype).itemsize
    order = [(t, i) for t in layout.tensors(model_cfg) for i in range(t.stacked or 1)]
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for t, i in order:
        for name, shape in zip(t.names(i), t.shapes):
            nbytes = int(np.prod(shape)) * itemsize
            if files[-1] and size + nbytes > shard_bytes:
                files.append([])
                size = 0
            files[-1].append((name, shape))
            size += nbytes
    names = ([SINGLE] if len(files) == 1 else
             [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])
    writers = iter(Writer(out / name, entries, dtype) for name, entries in zip(names, files))
    writer, left = next(writers), len(files[0])
    for t, i in order:
        value = gathered(flat[t.ours], i if t.stacked else None)
        for name, array in zip(t.names(i), t.to_hf(value)):
            if not left:
                writer.close()
                writer = next(writers)
                left = len(writer.expected)
            writer.write(name, array)
            left -= 1
    writer.close()
    (out / "config.json").write_text(json.dumps(layout.config_to_hf(model_cfg) | {"torch_dtype": np.dtype(dtype).name},
                                                indent=2) + "\n")
    written = [*names, "config.json"]
    if len(files) > 1:
        weight_map = {name: file for file, entries in zip(names, files) for name, _ in entries}
        total = sum(int(np.prod(shape)) * itemsize for entries in files for _, shape in entries)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(INDEX)
    for name, source in copies.items():
        shutil.copyfile(source, out / name)
        written.append(name)
    return written


def save_pretrained(out: str | Path, params: dict, model_cfg, dtype: str = "float32",
                    max_shard_bytes: int = 5 * 10**9, tokenizer_from: str | Path | None = None) -> list[str]:
    """`export --format hf` from Python: trained `params` (a run's, on any mesh) as a new
    Hugging Face directory `out`, with the tokenizer files of `tokenizer_from` (a model
    directory). -> the files written"""
    out = Path(out)
    copies = companions(tokenizer_from, "tokenizer_from") if tokenizer_from else {}
    out.mkdir(parents=True, exist_ok=False)
    return write_hf(out, params, model_cfg, dtype, max_shard_bytes, copies)


def gathered(array, layer: int | None) -> np.ndarray:
    """Layer `layer` of a stacked parameter (layers, ...), or an unstacked one, whole on
    this host, float32."""
    value = array if layer is None else array[layer]
    return np.asarray(jax.device_get(value), np.float32)
