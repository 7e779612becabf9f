"""Qwen2 and Qwen2.5: Llama's decoder with biases on the query, key and value projections
(not on the output's), tied embeddings in the small sizes. The module is Llama's, which
reads the flag; the config is a class of its own so that its Hugging Face layout and its
saved form name the family."""

from __future__ import annotations

import dataclasses

from models.llama.config import LlamaConfig
from models.llama.model import Llama


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    qkv_bias: bool = True
    family: str = "qwen2"


Qwen2 = Llama
