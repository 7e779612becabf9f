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
import shutil
from pathlib import Path

import numpy as np

from models import hf_layout
from models.llama_hf import Tensor, UnsupportedConfig
from spmd.errors import UserError
from spmd.safetensors import Damaged, SafeTensors, Writer

FLOATS = ("F64", "F32", "F16", "BF16")
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # copied with a model
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"


def _json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}: {path.name} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{what}: {path} is not valid JSON") from None
    except OSError as exc:
        raise UserError(f"{what}: {path} cannot be read ({exc.strerror})") from None


@functools.lru_cache(maxsize=8)
def read_config(directory: str, what: str = "--init-from"):
    """The model config of a Hugging Face directory's config.json (checked: refused with
    the field that cannot be reproduced)."""
    where = Path(directory)
    what = f"{what} {directory}"
    if not where.is_dir():
        raise UserError(f"{what} is not a directory" if where.exists() else f"{what} does not exist")
    if not (where / "config.json").is_file():
        raise UserError(f"{what} has no config.json (give a Hugging Face model directory)")
    hf = _json(where / "config.json", what)
    if not isinstance(hf, dict):
        raise UserError(f"{what}: config.json must hold a mapping")
    try:
        architectures = hf.get("architectures")
        return hf_layout(architectures=architectures if isinstance(architectures, list) else None).config_from_hf(hf)
    except UnsupportedConfig as exc:
        raise UserError(f"{what}: config.json {exc}") from None


class Directory:
    """A Hugging Face model directory, checked whole before anything is read: every
    tensor the model needs is in a file that exists, is whole and says the right shape."""

    def __init__(self, directory: str | Path, what: str = "--init-from"):
        self.path = Path(directory)
        self.what = f"{what} {directory}"
        self.cfg = read_config(str(directory), what)
        self.tensors = hf_layout(self.cfg).tensors(self.cfg)
        self.files: dict[str, SafeTensors] = {}
        self.where = self._locate()
        self._check_shapes()

    def _locate(self) -> dict[str, str]:
        if (self.path / INDEX).is_file():
            index = _json(self.path / INDEX, self.what)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise UserError(f"{self.what}: {INDEX} has no weight_map")
        elif (self.path / SINGLE).is_file():
            weight_map = None
        else:
            raise UserError(f"{self.what} has neither {SINGLE} nor {INDEX}")
        where = {}
        for t in self.tensors:
            for i in range(self.cfg.layers if t.stacked else 1):
                for name in t.names(i):
                    file = SINGLE if weight_map is None else weight_map.get(name)
                    if file is None:
                        raise UserError(f"{self.what}: {INDEX} does not list tensor {name}")
                    where[name] = self._file(file, name)
        return where

    def _file(self, file: str, needed_for: str) -> str:
        if file not in self.files:
            path = self.path / file
            if Path(file).name != file:
                raise UserError(f"{self.what}: {INDEX} names a file outside the directory ({file!r})")
            if not path.is_file():
                raise UserError(f"{self.what}: shard {file} is missing (it holds {needed_for})")
            try:
                self.files[file] = SafeTensors(path)
            except Damaged as exc:
                raise UserError(f"{self.what}: {exc}") from None
            except OSError as exc:
                raise UserError(f"{self.what}: {file} cannot be read ({exc.strerror})") from None
        return file

    def _check_shapes(self) -> None:
        for t in self.tensors:
            for i in range(self.cfg.layers if t.stacked else 1):
                for name, shape in zip(t.names(i), t.shapes):
                    file = self.files[self.where[name]]
                    if name not in file:
                        raise UserError(f"{self.what}: tensor {name} is not in {file.path.name}")
                    if file.dtype(name) not in FLOATS:
                        raise UserError(f"{self.what}: tensor {name} holds {file.dtype(name)}, not floating point")
                    if file.shape(name) != shape:
                        raise UserError(f"{self.what}: tensor {name} has shape {list(file.shape(name))}; "
                                        f"config.json makes it {list(shape)}")

    def layer(self, t: Tensor, i: int) -> np.ndarray:
        """Our parameter `t` of layer `i` (or the whole of an unstacked one), float32."""
        try:
            parts = [self.files[self.where[name]].read(name).astype(np.float32) for name in t.names(i)]
        except (Damaged, OSError) as exc:
            raise UserError(f"{self.what}: {exc}") from None
        return t.to_ours(parts)



def tokenizer_of(directory: str | Path) -> str | None:
    """A Hugging Face directory's tokenizer.json, if it has one."""
    path = Path(directory) / "tokenizer.json"
    return str(path) if path.is_file() else None


# ------------------------------------------------------------------ loading

def load_params(directory: Directory, layout) -> dict:
    """The directory's parameters placed in `layout`'s parameter shardings (pure dict)."""
    import jax
    from flax import traverse_util

    shardings = traverse_util.flatten_dict(layout.shardings(layout.rules.params))
    shapes = traverse_util.flatten_dict(layout.skeleton.shapes)
    placed = {}
    for t in directory.tensors:
        sharding, shape = shardings[t.ours], shapes[t.ours].shape
        if not t.stacked:
            placed[t.ours] = _place(directory.layer(t, 0), sharding)
            continue
        lead = 2 if layout.repeats > 1 else 1  # (layers, ...), or a circular pipeline's (repeats, layers / repeats, ...)
        per_layer = jax.sharding.NamedSharding(sharding.mesh, jax.P(*_padded(sharding.spec, len(shape))[lead:]))
        stacked = _zeros(shape, sharding)
        for i in range(directory.cfg.layers):
            stacked = _set_layer(stacked, _place(directory.layer(t, i), per_layer), np.unravel_index(i, shape[:lead]))
        placed[t.ours] = stacked
    return traverse_util.unflatten_dict(placed)


def _padded(spec, ndim: int) -> tuple:
    return (*spec, *([None] * (ndim - len(spec))))


def _place(value: np.ndarray, sharding):
    import jax

    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


@functools.cache
def _zeros_fn(shape, sharding):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)


def _zeros(shape, sharding):
    return _zeros_fn(tuple(shape), sharding)()


@functools.cache
def _setter(sharding):
    import jax

    return jax.jit(lambda stacked, value, index: stacked.at[index].set(value), out_shardings=sharding,
                   donate_argnums=0)


def _set_layer(stacked, value, index):
    return _setter(stacked.sharding)(stacked, value, tuple(int(i) for i in index))


def from_pretrained(path: str | Path, mesh=None, dtype: str = "float32"):
    """The model of a Hugging Face directory, its parameters on one device (`mesh` None),
    or laid out on `mesh` (our flag's form, e.g. "fsdp=2,tp=2", or a jax Mesh with our axis
    names) as training lays them out. Calling it on token ids (batch, seq) gives float32
    logits (batch, seq, vocab)."""
    import dataclasses

    import jax
    from flax import nnx

    from spmd.config import TrainConfig
    from spmd.layout import make_layout
    from spmd.mesh import MeshSpec

    directory = Directory(path, "from_pretrained")
    devices = jax.devices()[:1]
    mesh_text = "dp=1"
    if isinstance(mesh, str):
        spec = MeshSpec.parse(mesh)
        mesh_text = mesh
        devices = jax.devices() if spec.has_remaining else jax.devices()[:spec.devices]
    elif mesh is not None:
        mesh_text = ",".join(f"{name}={size}" for name, size in mesh.shape.items())
        devices = list(mesh.devices.flat)
    cfg = dataclasses.replace(TrainConfig(), mesh=mesh_text, architecture=directory.cfg, dtype=dtype)
    layout = make_layout(cfg, devices, for_training=False)
    return nnx.merge(layout.skeleton.graphdef, load_params(directory, layout))


# ------------------------------------------------------------------ writing

def write_hf(out: Path, params: dict, model_cfg, dtype, shard_bytes: int, copies: dict[str, Path]) -> list[str]:
    """Write `params` (our layout, on any mesh) as a Hugging Face directory in `out`:
    config.json, safetensors files of at most `shard_bytes` each (one tensor may exceed it)
    with their index, and `copies` (name in `out` -> file: the tokenizer's). -> files written"""
    from flax import traverse_util

    layout = hf_layout(model_cfg)
    why_not = layout.supported(model_cfg)
    if why_not:
        raise UserError(f"this model has no Hugging Face layout: {why_not}")
    flat = traverse_util.flatten_dict(params)
    itemsize = np.dtype(dtype).itemsize
    order = [(t, i) for t in layout.tensors(model_cfg) for i in range(model_cfg.layers if t.stacked else 1)]
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
        value = _gathered(flat[t.ours], i if t.stacked else None)
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
    out.mkdir(parents=True, exist_ok=False)
    copies = {name: Path(tokenizer_from) / name for name in (*TOKENIZER_FILES, GENERATION_CONFIG)
              if tokenizer_from and (Path(tokenizer_from) / name).is_file()}
    return write_hf(out, params, model_cfg, dtype, max_shard_bytes, copies)


def _gathered(array, layer: int | None) -> np.ndarray:
    """Layer `layer` of a stacked parameter (layers, ...), or an unstacked one, whole on
    this host, float32."""
    import jax

    value = array if layer is None else array[layer]
    return np.asarray(jax.device_get(value), np.float32)
