"""`from_pretrained`: a Hugging Face directory's model on one device or laid out on a mesh,
as a Flax module to call (spmd.formats.hf reads the files)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from spmd.formats.hf import Directory, load_params
from spmd.parallel.layout import make_layout
from spmd.parallel.mesh import MeshSpec
from spmd.run.config import TrainConfig


def from_pretrained(path: str | Path, mesh=None, dtype: str = "float32"):
    """The model of a Hugging Face directory, its parameters on one device (`mesh` None),
    or laid out on `mesh` (our flag's form, e.g. "fsdp=2,tp=2", or a jax Mesh with our axis
    names) as training lays them out. Calling it on token ids (batch, seq) gives float32
    logits (batch, seq, vocab)."""


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
