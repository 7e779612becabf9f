"""Sizes as a run prints them, at the import path the notebooks use (`human_bytes`); the
code lives in spmd.base.console."""

from spmd.base.console import human_bytes

__all__ = ["human_bytes"]
