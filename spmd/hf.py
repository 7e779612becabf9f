"""Hugging Face directories, at the import path of the Python API (`from_pretrained`,
`save_pretrained`, `Directory`, `load_params`); the code lives in spmd.formats.hf and
spmd.run.pretrained."""

from spmd.formats.hf import Directory, load_params, save_pretrained
from spmd.run.pretrained import from_pretrained

__all__ = ["Directory", "from_pretrained", "load_params", "save_pretrained"]
