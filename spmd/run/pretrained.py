"""`from_pretrained`: a Hugging Face directory's model on one device or laid out on a mesh,
as a Flax module to call (spmd.formats.hf reads the files)."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from models.lora import joined
from spmd.formats.hf import Directory, load_params
from spmd.formats.peft import AdapterFiles
from spmd.parallel.layout import make_layout
from spmd.parallel.mesh import MeshSpec
from spmd.run.config import TrainConfig
from spmd.run.resolve import with_adapter


def from_pretrained(path: str | Path, mesh=None, dtype: str = "float32", adapter: str | Path | None = None):
    """The model of a Hugging Face directory, its parameters on one device (`mesh` None),
    or laid out on `mesh` (our flag's form, e.g. "fsdp=2,tp=2", or a jax Mesh with our axis
    names) as training lays them out; with `adapter` (a PEFT LoRA adapter directory) on its
    projections. Calling it on token ids (batch, seq) gives float32 logits (batch, seq, vocab)."""

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
    cfg = TrainConfig.of(mesh=mesh_text, architecture=directory.cfg, dtype=dtype,
                              adapter=adapter and str(adapter))
    layout = make_layout(with_adapter(cfg).step, devices, for_training=False)
    params = load_params(directory, layout)
    if adapter:
        skeleton = layout.skeleton
        params = joined(params, load_params(AdapterFiles(adapter, skeleton.model_cfg, skeleton.lora, "adapter"), layout))
    return nnx.merge(layout.skeleton.graphdef, params)
