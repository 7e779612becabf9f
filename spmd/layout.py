"""The layout of a run on its devices, at the import path of the Python API (`make_layout`);
the code lives in spmd.parallel.layout."""

from spmd.parallel.layout import Layout, make_layout

__all__ = ["Layout", "make_layout"]
