"""Qwen3 in Hugging Face's layout: Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM.
Llama's config.json and tensors, and each layer's `self_attn.q_norm` and `self_attn.k_norm`.

Qwen3-MoE: `num_experts` experts of width `moe_intermediate_size` (router `mlp.gate`,
experts `mlp.experts.N.{gate,up,down}_proj`), softmax scores and top-k, renormalized over
the k when `norm_topk_prob`; every `decoder_sparse_step`-th layer is MoE, the others dense
of width `intermediate_size`, and so are the layers listed in `mlp_only_layers` (published
configs list none; with MoE in every layer otherwise: a stack of their own, models.llama's
`prefix`). Sliding windows (published configs switch them off) are refused."""

from __future__ import annotations

import dataclasses

from models.llama import hf as llama
from models.llama.hf import ExpertNames, Tensor
from models.moe import MoEConfig
from models.qwen2.hf import WINDOW_RULES, WINDOWS
from models.qwen3.model import Qwen3Config
from spmd.base.schema import BOOLEAN, INTEGER, LIST, Field, Rule

DENSE, MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = {DENSE: "qwen3", MOE: "qwen3_moe"}  # with their model_type (models.llama.hf)
# Llama's fields, with Qwen's window fields for its sliding_window.
CONFIG = (*(f for f in llama.CONFIG if f.name != "sliding_window"), *WINDOWS)
MOE_CONFIG = (
    Field("num_experts", INTEGER, llama.POSITIVE, None, nullable=True),
    Field("num_local_experts", INTEGER, llama.POSITIVE, None, nullable=True),  # transformers 5 writes this name
    Field("num_experts_per_tok", INTEGER, llama.POSITIVE),
    Field("moe_intermediate_size", INTEGER, llama.POSITIVE),
    Field("norm_topk_prob", BOOLEAN, default=False),
    Field("decoder_sparse_step", INTEGER, llama.POSITIVE, 1),
    Field("mlp_only_layers", LIST, default=None, nullable=True),
)
RULES = (*llama.RULES, *WINDOW_RULES)
MOE_RULES = (
    Rule("num_experts", lambda v: (v["num_experts"] or v["num_local_experts"]) is not None,
         "is missing (or num_local_experts)"),
    Rule("num_experts_per_tok", lambda v: v["num_experts_per_tok"] <= (v["num_experts"] or v["num_local_experts"]),
         "{num_experts_per_tok} is more than num_experts"),
    Rule("decoder_sparse_step", lambda v: v["num_hidden_layers"] % v["decoder_sparse_step"] == 0,
         "{decoder_sparse_step} does not divide num_hidden_layers {num_hidden_layers}"),
    Rule("mlp_only_layers", lambda v: all(type(i) is int and 0 <= i < v["num_hidden_layers"]
                                          for i in v["mlp_only_layers"] or ()),
         "must list layers of 0 to num_hidden_layers - 1 (num_hidden_layers {num_hidden_layers})"),
    Rule("mlp_only_layers", lambda v: len(set(v["mlp_only_layers"] or ())) < v["num_hidden_layers"],
         "lists every layer: a model without experts is a Qwen3ForCausalLM"),
    Rule("mlp_only_layers", lambda v: not v["mlp_only_layers"] or v["decoder_sparse_step"] == 1,
         "is reproduced with MoE in each of the other layers (decoder_sparse_step 1), not {decoder_sparse_step}"),
)
EXPERTS = ExpertNames("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                      "mlp.experts.{j}.down_proj.weight")
QWEN3_MOE_AUX_LOSS_COEF = 0.001  # transformers' Qwen3MoeConfig default for router_aux_loss_coef

copies = llama.copies  # a tied model's lm_head.weight copy, as Llama's (Qwen3-0.6B ships one)


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG + MOE_CONFIG if architecture == MOE
                         else CONFIG, RULES + MOE_RULES if hf.get("architectures") == [MOE] else RULES)


def config_from_hf(hf: dict) -> Qwen3Config:
    """Our config of a Qwen3 or Qwen3-MoE config.json; anything it cannot compute exactly is refused."""
    v = config_values(hf)
    cfg = llama.config_of(v, Qwen3Config)
    if "num_experts_per_tok" not in v:
        return cfg
    # Trained as transformers trains it: the pooled balance loss, no z-loss.
    coef = v["router_aux_loss_coef"]
    return dataclasses.replace(cfg, moe=MoEConfig(
        experts=v["num_experts"] or v["num_local_experts"], top_k=v["num_experts_per_tok"],
        expert_mlp=v["moe_intermediate_size"], every=v["decoder_sparse_step"], normalize_top_k=v["norm_topk_prob"],
        balance_loss="pooled", z_loss_weight=0.0,
        aux_loss_weight=QWEN3_MOE_AUX_LOSS_COEF if coef is None else float(coef)),
        mlp_only_layers=tuple(sorted(set(v["mlp_only_layers"] or ()))))


def config_to_hf(cfg: Qwen3Config) -> dict:
    hf = llama.config_to_hf(dataclasses.replace(cfg, moe=None, mlp_only_layers=())) | {
        "architectures": [DENSE], "model_type": ARCHITECTURES[DENSE], "use_sliding_window": False,
        "sliding_window": None}
    del hf["mlp_bias"]  # not a Qwen3 field
    if cfg.moe:
        m = cfg.moe
        hf |= {"architectures": [MOE], "model_type": ARCHITECTURES[MOE], "num_experts": m.experts,
               "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_mlp, "norm_topk_prob": m.normalize_top_k,
               "decoder_sparse_step": m.every, "mlp_only_layers": list(cfg.mlp_only_layers), "router_aux_loss_coef": m.aux_loss_weight}
    return hf


def supported(cfg: Qwen3Config) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    if cfg.window or cfg.qkv_bias or not cfg.qk_norm:
        return "Qwen3 has q/k norms, and no sliding window or q/k/v biases"
    if cfg.moe and (cfg.moe.shared_experts or cfg.moe.scoring != "softmax"):
        return "Qwen3-MoE has no shared experts and softmax routing"
    return None


def tensors(cfg: Qwen3Config) -> list[Tensor]:
    """Llama's, its q/k norms among the block's norms (`LlamaConfig.block_norms`), and Qwen's experts' names."""
    return llama.tensors(cfg, EXPERTS)


tensor_count = llama.count_of(tensors)
