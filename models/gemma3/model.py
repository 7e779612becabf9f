"""Gemma 3 (text): a decoder whose layers alternate between sliding-window (local) and
global attention (`layer_types`, five local then one global in the published sizes), with
a rope base of their own for the local layers, RMSNorm scaled by (1 + weight), four norms
per block (before and after attention and the MLP), per-head query and key norms, a GeGLU
MLP with tanh-approximated GELU, embeddings scaled by sqrt(hidden), a tied head, and
scores scaled by query_pre_attn_scalar ** -0.5.

Each of these is a flag of Llama's shared layers (models.llama.config), so the module is
Llama's: the parallel machinery (scan, pipeline stages, kernels, KV cache) is the one every
family uses, and the layers' kinds ride along with them (`Llama.layer_kinds`). The config
is a class of its own so that its Hugging Face layout and its saved form name the family."""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig
from models.llama.model import Llama


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qk_norm: bool = True
    norm_offset: bool = True
    sandwich_norms: bool = True
    activation: str = "gelu_tanh"
    embed_scale: bool = True
    family: str = "gemma3"


def layer_types(layers: int, every: int = 6) -> tuple[str, ...]:
    """The published pattern: every `every`-th layer global, the others local (transformers'
    sliding_window_pattern)."""
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers))


Gemma3 = Llama
