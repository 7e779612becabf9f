"""Qwen3 (dense): Llama's decoder with an RMSNorm of each query and key head before the
rotation (`qk_norm`), a head size of its own (not hidden / heads), and tied embeddings in
the small sizes. The module is Llama's, which reads the flag; the config is a class of its
own so that its Hugging Face layout and its saved form name the family."""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig
from models.llama.model import Llama


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True
    family: str = "qwen3"


Qwen3 = Llama
