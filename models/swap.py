"""A computation that whoever runs the model may swap for another (e.g. a parallel one
written with `jax.shard_map` in spmd/) without the model knowing: the model calls the
`Swappable`; a trainer enters `use(implementation)` around the call."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable


class Swappable:
    def __init__(self, name: str, default: Callable):
        self._chosen: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(name, default=None)
        self._default = default

    def __call__(self, *args):
        return (self._chosen.get() or self._default)(*args)

    @contextlib.contextmanager
    def use(self, implementation: Callable | None):
        """Within this context calls go to `implementation` (None: the default)."""
        token = self._chosen.set(implementation)
        try:
            yield
        finally:
            self._chosen.reset(token)
