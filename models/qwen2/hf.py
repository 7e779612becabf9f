"""Qwen2 and Qwen2.5 in Hugging Face's layout (Qwen2ForCausalLM): Llama's config.json and
tensors, and each layer's `self_attn.{q,k,v}_proj.bias`. Qwen2's config has no
attention_bias or mlp_bias (the biases are always there, on q, k and v only): a config
that names them is refused. Sliding windows, which published configs switch off
(`use_sliding_window: false`), are refused when switched on."""

from __future__ import annotations

import numpy as np

from models.llama import hf as llama
from models.llama.hf import Tensor
from models.qwen2.model import Qwen2Config
from spmd.base.schema import ANY, BOOLEAN, LIST, Field, Rule

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2"}  # with its model_type (models.llama.hf)
# The window fields of Qwen's configs (Qwen2, Qwen3): a window only counts where
# use_sliding_window turns it on, for the layers from max_window_layers on.
WINDOWS = (
    Field("use_sliding_window", BOOLEAN, default=False, choices=(False,)),
    Field("sliding_window", ANY, default=None),  # read by transformers only with use_sliding_window
    Field("max_window_layers", ANY, default=None),  # likewise
    Field("layer_types", LIST, default=None, nullable=True),
)
WINDOW_RULES = (
    Rule("layer_types", lambda v: v["layer_types"] is None or set(v["layer_types"]) <= {"full_attention"},
         "must hold only full_attention layers (got {layer_types}): sliding windows are not reproduced here"),
)
NOT_QWEN2 = ("sliding_window", "attention_bias", "mlp_bias")  # Llama's fields that Qwen2's config does not have
CONFIG = (*(f for f in llama.CONFIG if f.name not in NOT_QWEN2), *WINDOWS)
RULES = (*llama.RULES, *WINDOW_RULES)

copies = llama.copies  # a tied model's lm_head.weight copy, as Llama's


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG, RULES)


def config_from_hf(hf: dict) -> Qwen2Config:
    """Our config of a Qwen2 config.json; anything it cannot compute exactly is refused."""
    return llama.config_of(config_values(hf), Qwen2Config)


def config_to_hf(cfg: Qwen2Config) -> dict:
    hf = llama.config_to_hf(cfg) | {"architectures": list(ARCHITECTURES),
                                    "model_type": ARCHITECTURES["Qwen2ForCausalLM"],
                                    "use_sliding_window": False, "sliding_window": None}
    for name in ("attention_bias", "mlp_bias"):
        del hf[name]
    return hf


def supported(cfg: Qwen2Config) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    if cfg.moe:
        return "Qwen2ForCausalLM is dense"
    if cfg.qk_norm or cfg.window or not cfg.qkv_bias:
        return "Qwen2ForCausalLM has q, k and v biases, and no q/k norms or sliding window"
    return None


def tensors(cfg: Qwen2Config) -> list[Tensor]:
    h, k, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    biases = []
    for b in llama.blocks(cfg):
        biases += [
            Tensor((*b.ours, "attn", "bq"), b.steps, b.names("self_attn.q_proj.bias"), [(h * d,)],
                   lambda t: t[0].reshape(h, d), lambda w: [w.reshape(h * d)]),
            Tensor((*b.ours, "attn", "bkv"), b.steps, b.names("self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                   [(k * d,), (k * d,)], lambda t: np.stack([t[0].reshape(k, d), t[1].reshape(k, d)], axis=1),
                   lambda w: [w[:, 0].reshape(k * d), w[:, 1].reshape(k * d)]),
        ]
    return llama.tensors(cfg) + biases


tensor_count = llama.count_of(tensors)
