"""The Llama family in Hugging Face's layout (LlamaForCausalLM, MixtralForCausalLM):
config.json <-> LlamaConfig, and each of our parameters <-> the published tensors it is
made of. Pure numpy, one layer at a time, so that a loader or writer never needs more
than one layer's tensors in memory.

Published weights are torch `Linear` weights, (out, in); ours are (in, ...out). Queries
use the rotate-half pairing (i, i + head_dim/2) that transformers' checkpoints are
stored for, as `models.llama.rotary` does: no permutation of heads is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from models.llama import LlamaConfig, RopeScaling
from models.moe import MoEConfig

ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM")

# config.json fields that describe nothing the forward pass computes (ids, provenance,
# generation and training-only defaults): read past. Every other field must be understood.
IGNORED = frozenset((
    "_name_or_path", "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range",
    "max_position_embeddings", "output_router_logits", "router_aux_loss_coef", "attention_dropout",
    "router_jitter_noise", "tokenizer_class",
))


class UnsupportedConfig(ValueError):
    """A config.json this model cannot reproduce; `field` names what."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our config of a Llama or Mixtral config.json; anything it cannot compute exactly is refused."""
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise UnsupportedConfig("architectures", f"{architectures!r} is not one of {', '.join(ARCHITECTURES)}")
    mixtral = architectures[0] == "MixtralForCausalLM"
    read = _Reader(hf)
    heads = read.int("num_attention_heads")
    embed = read.int("hidden_size")
    read.equal("hidden_act", "silu")
    read.equal("attention_bias", False)
    read.equal("mlp_bias", False)
    read.equal("pretraining_tp", 1)
    read.equal("sliding_window", None)
    for training_only in ("attention_dropout", "router_jitter_noise"):
        if hf.get(training_only, 0.0) not in (0, 0.0):
            raise UnsupportedConfig(training_only, f"must be 0 (got {hf[training_only]!r})")
    theta, scaling = _rope(read)
    moe = None
    if mixtral:
        moe = MoEConfig(experts=read.int("num_local_experts"), top_k=read.int("num_experts_per_tok"),
                        expert_mlp=read.int("intermediate_size"))
    cfg = LlamaConfig(
        vocab=read.int("vocab_size"), embed=embed, layers=read.int("num_hidden_layers"), heads=heads,
        kv_heads=read.int("num_key_value_heads", heads), head_dim=read.int("head_dim", embed // heads),
        mlp=read.int("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        norm_eps=read.number("rms_norm_eps", 1e-6), tie_embeddings=read.bool("tie_word_embeddings", False), moe=moe,
    )
    if heads % cfg.kv_heads:
        raise UnsupportedConfig("num_key_value_heads", f"{cfg.kv_heads} does not divide num_attention_heads {heads}")
    if cfg.head_dim % 2:
        raise UnsupportedConfig("head_dim", f"must be even (got {cfg.head_dim})")
    if moe and moe.top_k > moe.experts:
        raise UnsupportedConfig("num_experts_per_tok", f"{moe.top_k} is more than num_local_experts {moe.experts}")
    unknown = sorted(set(hf) - read.seen - IGNORED)
    if unknown:
        raise UnsupportedConfig(unknown[0], "is not a field this loader knows; it may change the model")
    return cfg


def _rope(read: _Reader) -> tuple[float, RopeScaling | None]:
    """rope_theta and rope_scaling (published configs), or transformers 5's rope_parameters."""
    params = read.raw("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise UnsupportedConfig("rope_parameters", f"must be a mapping (got {params!r})")
        theta = params.get("rope_theta", read.number("rope_theta", 10_000.0))
        scaling, where = params, "rope_parameters"
    else:
        theta, scaling, where = read.number("rope_theta", 10_000.0), read.raw("rope_scaling"), "rope_scaling"
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise UnsupportedConfig(where, f"must be a mapping or null (got {scaling!r})")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise UnsupportedConfig(f"{where}.rope_type", f"{kind!r} is not supported (default or llama3)")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position=int(scaling["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedConfig(where, f"llama3 scaling needs factor, low_freq_factor, high_freq_factor and "
                                       f"original_max_position_embeddings ({exc!r})") from None


class _Reader:
    """Typed reads of config.json's fields, remembering which were read."""

    def __init__(self, hf: dict):
        self.hf, self.seen = hf, set()

    def raw(self, name: str, default=None):
        self.seen.add(name)
        return self.hf.get(name, default)

    def int(self, name: str, default: int | None = None) -> int:
        value = self.raw(name, default)
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedConfig(name, f"must be a positive integer (got {value!r})")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UnsupportedConfig(name, f"must be a positive number (got {value!r})")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise UnsupportedConfig(name, f"must be true or false (got {value!r})")
        return value

    def equal(self, name: str, supported) -> None:
        value = self.raw(name, supported)
        if value != supported or type(value) is not type(supported):
            raise UnsupportedConfig(name, f"only {supported!r} is supported (got {value!r})")


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The config.json of our config, in the published form (rope_theta and rope_scaling)."""
    hf = {
        "architectures": ["MixtralForCausalLM" if cfg.moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if cfg.moe else "llama",
        "vocab_size": cfg.vocab, "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.moe.expert_mlp if cfg.moe else cfg.mlp, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
    }
    if cfg.rope_scaling:
        r = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                              "high_freq_factor": r.high_freq_factor,
                              "original_max_position_embeddings": r.original_max_position}
    if cfg.moe:
        hf |= {"num_local_experts": cfg.moe.experts, "num_experts_per_tok": cfg.moe.top_k, "sliding_window": None}
    else:
        hf["mlp_bias"] = False
    return hf


def supported(cfg: LlamaConfig) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    moe = cfg.moe
    if moe and (moe.shared_experts or moe.every != 1 or moe.scoring != "softmax"):
        return "Mixtral has no shared experts, MoE in every layer and softmax routing"
    if moe and cfg.mlp != moe.expert_mlp:
        return "Mixtral's intermediate_size is the experts' width; the dense width must equal it"
    return None


# ------------------------------------------------------------------ parameters

@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of our parameters (`ours`: its path; `stacked`: one slice per layer) and the
    published tensors it is made of, for layer `i` when stacked."""

    ours: tuple[str, ...]
    stacked: bool
    names: Callable[[int], list[str]]  # layer -> published names
    shapes: list[tuple[int, ...]]  # the published tensors' shapes
    to_ours: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]


def tensors(cfg: LlamaConfig) -> list[Tensor]:
    e, h, k, d, v = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab
    layer = "model.layers.{}."

    def at(*names):
        return lambda i: [(layer + n).format(i) for n in names]

    block = ("moe",) if cfg.moe else ()
    found = [
        Tensor(("embedding",), False, lambda i: ["model.embed_tokens.weight"], [(v, e)], _one, _listed),
        Tensor(("final_norm", "scale"), False, lambda i: ["model.norm.weight"], [(e,)], _one, _listed),
        Tensor(("blocks", *block, "attn_norm", "scale"), True, at("input_layernorm.weight"), [(e,)], _one, _listed),
        Tensor(("blocks", *block, "mlp_norm", "scale"), True, at("post_attention_layernorm.weight"), [(e,)],
               _one, _listed),
        Tensor(("blocks", *block, "attn", "wq"), True, at("self_attn.q_proj.weight"), [(h * d, e)],
               lambda t: t[0].T.reshape(e, h, d), lambda w: [w.reshape(e, h * d).T]),
        # Query head n reads key/value head n // (h / k), as transformers' repeat_kv.
        Tensor(("blocks", *block, "attn", "wkv"), True, at("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
               [(k * d, e), (k * d, e)], lambda t: np.stack([t[0].T, t[1].T], axis=1).reshape(e, 2, k, d).swapaxes(1, 2),
               lambda w: [w[:, :, 0].reshape(e, k * d).T, w[:, :, 1].reshape(e, k * d).T]),
        Tensor(("blocks", *block, "attn", "wo"), True, at("self_attn.o_proj.weight"), [(e, h * d)],
               lambda t: t[0].T.reshape(h, d, e), lambda w: [w.reshape(h * d, e).T]),
    ]
    if not cfg.tie_embeddings:
        found.append(Tensor(("head",), False, lambda i: ["lm_head.weight"], [(v, e)],
                            lambda t: t[0].T, lambda w: [w.T]))
    if cfg.moe is None:
        m = cfg.mlp
        found += [
            Tensor(("blocks", "mlp", "gate_up"), True, at("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                   [(m, e), (m, e)], lambda t: np.stack([t[0].T, t[1].T], axis=1),
                   lambda w: [w[:, 0].T, w[:, 1].T]),
            Tensor(("blocks", "mlp", "down"), True, at("mlp.down_proj.weight"), [(e, m)],
                   lambda t: t[0].T, lambda w: [w.T]),
        ]
        return found
    n, m = cfg.moe.experts, cfg.moe.expert_mlp
    expert = "block_sparse_moe.experts.{}.{}.weight"
    experts = lambda *ws: lambda i: [(layer + expert).format(i, j, w) for w in ws for j in range(n)]  # noqa: E731
    return found + [
        Tensor(("blocks", "moe", "mlp", "router"), True, at("block_sparse_moe.gate.weight"), [(n, e)],
               lambda t: t[0].T, lambda w: [w.T]),
        # w1 is the gate and w3 the up projection of each expert; w2 its down projection.
        Tensor(("blocks", "moe", "mlp", "gate_up"), True, experts("w1", "w3"), [(m, e)] * (2 * n),
               lambda t: np.stack([np.stack(t[:n]), np.stack(t[n:])], axis=2).transpose(0, 3, 2, 1),
               lambda w: [w[j, :, s].T for s in (0, 1) for j in range(n)]),
        Tensor(("blocks", "moe", "mlp", "down"), True, experts("w2"), [(e, m)] * n,
               lambda t: np.stack(t).transpose(0, 2, 1), lambda w: list(w.transpose(0, 2, 1))),
    ]


def _one(t: list[np.ndarray]) -> np.ndarray:
    return t[0]


def _listed(w: np.ndarray) -> list[np.ndarray]:
    return [w]
