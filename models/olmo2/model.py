"""OLMo 2: Llama's decoder with the norms moved after each sublayer (an RMSNorm of
attention's output and of the MLP's, before each residual sum; none before them) and an
RMSNorm of the whole query and key projections (heads x head_dim, kv_heads x head_dim)
before the rotation; an untied head. The module is Llama's: the config states its norms
(`NORMS`), which Llama's block and attention build (models.family)."""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig, Norms
from models.llama.model import Llama


@dataclasses.dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    qk_norm: bool = True
    family: str = "olmo2"
    NORMS = Norms(before=False, after=True, qk="projection")


Olmo2 = Llama
