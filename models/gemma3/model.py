"""Gemma 3 (text): a decoder whose layers alternate between sliding-window (local) and
global attention (`layer_types`, five local then one global in the published sizes), with
a rope base of their own for the local layers, RMSNorm scaled by (1 + weight), four norms
per block (before and after attention and the MLP), per-head query and key norms, a GeGLU
MLP with tanh-approximated GELU, embeddings scaled by sqrt(hidden), a tied head, and
scores scaled by query_pre_attn_scalar ** -0.5.

Written as a composition of Llama's parts (docs/architecture.md, "A new family"): its
config adds the layer pattern and the rotations' data to Llama's; its block names its
attention, norm and MLP and adds the two norms after them; the model names its block and
its embedding scale. The parallel machinery (scan, pipeline stages, kernels, KV cache) is
the one every family uses; the layers' kinds go with them (`Llama.layer_kinds`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.llama.config import LlamaConfig, Norms
from models.llama.layers import RMSNorm
from models.llama.model import Attention, Block, Llama, SwiGLU

# What the parts below make of the flags the family's config had when they were Llama's
# (a run saved then holds them at these values).
BUILT_IN = {"norm_offset": True, "sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": True}


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qk_norm: bool = True
    layer_types: tuple[str, ...] | None = None  # per layer, "sliding_attention" (the window) or "full_attention"
    local_rope_theta: float | None = None  # the rope base of the sliding layers (None: rope_theta)
    rope_linear_factor: float = 1.0  # positions slowed by this on the full-attention layers (linear rope scaling)
    query_scale: float | None = None  # scores scaled by query_scale ** -0.5 (query_pre_attn_scalar; None: head_dim)
    family: str = "gemma3"
    NORMS = Norms(after=True)  # before and after attention and the MLP

    @classmethod
    def from_dict(cls, d: dict) -> Gemma3Config:
        values = {k: v for k, v in d.items() if k not in BUILT_IN or v != BUILT_IN[k]}
        if values.get("layer_types") is not None:  # saved as a list; a config is hashable
            values["layer_types"] = tuple(values["layer_types"])
        return super().from_dict(values)

    @property
    def local_layers(self) -> np.ndarray | None:
        return None if self.layer_types is None else np.array([t == "sliding_attention" for t in self.layer_types])

    @property
    def local_rope_frequencies(self) -> np.ndarray:
        """The sliding layers' angles per position (they have no scaling)."""
        return self._frequencies(self.local_rope_theta or self.rope_theta)

    @property
    def rope_frequencies(self) -> np.ndarray:
        freqs = super().rope_frequencies
        return freqs if self.rope_linear_factor == 1.0 else (freqs / np.float32(self.rope_linear_factor)).astype(
            np.float32)


def layer_types(layers: int, every: int = 6) -> tuple[str, ...]:
    """The published pattern: every `every`-th layer global, the others local (transformers'
    sliding_window_pattern)."""
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers))


OffsetNorm = functools.partial(RMSNorm, offset=True)  # scales by 1 + its weight, which starts at 0


class GemmaAttention(Attention):
    """Llama's attention with offset q/k norms, the local layers' own rope base, and the
    queries scaled by query_pre_attn_scalar ** -0.5 in place of head_dim ** -0.5."""

    NORM = OffsetNorm

    def _frequencies(self, local: jax.Array | None) -> jax.Array:
        cfg = self.cfg
        return cfg.rope_frequencies if local is None else jnp.where(local, cfg.local_rope_frequencies,
                                                                    cfg.rope_frequencies)

    def _scaled(self, q: jax.Array) -> jax.Array:
        if self.cfg.query_scale is None:
            return q
        return q * np.float32(math.sqrt(self.cfg.head_dim / self.cfg.query_scale)).astype(q.dtype)


class GeGLU(SwiGLU):
    ACTIVATION = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class GemmaBlock(Block):
    """Llama's block of Gemma's parts (its config's NORMS adds a norm after attention and
    after the MLP, before each residual sum)."""

    ATTENTION, MLP, NORM = GemmaAttention, GeGLU, OffsetNorm


class Gemma3(Llama):
    BLOCK = GemmaBlock
    EMBED_SCALE = True
