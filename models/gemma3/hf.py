"""Gemma 3 text models in Hugging Face's layout (Gemma3ForCausalLM): config.json (its
published form with `rope_theta`, `rope_local_base_freq`, `rope_scaling` and
`sliding_window_pattern`, or transformers 5's `rope_parameters` per layer type and
`layer_types`) and tensors: Llama's, with four norms per block (`input_layernorm`,
`post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`)
and `self_attn.{q,k}_norm`. Soft-capping, bidirectional attention and rope kinds other
than default and linear are refused."""

from __future__ import annotations

from models.gemma3.model import Gemma3Config, layer_types
from models.llama import hf as llama
from models.llama.hf import Tensor
from spmd.base.schema import ANY, BOOLEAN, INTEGER, LIST, MAPPING, NUMBER, STRING, Field, Invalid, Rule, check

ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text"}  # with its model_type (models.llama.hf)
POSITIVE = llama.POSITIVE
LAYER_TYPES = ("sliding_attention", "full_attention")
# Llama's fields of the same meaning (the shapes, and what is read past: ids, provenance).
SHARED = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "intermediate_size", "rms_norm_eps", "pad_token_id")
CONFIG = (
    *(f for f in llama.CONFIG if f.name in SHARED or (f.kind is ANY and not f.choices)),
    Field("head_dim", INTEGER, POSITIVE, 256),
    Field("query_pre_attn_scalar", NUMBER, POSITIVE, 256),
    Field("sliding_window", INTEGER, POSITIVE, 4096),
    Field("sliding_window_pattern", INTEGER, POSITIVE, 6),  # the published form of layer_types
    Field("_sliding_window_pattern", INTEGER, POSITIVE, None, nullable=True),  # transformers 5 writes it beside them
    Field("layer_types", LIST, default=None, nullable=True),
    Field("rope_theta", NUMBER, POSITIVE, 1_000_000.0),  # the global layers'
    Field("rope_local_base_freq", NUMBER, POSITIVE, 10_000.0),  # the sliding layers'
    Field("rope_scaling", MAPPING, default=None, nullable=True),  # the global layers' (published configs)
    Field("rope_parameters", MAPPING, default=None, nullable=True),  # transformers 5: per layer type
    Field("tie_word_embeddings", BOOLEAN, default=True),
    Field("max_position_embeddings", INTEGER, POSITIVE, 131_072),
    # What the model computes only one way here.
    Field("hidden_activation", STRING, default="gelu_pytorch_tanh", choices=("gelu_pytorch_tanh",)),
    Field("final_logit_softcapping", NUMBER, default=None, choices=(None,), nullable=True),
    Field("attn_logit_softcapping", NUMBER, default=None, choices=(None,), nullable=True),
    Field("use_bidirectional_attention", BOOLEAN, default=False, choices=(False,), nullable=True),
    Field("attention_bias", BOOLEAN, default=False, choices=(False,)),
    Field("attention_dropout", NUMBER, default=0, choices=(0,)),
    Field("cache_implementation", ANY, default=None),
)
RULES = (
    *llama.RULES,
    Rule("layer_types", lambda v: v["layer_types"] is None or (
        len(v["layer_types"]) == v["num_hidden_layers"] and set(v["layer_types"]) <= set(LAYER_TYPES)),
         "must hold num_hidden_layers ({num_hidden_layers}) entries, each sliding_attention or full_attention "
         "(got {layer_types})"),
)
ROPE_KIND = (Field("rope_type", STRING, default=None, choices=("default", "linear"), nullable=True),
             Field("type", STRING, default=None, choices=("default", "linear"), nullable=True))
ROPE = (*ROPE_KIND, Field("rope_theta", NUMBER, POSITIVE, None, nullable=True),
        Field("factor", NUMBER, POSITIVE, None, nullable=True))

copies = llama.copies  # a tied model's lm_head.weight copy


def config_values(hf: dict) -> dict:
    return llama.checked(hf, ARCHITECTURES, lambda architecture: CONFIG, RULES)


def config_from_hf(hf: dict) -> Gemma3Config:
    """Our config of a Gemma 3 text config.json; anything it cannot compute exactly is refused."""
    v = config_values(hf)
    (theta, factor), (local_theta, local_factor) = _rope(v, "full_attention"), _rope(v, "sliding_attention")
    if local_factor != 1.0:
        raise Invalid("rope_parameters.sliding_attention.factor", "only the global layers' rope is scaled here")
    types = tuple(v["layer_types"]) if v["layer_types"] else layer_types(v["num_hidden_layers"],
                                                                         v["sliding_window_pattern"])
    return Gemma3Config(
        vocab=v["vocab_size"], embed=v["hidden_size"], layers=v["num_hidden_layers"],
        heads=v["num_attention_heads"], kv_heads=v["num_key_value_heads"], head_dim=v["head_dim"],
        mlp=v["intermediate_size"], rope_theta=theta, norm_eps=float(v["rms_norm_eps"]),
        tie_embeddings=v["tie_word_embeddings"], window=llama.window_of(v["sliding_window"]), layer_types=types,
        local_rope_theta=local_theta, rope_linear_factor=factor, query_scale=float(v["query_pre_attn_scalar"]),
        pad_token=llama.pad_token_of(v))


def _rope(v: dict, kind: str) -> tuple[float, float]:
    """(rope base, linear factor) of the layers of `kind`: from rope_parameters[kind], or
    the published fields (rope_theta and rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones)."""
    if v["rope_parameters"] is not None:
        where = f"rope_parameters.{kind}."
        given = check(v["rope_parameters"], tuple(Field(t, MAPPING, default={}) for t in LAYER_TYPES),
                      "rope_parameters.", others="is not a layer type (sliding_attention or full_attention)")[kind]
    else:
        where = "rope_scaling."
        given = (v["rope_scaling"] or {}) if kind == "full_attention" else {}
    r = check(given, ROPE, where, others="is not a field of a default or linear rope")
    linear = (r["rope_type"] or r["type"]) == "linear"
    if linear and r["factor"] is None:
        raise Invalid(where + "factor", "is missing (a linear rope's)")
    default = v["rope_theta"] if kind == "full_attention" else v["rope_local_base_freq"]
    return float(r["rope_theta"] or default), float(r["factor"]) if linear else 1.0


def config_to_hf(cfg: Gemma3Config) -> dict:
    """The config.json of our config, in transformers 5's form (rope_parameters, layer_types)."""
    full = {"rope_type": "linear", "factor": cfg.rope_linear_factor} if cfg.rope_linear_factor != 1.0 else \
        {"rope_type": "default"}
    return {
        "architectures": list(ARCHITECTURES), "model_type": ARCHITECTURES["Gemma3ForCausalLM"],
        "vocab_size": cfg.vocab, "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": cfg.norm_eps,
        "query_pre_attn_scalar": _integral(cfg.query_scale), "sliding_window": cfg.window, "layer_types": list(cfg.layer_types),
        "rope_parameters": {"full_attention": full | {"rope_theta": cfg.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}},
        "tie_word_embeddings": cfg.tie_embeddings, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    } | llama.pad_token_to_hf(cfg)


def _integral(x: float) -> int | float:
    """An int where the value is one (transformers' Gemma3TextConfig types the field as int)."""
    return int(x) if float(x).is_integer() else x


def supported(cfg: Gemma3Config) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    gemma = (cfg.qk_norm and cfg.layer_types is not None and cfg.window is not None
             and cfg.query_scale is not None and cfg.local_rope_theta is not None)
    if cfg.moe or cfg.qkv_bias or cfg.rope_scaling or not gemma:
        return "Gemma3ForCausalLM is dense, with Gemma's norms, GeGLU, sliding and global layers"
    return None


def tensors(cfg: Gemma3Config) -> list[Tensor]:
    """Llama's: its four norms and q/k norms are the block's (`Gemma3Config.NORMS`), named
    by `models.llama.hf.norm_name`."""
    return llama.tensors(cfg)


tensor_count = llama.count_of(tensors)
