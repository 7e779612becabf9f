"""The layout of a run on its devices, at the import path of the Python API (`make_layout`
of a run's options, spmd.config.TrainConfig); the code lives in spmd.parallel.layout."""

from spmd.parallel import layout
from spmd.parallel.layout import Layout


def make_layout(cfg, devices=None, for_training: bool = True) -> Layout:
    """The mesh, rules and model of the run `cfg` on `devices` (default: all), checked:
    spmd.parallel.layout.make_layout of the options its step is built from (`cfg.step`)."""
    return layout.make_layout(cfg.step, devices, for_training)


__all__ = ["Layout", "make_layout"]
