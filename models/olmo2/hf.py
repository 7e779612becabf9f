"""OLMo 2 in Hugging Face's layout (Olmo2ForCausalLM): Llama's config.json fields less
those Olmo2Config has not, and Llama's tensors with the block's norms as OLMo 2 states
them (`Olmo2Config.NORMS`): `post_attention_layernorm`, `post_feedforward_layernorm` and
`self_attn.{q,k}_norm` over the whole projections, named by models.llama.hf.norm_name."""

from __future__ import annotations

from models.llama import hf as llama
from models.llama.hf import Tensor
from models.olmo2.model import Olmo2Config
from spmd.base.schema import NUMBER, Field

ARCHITECTURES = {"Olmo2ForCausalLM": "olmo2"}  # with its model_type (models.llama.hf)
NOT_OLMO2 = ("mlp_bias", "pretraining_tp", "sliding_window", "router_jitter_noise", "router_aux_loss_coef")
# Llama's fields less those Olmo2Config has not; rms_norm_eps at transformers' Olmo2 default.
CONFIG = (*(f for f in llama.CONFIG if f.name not in (*NOT_OLMO2, "rms_norm_eps")),
          Field("rms_norm_eps", NUMBER, llama.POSITIVE, 1e-5))

copies = llama.copies  # (its head is untied in every published size; a tied one is read as Llama's)


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG, llama.RULES)


def config_from_hf(hf: dict) -> Olmo2Config:
    """Our config of an OLMo 2 config.json; anything it cannot compute exactly is refused."""
    return llama.config_of(config_values(hf), Olmo2Config)


def config_to_hf(cfg: Olmo2Config) -> dict:
    hf = llama.config_to_hf(cfg) | {
        "architectures": list(ARCHITECTURES), "model_type": ARCHITECTURES["Olmo2ForCausalLM"]}
    del hf["mlp_bias"]  # not an OLMo 2 field
    return hf


def supported(cfg: Olmo2Config) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    if cfg.moe or cfg.window or cfg.qkv_bias or not cfg.qk_norm:
        return "Olmo2ForCausalLM is dense, with q/k norms, and no sliding window or q/k/v biases"
    return None


def tensors(cfg: Olmo2Config) -> list[Tensor]:
    return llama.tensors(cfg)


tensor_count = llama.count_of(tensors)
