"""Mistral: Llama's decoder whose attention may see only the last `window` keys in every
layer (Mistral 7B v0.1's 4096; v0.3 has none). The module is Llama's, which reads the
window; the config is a class of its own so that its Hugging Face layout and its saved
form name the family."""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig
from models.llama.model import Llama


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    family: str = "mistral"


Mistral = Llama
