"""The decoding program: prefill a batch of prompts into a key/value cache, then generate
one token at a time inside one compiled loop (a `lax.scan`: no Python and no host sync
per token).

Prompts are left-padded to a bucket length P, so every row's last prompt token sits in
slot P - 1 and every row writes the same cache slot at each step; a row's padding slots
are masked out and its positions start at its first real token. The cache, (blocks,
batch, P + new tokens, kv_heads, head_dim) for keys and again for values, is laid out by
the training rules: its batch split over the batch axes, its heads over tp.

Sampling: temperature 0 is greedy; otherwise logits / temperature, then top-k, then
top-p (the smallest set of most likely tokens whose probability reaches p), then a draw
whose key is (seed, step, the prompt's index), so a prompt gets the same text in any batch
and on any mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import Decoding, model_class
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import BATCH_AXES
from spmd.parallel.rules import placed, spec_for
from spmd.parallel.step import model_context


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0


def sample(logits: jax.Array, sampling: Sampling, key: jax.Array, step, rows: jax.Array) -> jax.Array:
    """One token per row of float32 `logits` (batch, vocab); `rows`: each row's prompt index."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filtered(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    keys = jax.vmap(lambda row: jax.random.fold_in(jax.random.fold_in(key, step), row))(rows)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def filtered(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """`logits` with the tokens outside the top k, then outside the top-p nucleus, at -inf."""
    never = jnp.finfo(logits.dtype).min
    if top_k:
        kth = jnp.sort(logits, axis=-1)[:, -top_k][:, None]
        logits = jnp.where(logits < kth, never, logits)
    if top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
        threshold = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, never, logits)
    return logits


@dataclasses.dataclass
class Decoder:
    """Compiled prefill and generation for one layout and one shape: `batch` rows of
    prompts padded to `prompt_len`, `new_tokens` generated."""

    layout: Layout
    batch: int
    prompt_len: int
    new_tokens: int
    sampling: Sampling
    cache_dtype: str = "float32"  # the run's compute dtype: keys and values are computed in it
    slots: int = 0  # the cache's length, if more than prompt_len + new_tokens (a server's preallocated cache)

    def __post_init__(self):
        layout, model_cfg = self.layout, self.layout.skeleton.model_cfg
        self.length = max(self.prompt_len + self.new_tokens, self.slots)
        table = placed(layout.rules.activations) | {"batch": BATCH_AXES}
        # The model's cache arrays (keys and values, or a latent): name -> (shape, sharding).
        self.cache_arrays = {name: (shape, layout.named(spec_for(names, table))) for name, (shape, names)
                             in model_class(model_cfg).cache_layout(model_cfg, self.batch, self.length).items()}
        rows = layout.named(jax.P(BATCH_AXES))
        param_sh = layout.shardings(layout.rules.params)
        cache_sh = {name: sharding for name, (_, sharding) in self.cache_arrays.items()}
        self.prefill = jax.jit(self._prefill, in_shardings=(param_sh, layout.named(jax.P(BATCH_AXES, None)), rows,
                                                            rows, layout.replicated),
                               out_shardings=(cache_sh, rows))
        self.generate = jax.jit(self._generate, in_shardings=(param_sh, cache_sh, rows, rows, rows, layout.replicated),
                                out_shardings=layout.named(jax.P(BATCH_AXES, None)))

    def cache_bytes_per_device(self) -> int:
        """One device's share of the cache."""
        return sum(math.prod(sharding.shard_shape(shape)) for shape, sharding in self.cache_arrays.values()
                   ) * jnp.dtype(self.cache_dtype).itemsize

    def _model(self, params):
        return nnx.merge(self.layout.skeleton.graphdef, params)

    def _valid(self, pads: jax.Array) -> jax.Array:
        return jnp.arange(self.length)[None, :] >= pads[:, None]

    def _logits_for_sampling(self, logits: jax.Array) -> jax.Array:
        # Whole rows of the vocabulary (which tp splits), so a draw sees every token.
        return jax.lax.with_sharding_constraint(logits.astype(jnp.float32), self.layout.named(jax.P(BATCH_AXES, None)))

    def _prefill(self, params, tokens: jax.Array, pads: jax.Array, rows: jax.Array, key: jax.Array):
        """The prompts (batch, prompt_len), left-padded by `pads` -> (cache, first new token)."""
        with model_context(self.layout, data_axes=BATCH_AXES):
            cache = {name: jax.lax.with_sharding_constraint(jnp.zeros(shape, self.cache_dtype), sharding)
                     for name, (shape, sharding) in self.cache_arrays.items()}
            positions = jnp.arange(self.prompt_len)[None, :] - pads[:, None]
            logits, cache = self._model(params).decode(tokens, positions, cache, Decoding(jnp.int32(0), self._valid(pads)))
            return cache, sample(self._logits_for_sampling(logits[:, -1]), self.sampling, key, 0, rows)

    def _generate(self, params, cache: dict, first: jax.Array, pads: jax.Array, rows: jax.Array, key: jax.Array):
        """The new tokens (batch, new_tokens): `first`, then one step per token."""
        valid = self._valid(pads)

        def step(carry, t):
            cache, token = carry
            slot = self.prompt_len + t - 1  # where the previous token goes
            with model_context(self.layout, data_axes=BATCH_AXES):
                logits, cache = self._model(params).decode(token[:, None], (slot - pads)[:, None], cache,
                                                           Decoding(slot, valid))
                token = sample(self._logits_for_sampling(logits[:, 0]), self.sampling, key, t, rows)
            return (cache, token), token

        _, rest = jax.lax.scan(step, (cache, first), jnp.arange(1, self.new_tokens, dtype=jnp.int32))
        return jnp.concatenate([first[:, None], rest.T], axis=1)

    def compile(self) -> None:
        """Compile both programs now (so that timing them measures the run, not XLA)."""
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              self.layout.skeleton.shapes, self.layout.shardings(self.layout.rules.params))
        ids = jax.ShapeDtypeStruct((self.batch,), jnp.int32)
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        tokens = jax.ShapeDtypeStruct((self.batch, self.prompt_len), jnp.int32)
        cache = {name: jax.ShapeDtypeStruct(shape, self.cache_dtype, sharding=sharding)
                 for name, (shape, sharding) in self.cache_arrays.items()}
        with jax.set_mesh(self.layout.mesh):
            self.prefill = self.prefill.lower(params, tokens, ids, ids, key).compile()
            self.generate = self.generate.lower(params, cache, ids, ids, ids, key).compile()


def left_padded(prompts: list[np.ndarray], batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts as rows (batch, length), padded on the left with zeros (rows past the last
    prompt are all padding, with one token so that they attend to something); -> (tokens, pads)."""
    tokens = np.zeros((batch, length), np.int32)
    pads = np.full(batch, length - 1, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p):] = p
        pads[i] = length - len(p)
    return tokens, pads


def bucket(length: int, smallest: int = 16) -> int:
    """The padded length of a prompt: a power of two, so that few shapes are compiled."""
    return max(smallest, 1 << max(0, length - 1).bit_length())
