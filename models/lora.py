"""Low-rank adapters (LoRA) on a model's projections, as PEFT defines them.

A projection W (inputs -> outputs) gains `scale · B A`: y = W x + (alpha / rank) · B (A x),
A (inputs -> rank) drawn as PEFT draws it (Kaiming-uniform with a = √5: uniform within
±1/√fan_in), B (rank -> outputs) zeros, so that an adapted model starts as its base. A's
input dimensions carry the weight's input names and B's output dimensions its output
names, so a trainer lays adapters out by the same rules as the weights they adapt; the
rank dimension is never split.

Targets are named as Hugging Face names the projections (PEFT's `target_modules`); the
model fuses some (keys with values, gate with up), each adapted part on its own.

Dropout (PEFT's `lora_dropout`) drops elements of an adapter's input, B A dropout(x), while
a trainer asks for it (`dropout`): each adapter of each layer draws its own mask from the
trainer's key, folded with the adapter's target and the layer (`layer`, which whoever runs
the stacked layers says).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.annotate import weight

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
PREFIX = "lora_"  # an adapter's attribute name: lora_<target>, e.g. lora_q_proj
_DROPOUT: contextvars.ContextVar = contextvars.ContextVar("lora_dropout", default=None)
_LAYER: contextvars.ContextVar = contextvars.ContextVar("lora_layer", default=0)

MAX_ALPHA = 1e6  # alpha / rank scales the adapters' output: far beyond any used, short of float32's overflow


@dataclasses.dataclass(frozen=True)
class LoRA:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ATTENTION_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, target: str) -> bool:
        return target in self.targets


@contextlib.contextmanager
def dropout(rate: float, key: jax.Array):
    """Adapters called inside drop each input element with probability `rate` (and scale
    the rest by 1 / (1 - rate)), their masks drawn from `key`."""
    token = _DROPOUT.set((rate, key) if rate > 0 else None)
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def dropping() -> bool:
    return _DROPOUT.get() is not None


def folded(index: jax.Array):
    """Dropout inside with `index` folded into the key (one microbatch of several), if any."""
    drop = _DROPOUT.get()
    return dropout(drop[0], jax.random.fold_in(drop[1], index)) if drop else contextlib.nullcontext()


@contextlib.contextmanager
def layer(index: jax.Array | int):
    """The layer that adapters called inside belong to (their masks differ by it)."""
    token = _LAYER.set(index)
    try:
        yield
    finally:
        _LAYER.reset(token)


def current_layer() -> jax.Array | int:
    return _LAYER.get()


def is_adapter(path) -> bool:
    """Whether a parameter (a path of keys, or of tree-path entries) belongs to an adapter."""
    return any(str(getattr(k, "key", k)).startswith(PREFIX) for k in path)


def split(tree: dict) -> tuple[dict, dict]:
    """Nested dicts of parameters -> (the adapters', the rest's), each nested as given
    (empty dicts left out)."""
    adapters, rest = {}, {}
    for key, value in tree.items():
        if str(key).startswith(PREFIX):
            adapters[key] = value
        elif isinstance(value, dict):
            a, r = split(value)
            if a:
                adapters[key] = a
            if r:
                rest[key] = r
        else:
            rest[key] = value
    return adapters, rest


def joined(rest: dict, adapters: dict) -> dict:
    """The inverse of `split`."""
    out = dict(rest)
    for key, value in adapters.items():
        out[key] = joined(out[key], value) if key in out and isinstance(value, dict) else value
    return out


class Adapter(nnx.Module):
    """`scale · B A` of one projection: inputs (its shape and logical names) -> outputs."""

    def __init__(self, lora: LoRA, target: str, inputs: tuple[int, ...], in_names: tuple, outputs: tuple[int, ...],
                 out_names: tuple, rngs: nnx.Rngs):
        bound = math.prod(inputs) ** -0.5  # PEFT's kaiming_uniform_(a=√5): gain √(1/3) × √(3 / fan_in)
        # A stream of its own, so that an adapted model's base is drawn as the same model's without.
        a = jax.random.uniform(rngs.lora(), (*inputs, lora.rank), jnp.float32, -bound, bound)
        self.a = nnx.Param(a, out_sharding=(*in_names, None), eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((lora.rank, *outputs), jnp.float32), out_sharding=(None, *out_names),
                           eager_sharding=False)
        self.scale, self.target = lora.scale, TARGETS.index(target)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x (..., *inputs) -> (..., *outputs), in x's dtype."""
        if (drop := _DROPOUT.get()) is not None:
            rate, key = drop
            key = jax.random.fold_in(jax.random.fold_in(key, self.target), _LAYER.get())
            x = jnp.where(jax.random.bernoulli(key, 1 - rate, x.shape), x / (1 - rate), 0).astype(x.dtype)
        inputs = self.a.ndim - 1
        h = jnp.tensordot(x, weight(self.a, x.dtype), axes=inputs)
        return jnp.tensordot(h, weight(self.b, x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)


def merged(params: dict, lora: LoRA, fused: dict, input_dims: dict) -> dict:
    """`params` with every adapter merged into the weight it adapts (W + scale · B A) and
    removed: the model as PEFT's merge_and_unload makes it. `fused`: target -> (the
    weight's name beside the adapter, and the index of the target's part along its
    second-last dimension where the weight is several projections side by side, else None);
    `input_dims`: target -> how many of A's dimensions are inputs."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict) and not str(key).startswith(PREFIX):
            out[key] = merged(value, lora, fused, input_dims)
        elif not str(key).startswith(PREFIX):
            out[key] = value
    for key in (k for k in params if str(k).startswith(PREFIX)):
        target = key[len(PREFIX):]
        name, part = fused[target]
        a, b = params[key]["a"], params[key]["b"]
        lead = a.shape[:a.ndim - 1 - input_dims[target]]  # the stacked layers' dimensions
        flat = jnp.matmul(a.reshape(*lead, -1, lora.rank), b.reshape(*lead, lora.rank, -1))
        delta = (lora.scale * flat).reshape(*a.shape[:-1], *b.shape[len(lead) + 1:])
        out[name] = out[name] + delta if part is None else out[name].at[..., part, :].add(delta)
    return out
