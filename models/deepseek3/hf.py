"""DeepSeek-V3 in Hugging Face's layout (DeepseekV3ForCausalLM), as transformers reads and
writes it: config.json with its latent-attention and routing fields, per-layer tensors
under `model.layers.N.` (the first first_k_dense_replace dense, the rest MoE with
`mlp.gate.e_score_correction_bias`), experts one by one.

DeepSeek stores each rotary part interleaved (pairs (x0, x1), (x2, x3), ...; transformers'
rope_interleave, its default): its rows of q_b_proj (or q_proj) and kv_a_proj_with_mqa are
read here into rotate-half order (evens, then odds) and written back, so that our rotation
is Llama's and every score is unchanged. An FP8 checkpoint (quantization_config) is refused.

DeepSeek's own checkpoint also holds its multi-token prediction module as one more layer
(`model.layers.61.`, num_hidden_layers on; the report's D of them): `enorm` and `hnorm`
(the embedding's and the hidden state's norms), `eh_proj` (their join, reading the
concatenation embedding first), a decoder layer named as the others, `shared_head.norm`,
and copies of the embedding and the head (`embed_tokens`, `shared_head.head`). A run with
`--mtp-depth` reads its modules from them (models.deepseek3.model's PredictionModule; those
the files do not hold start fresh); any other run drops them, as transformers does. They
are never written: transformers has no place for them."""

from __future__ import annotations

import functools
from collections.abc import Collection

import numpy as np

from models.deepseek3.config import DeepSeekV3Config, Yarn
from models.llama import hf as llama
from models.llama.hf import Block, ExpertNames, Tensor, listed, only
from models.moe import MoEConfig
from spmd.base.schema import ANY, BOOLEAN, INTEGER, MAPPING, NUMBER, STRING, Bounds, Field, Rule

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}  # with its model_type (models.llama.hf)
POSITIVE = llama.POSITIVE
CONFIG = (
    *(f for f in llama.CONFIG if f.name not in ("head_dim", "mlp_bias", "sliding_window", "router_jitter_noise",
                                                "router_aux_loss_coef", "rope_scaling")),
    Field("head_dim", INTEGER, POSITIVE, None, nullable=True),  # transformers 5 writes qk_rope_head_dim here
    Field("qk_head_dim", INTEGER, POSITIVE, None, nullable=True),  # and qk_nope_head_dim + qk_rope_head_dim here
    Field("rope_scaling", MAPPING, default=None, nullable=True),
    Field("moe_intermediate_size", INTEGER, POSITIVE),
    Field("n_routed_experts", INTEGER, POSITIVE),
    Field("n_shared_experts", INTEGER, Bounds(at_least=0), 1),
    Field("num_experts_per_tok", INTEGER, POSITIVE),
    Field("routed_scaling_factor", NUMBER, POSITIVE, 1.0),
    Field("n_group", INTEGER, POSITIVE, 1),
    Field("topk_group", INTEGER, POSITIVE, 1),
    Field("norm_topk_prob", BOOLEAN, default=True),
    Field("first_k_dense_replace", INTEGER, Bounds(at_least=0), 0),
    Field("kv_lora_rank", INTEGER, POSITIVE),
    Field("q_lora_rank", INTEGER, POSITIVE, None, nullable=True),
    Field("qk_rope_head_dim", INTEGER, POSITIVE),
    Field("qk_nope_head_dim", INTEGER, POSITIVE),
    Field("v_head_dim", INTEGER, POSITIVE),
    Field("rope_interleave", BOOLEAN, default=True),
    # DeepSeek's own config.json: what transformers hard-codes, accepted only as it is.
    Field("moe_layer_freq", INTEGER, default=1, choices=(1,)),
    Field("scoring_func", STRING, default="sigmoid", choices=("sigmoid",)),
    Field("topk_method", STRING, default="noaux_tc", choices=("noaux_tc",)),
    Field("quantization_config", ANY, default=None, choices=(None,)),  # FP8 blocks: dequantize to bf16 first
    # Read past: the prediction layers' count (the files say which they hold) and training-only settings.
    *(Field(name, ANY, default=None) for name in (
        "num_nextn_predict_layers", "aux_loss_alpha", "seq_aux", "ep_size", "auto_map")),
)
ROPE_KIND = (Field("rope_type", STRING, default=None, choices=("default", "yarn"), nullable=True),
             Field("type", STRING, default=None, choices=("default", "yarn"), nullable=True))
ROPE = {
    "default": (*ROPE_KIND, Field("rope_theta", NUMBER, POSITIVE, None)),
    "yarn": (*ROPE_KIND, Field("rope_theta", NUMBER, POSITIVE, None), Field("factor", NUMBER, Bounds(at_least=1)),
             Field("original_max_position_embeddings", INTEGER, POSITIVE),
             Field("beta_fast", NUMBER, POSITIVE, 32.0), Field("beta_slow", NUMBER, POSITIVE, 1.0),
             Field("mscale", NUMBER, POSITIVE, None, nullable=True),
             Field("mscale_all_dim", NUMBER, Bounds(at_least=0), None, nullable=True),
             Field("truncate", BOOLEAN, default=True), Field("attention_factor", ANY, default=None, choices=(None,))),
}
RULES = (
    Rule("num_key_value_heads", lambda v: v["num_key_value_heads"] == v["num_attention_heads"],
         "must equal num_attention_heads {num_attention_heads}: latent attention has a key and value per head"),
    Rule("qk_rope_head_dim", lambda v: v["qk_rope_head_dim"] % 2 == 0, "must be even (got {qk_rope_head_dim})"),
    Rule("v_head_dim", lambda v: v["v_head_dim"] <= v["qk_nope_head_dim"] + v["qk_rope_head_dim"],
         "{v_head_dim} is more than qk_nope_head_dim + qk_rope_head_dim"),
    Rule("n_group", lambda v: v["n_routed_experts"] % v["n_group"] == 0
         and (v["n_group"] == 1 or v["n_routed_experts"] // v["n_group"] >= 2),
         "{n_group} must divide n_routed_experts {n_routed_experts} into groups of at least 2"),
    Rule("topk_group", lambda v: v["topk_group"] <= v["n_group"], "{topk_group} is more than n_group {n_group}"),
    Rule("num_experts_per_tok", lambda v: v["num_experts_per_tok"] <= v["n_routed_experts"] // v["n_group"]
         * v["topk_group"], "{num_experts_per_tok} is more than the experts of topk_group groups"),
    Rule("first_k_dense_replace", lambda v: v["first_k_dense_replace"] < v["num_hidden_layers"],
         "{first_k_dense_replace} leaves no MoE layer of num_hidden_layers {num_hidden_layers}"),
    Rule("tie_word_embeddings", lambda v: not v["tie_word_embeddings"], "must be false: DeepSeek-V3 has its own head"),
)
EXPERTS = ExpertNames("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                      "mlp.experts.{j}.down_proj.weight")


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG, RULES)


def config_from_hf(hf: dict) -> DeepSeekV3Config:
    """Our config of a DeepseekV3ForCausalLM config.json; anything it cannot compute exactly is refused."""
    v = config_values(hf)
    theta, yarn = _rope(v)
    moe = MoEConfig(experts=v["n_routed_experts"], top_k=v["num_experts_per_tok"], expert_mlp=v["moe_intermediate_size"],
                    shared_experts=v["n_shared_experts"], scoring="sigmoid", normalize_top_k=v["norm_topk_prob"],
                    groups=v["n_group"], top_groups=v["topk_group"], scale=float(v["routed_scaling_factor"]),
                    selection_bias=True, aux_loss_weight=0.0001, z_loss_weight=0.0)
    return DeepSeekV3Config(
        vocab=v["vocab_size"], embed=v["hidden_size"], layers=v["num_hidden_layers"], heads=v["num_attention_heads"],
        kv_heads=v["num_attention_heads"], head_dim=v["qk_nope_head_dim"] + v["qk_rope_head_dim"],
        mlp=v["intermediate_size"], rope_theta=theta, norm_eps=float(v["rms_norm_eps"]), moe=moe,
        kv_rank=v["kv_lora_rank"], rope_dim=v["qk_rope_head_dim"], v_dim=v["v_head_dim"], q_rank=v["q_lora_rank"],
        dense_layers=v["first_k_dense_replace"], yarn=yarn, pad_token=llama.pad_token_of(v))


def _rope(v: dict) -> tuple[float, Yarn | None]:
    """rope_theta and YaRN, from rope_scaling (published configs) or rope_parameters (transformers 5).
    The factor is read as given (transformers 5; 4.5x derived it from max_position_embeddings)."""
    _, kind, r, theta = llama.rope_fields(v, ROPE_KIND, ROPE)
    if kind == "default":
        return theta, None
    return theta, Yarn(factor=float(r["factor"]), original_max_position=r["original_max_position_embeddings"],
                       beta_fast=float(r["beta_fast"]), beta_slow=float(r["beta_slow"]), mscale=r["mscale"],
                       mscale_all_dim=r["mscale_all_dim"], truncate=r["truncate"])


def config_to_hf(cfg: DeepSeekV3Config) -> dict:
    m = cfg.moe
    hf = {
        "architectures": list(ARCHITECTURES), "model_type": ARCHITECTURES["DeepseekV3ForCausalLM"],
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.heads, "intermediate_size": cfg.mlp, "moe_intermediate_size": m.expert_mlp,
        "n_routed_experts": m.experts, "n_shared_experts": m.shared_experts, "num_experts_per_tok": m.top_k,
        "routed_scaling_factor": m.scale, "n_group": m.groups, "topk_group": m.top_groups,
        "norm_topk_prob": m.normalize_top_k, "first_k_dense_replace": cfg.dense_layers, "kv_lora_rank": cfg.kv_rank,
        "q_lora_rank": cfg.q_rank, "qk_rope_head_dim": cfg.rope_dim, "qk_nope_head_dim": cfg.nope_dim,
        "v_head_dim": cfg.v_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "rope_interleave": True, "tie_word_embeddings": False, "attention_bias": False,
    } | llama.pad_token_to_hf(cfg)
    if cfg.yarn:
        y = cfg.yarn
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": y.factor, "original_max_position_embeddings":
                              y.original_max_position, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                              "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim, "truncate": y.truncate}
        hf["max_position_embeddings"] = round(y.factor * y.original_max_position)
    return hf


def supported(cfg: DeepSeekV3Config) -> str | None:
    m = cfg.moe
    if cfg.tie_embeddings or cfg.window or m.scoring != "sigmoid" or not m.selection_bias:
        return "DeepseekV3ForCausalLM has an untied head, full attention, and sigmoid routing with a selection bias"
    return None


def _blocks(cfg: DeepSeekV3Config) -> list[Block]:
    layers = functools.cache(lambda: cfg.stack_layers("blocks"))  # listed when first named (models.llama.hf.blocks)
    return [*llama.prefix_block(cfg), Block(("blocks",), cfg.layer_steps, lambda i: layers()[i], True)]


def _rotate_half_order(d: int) -> np.ndarray:
    """Where rotate-half order's entries are in DeepSeek's interleaved order."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def _to_rotate_half(w: np.ndarray, rope: int) -> np.ndarray:
    """The last `rope` entries of w's last axis from interleaved to rotate-half order."""
    return np.concatenate([w[..., :-rope], w[..., -rope:][..., _rotate_half_order(rope)]], axis=-1)


def _to_interleaved(w: np.ndarray, rope: int) -> np.ndarray:
    return np.concatenate([w[..., :-rope], w[..., -rope:][..., np.argsort(_rotate_half_order(rope))]], axis=-1)


def _attention(cfg: DeepSeekV3Config, b: Block) -> list[Tensor]:
    e, h, d, r, dr = cfg.embed, cfg.heads, cfg.head_dim, cfg.kv_rank, cfg.rope_dim
    attn = (*b.ours, "attn")
    heads = lambda t, n: _to_rotate_half(t[0].T.reshape(n, h, d), dr)  # noqa: E731
    unheads = lambda w, n: [_to_interleaved(w, dr).reshape(n, h * d).T]  # noqa: E731
    if cfg.q_rank is None:
        query = [Tensor((*attn, "wq"), b.steps, b.names("self_attn.q_proj.weight"), [(h * d, e)],
                        lambda t: heads(t, e), lambda w: unheads(w, e))]
    else:
        q = cfg.q_rank
        query = [
            Tensor((*attn, "wq_a"), b.steps, b.names("self_attn.q_a_proj.weight"), [(q, e)],
                   lambda t: t[0].T, lambda w: [w.T]),
            Tensor((*attn, "q_norm", "scale"), b.steps, b.names("self_attn.q_a_layernorm.weight"), [(q,)],
                   only, listed),
            Tensor((*attn, "wq_b"), b.steps, b.names("self_attn.q_b_proj.weight"), [(h * d, q)],
                   lambda t: heads(t, q), lambda w: unheads(w, q)),
        ]
    kv_width = cfg.nope_dim + cfg.v_dim
    return [
        Tensor((*b.ours, "attn_norm", "scale"), b.steps, b.names("input_layernorm.weight"), [(e,)], only, listed),
        Tensor((*b.ours, "mlp_norm", "scale"), b.steps, b.names("post_attention_layernorm.weight"), [(e,)],
               only, listed),
        *query,
        Tensor((*attn, "wkv_a"), b.steps, b.names("self_attn.kv_a_proj_with_mqa.weight"), [(cfg.latent_dim, e)],
               lambda t: _to_rotate_half(t[0].T, dr), lambda w: [_to_interleaved(w, dr).T]),
        Tensor((*attn, "kv_norm", "scale"), b.steps, b.names("self_attn.kv_a_layernorm.weight"), [(r,)],
               only, listed),
        Tensor((*attn, "wkv_b"), b.steps, b.names("self_attn.kv_b_proj.weight"), [(h * kv_width, r)],
               lambda t: t[0].T.reshape(r, h, kv_width), lambda w: [w.reshape(r, h * kv_width).T]),
        Tensor((*attn, "wo"), b.steps, b.names("self_attn.o_proj.weight"), [(e, h * cfg.v_dim)],
               lambda t: t[0].T.reshape(h, cfg.v_dim, e), lambda w: [w.reshape(h * cfg.v_dim, e).T]),
    ]


def _moe(cfg: DeepSeekV3Config, b: Block) -> list[Tensor]:
    e, n, width = cfg.embed, cfg.moe.experts, cfg.moe.shared_experts * cfg.moe.expert_mlp
    shared = [
        Tensor((*b.ours, "mlp", "shared_gate_up"), b.steps,
               b.names("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), [(width, e)] * 2,
               lambda t: np.stack([t[0].T, t[1].T], axis=1), lambda w: [w[:, 0].T, w[:, 1].T]),
        Tensor((*b.ours, "mlp", "shared_down"), b.steps, b.names("mlp.shared_experts.down_proj.weight"), [(e, width)],
               lambda t: t[0].T, lambda w: [w.T]),
    ] if width else []
    bias = Tensor((*b.ours, "mlp", "bias"), b.steps, b.names("mlp.gate.e_score_correction_bias"), [(n,)], only, listed)
    return [*llama.expert_tensors(cfg, b, EXPERTS), bias, *shared]


def tensors(cfg: DeepSeekV3Config) -> list[Tensor]:
    e, v = cfg.embed, cfg.vocab
    found = [
        Tensor(("embedding",), 0, lambda i: ["model.embed_tokens.weight"], [(v, e)], only, listed),
        Tensor(("final_norm", "scale"), 0, lambda i: ["model.norm.weight"], [(e,)], only, listed),
        Tensor(("head",), 0, lambda i: ["lm_head.weight"], [(v, e)], lambda t: t[0].T, lambda w: [w.T]),
    ]
    for block in _blocks(cfg):
        found += _attention(cfg, block) + (_moe(cfg, block) if block.moe else llama.mlp_tensors(cfg, block))
    return found


tensor_count = llama.count_of(tensors, "n_routed_experts")


def copies(cfg: DeepSeekV3Config) -> dict[str, tuple[str, str]]:
    return {}


def prediction_layers(cfg: DeepSeekV3Config, held: Collection[str]) -> list[list[Tensor]]:
    """The tensors of each multi-token prediction layer the files hold, depth 1 first
    (models.deepseek3.model's `mtp`): layer num_hidden_layers + k - 1 is depth k's when it
    has an eh_proj."""
    layers = []
    while f"model.layers.{cfg.layers + len(layers)}.eh_proj.weight" in held:
        k, e = len(layers), cfg.embed
        ours, block = ("mtp", k), Block(("mtp", k, "block"), 0, lambda i, n=cfg.layers + k: n, True)
        join = block.names("eh_proj.weight")
        layers.append([
            Tensor((*ours, "embedding_norm", "scale"), 0, block.names("enorm.weight"), [(e,)], only, _unwritten),
            Tensor((*ours, "hidden_norm", "scale"), 0, block.names("hnorm.weight"), [(e,)], only, _unwritten),
            # (e, 2e) as torch's Linear stores it: the input is [embedding; hidden]
            Tensor((*ours, "join_embedded"), 0, join, [(e, 2 * e)], lambda t: t[0][:, :e].T, _unwritten),
            Tensor((*ours, "join_hidden"), 0, join, [(e, 2 * e)], lambda t: t[0][:, e:].T, _unwritten),
            *_attention(cfg, block), *_moe(cfg, block),
            Tensor((*ours, "norm", "scale"), 0, block.names("shared_head.norm.weight"), [(e,)], only, _unwritten),
        ])
    return layers


def prediction_copies(cfg: DeepSeekV3Config, depth: int) -> dict[str, tuple[str, str]]:
    """The embedding and head that each prediction layer holds again (DeepSeek's modules share the model's)."""
    shared = "DeepSeek's multi-token prediction module shares (the report's section 2.2)"
    return {name: (of, shared) for k in range(depth) for name, of in (
        (f"model.layers.{cfg.layers + k}.embed_tokens.weight", "model.embed_tokens.weight"),
        (f"model.layers.{cfg.layers + k}.shared_head.head.weight", "lm_head.weight"))}


def _unwritten(w: np.ndarray) -> list[np.ndarray]:
    raise AssertionError("the prediction layers are read, never written")
