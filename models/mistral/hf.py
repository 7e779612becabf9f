"""Mistral in Hugging Face's layout (MistralForCausalLM): Llama's config.json and tensors,
with `sliding_window` (transformers' default 4096 when the field is absent; null for
none)."""

from __future__ import annotations

import dataclasses

from models.llama import hf as llama
from models.mistral.model import MistralConfig
from spmd.base.schema import INTEGER, Field

ARCHITECTURES = {"MistralForCausalLM": "mistral"}  # with its model_type (models.llama.hf)
NOT_MISTRAL = ("sliding_window", "attention_bias", "mlp_bias", "pretraining_tp")  # Llama's fields Mistral's lacks
CONFIG = (*(f for f in llama.CONFIG if f.name not in NOT_MISTRAL),
          Field("sliding_window", INTEGER, llama.POSITIVE, 4096, nullable=True))

copies = llama.copies
tensors = llama.tensors  # Llama's names and shapes
tensor_count = llama.tensor_count


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG, llama.RULES)


def config_from_hf(hf: dict) -> MistralConfig:
    """Our config of a Mistral config.json; anything it cannot compute exactly is refused."""
    values = config_values(hf)
    return dataclasses.replace(llama.config_of(values, MistralConfig), window=llama.window_of(values["sliding_window"]))


def config_to_hf(cfg: MistralConfig) -> dict:
    hf = llama.config_to_hf(cfg) | {"architectures": list(ARCHITECTURES),
                                    "model_type": ARCHITECTURES["MistralForCausalLM"],
                                    "sliding_window": cfg.window}
    for name in ("attention_bias", "mlp_bias"):
        del hf[name]
    return hf


def supported(cfg: MistralConfig) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    if cfg.moe or cfg.qk_norm or cfg.qkv_bias:
        return "MistralForCausalLM is dense, with no q/k norms or biases"
    return None
