"""Qwen3 in Hugging Face's layout (Qwen3ForCausalLM): Llama's config.json and tensors, and
each layer's `self_attn.q_norm` and `self_attn.k_norm`. Sliding windows, which published
Qwen3 configs switch off (`use_sliding_window: false`), are refused when switched on."""

from __future__ import annotations

from models.llama import hf as llama
from models.llama.hf import Tensor
from models.qwen3.model import Qwen3Config
from spmd.base.schema import ANY, BOOLEAN, LIST, Field, Rule

ARCHITECTURES = ("Qwen3ForCausalLM",)
# Llama's fields, but a window only counts where use_sliding_window turns it on.
CONFIG = (
    *(f for f in llama.CONFIG if f.name != "sliding_window"),
    Field("use_sliding_window", BOOLEAN, default=False, choices=(False,)),
    Field("sliding_window", ANY, default=None),  # read by transformers only with use_sliding_window
    Field("max_window_layers", ANY, default=None),  # likewise
    Field("layer_types", LIST, default=None, nullable=True),
)
RULES = (
    *llama.RULES,
    Rule("layer_types", lambda v: v["layer_types"] is None or set(v["layer_types"]) <= {"full_attention"},
         "must hold only full_attention layers (got {layer_types}): sliding windows are not reproduced here"),
)


copies = llama.copies  # a tied model's lm_head.weight copy, as Llama's (Qwen3-0.6B ships one)


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG, RULES)


def config_from_hf(hf: dict) -> Qwen3Config:
    """Our config of a Qwen3 config.json; anything it cannot compute exactly is refused."""
    return llama.config_of(config_values(hf), Qwen3Config)


def config_to_hf(cfg: Qwen3Config) -> dict:
    hf = llama.config_to_hf(cfg) | {"architectures": list(ARCHITECTURES), "model_type": "qwen3",
                                    "use_sliding_window": False, "sliding_window": None}
    del hf["mlp_bias"]  # not a Qwen3 field
    return hf


def supported(cfg: Qwen3Config) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    if cfg.moe:
        return "Qwen3ForCausalLM is dense (Qwen3-MoE is another architecture)"
    return None


def tensors(cfg: Qwen3Config) -> list[Tensor]:
    norms = [Tensor(("blocks", "attn", f"{x}_norm", "scale"), True,
                    lambda i, x=x: [f"model.layers.{i}.self_attn.{x}_norm.weight"], [(cfg.head_dim,)],
                    lambda t: t[0], lambda w: [w]) for x in ("q", "k")]
    return llama.tensors(cfg) + norms


def tensor_count(cfg: Qwen3Config) -> tuple[int, str]:
    count, fields = llama.tensor_count(cfg)
    return count + 2 * cfg.layers, fields
