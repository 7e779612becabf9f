"""Stacks of layers: modules made `count` times along a leading axis, which a scan runs (so
compile time does not grow with depth), and the slices of them that a model's layer
pattern runs in turn (`LlamaConfig.layer_runs`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama.config import LlamaConfig


def stack_of(make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs, count: int, axis: str) -> nnx.Module:
    """`count` modules made by `make`, each from its own draws, stacked along a leading
    axis with the logical name `axis`."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def made(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return made(rngs)


def each_stacked(stack: nnx.Module, fn) -> nnx.Module:
    """`stack` with fn applied to each of its arrays (steps first)."""
    graph, state = nnx.split(stack)
    return nnx.merge(graph, jax.tree.map(fn, state))


def steps(stack: nnx.Module) -> int:
    return jax.tree.leaves(nnx.state(stack))[0].shape[0]


def steps_of(stack: nnx.Module, first: int, count: int) -> nnx.Module:
    """Steps first to first + count of `stack` (the stack itself where that is all of it)."""
    if (first, count) == (0, steps(stack)):
        return stack
    return each_stacked(stack, lambda a: a[first:first + count])


def with_empty_steps(stack: nnx.Module, cfg: LlamaConfig) -> nnx.Module:
    """`stack` (the stacked blocks) followed by `cfg.empty_layers` empty ones, all zeros: the
    layers start as they would without them (the same draws), and the empty ones, which
    pipeline stages run without effect (`Llama.run_layers`), stay zeros."""
    if not cfg.empty_layers:
        return stack
    return each_stacked(stack, lambda a: jnp.concatenate([a, jnp.zeros((cfg.empty_steps, *a.shape[1:]), a.dtype)]))


def joined(stats: list[dict]) -> dict:
    """The statistics of runs of one stack (stacked along their leading layer axis), as one
    run of all of them would give them."""
    if len(stats) == 1:
        return stats[0]
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *stats)
