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
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from models.llama.config import LlamaConfig, RopeScaling
from models.moe import MoEConfig
from spmd.base.schema import (ANY, BOOLEAN, INTEGER, LIST, MAPPING, NUMBER, STRING, Bounds, Field, Invalid, Rule, check,
                              enforce)

# Each architecture with the model_type it is published with (transformers builds the model that names).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral"}
MAX_CONFIG_BYTES = 1 << 20  # published configs are a few kB
POSITIVE = Bounds(above=0)  # "a positive integer", "a positive finite number"

# Every field of a Llama or Mixtral config.json, declared once: what it must hold and its
# default (transformers'). A field not listed is refused: it may change the model.
CONFIG = (
    Field("architectures", LIST),
    Field("vocab_size", INTEGER, POSITIVE),
    Field("hidden_size", INTEGER, POSITIVE),
    Field("num_hidden_layers", INTEGER, POSITIVE),
    Field("num_attention_heads", INTEGER, POSITIVE),
    Field("num_key_value_heads", INTEGER, POSITIVE, None, nullable=True),  # None: num_attention_heads
    Field("head_dim", INTEGER, POSITIVE, None, nullable=True),  # None: hidden_size // num_attention_heads
    Field("intermediate_size", INTEGER, POSITIVE),
    Field("rms_norm_eps", NUMBER, POSITIVE, 1e-6),
    Field("rope_theta", NUMBER, POSITIVE, 10_000.0),
    Field("rope_scaling", MAPPING, default=None, nullable=True),  # published configs
    Field("rope_parameters", MAPPING, default=None, nullable=True),  # transformers 5: theta and scaling
    Field("tie_word_embeddings", BOOLEAN, default=False),
    Field("max_position_embeddings", INTEGER, POSITIVE, 2048),  # the context it was made for (generate's)
    Field("pad_token_id", INTEGER, Bounds(at_least=0), None, nullable=True),  # the embedding's padding_idx
    # What the model computes only one way here.
    Field("hidden_act", STRING, default="silu", choices=("silu",)),
    Field("attention_bias", BOOLEAN, default=False, choices=(False,)),
    Field("mlp_bias", BOOLEAN, default=False, choices=(False,)),
    Field("pretraining_tp", INTEGER, default=1, choices=(1,)),
    Field("sliding_window", ANY, default=None, choices=(None,)),
    Field("attention_dropout", NUMBER, default=0, choices=(0,)),  # training-only, but training is ours
    Field("router_jitter_noise", NUMBER, default=0, choices=(0,)),
    Field("router_aux_loss_coef", NUMBER, Bounds(at_least=0), None, nullable=True),
    # Read past: ids, provenance, generation and training-only settings.
    *(Field(name, ANY, default=None) for name in (
        "_name_or_path", "model_type", "bos_token_id", "eos_token_id", "torch_dtype", "dtype",
        "transformers_version", "use_cache", "initializer_range", "output_router_logits", "tokenizer_class")),
)
MIXTRAL = (Field("num_local_experts", INTEGER, POSITIVE), Field("num_experts_per_tok", INTEGER, POSITIVE))
MIXTRAL_AUX_LOSS_COEF = 0.001  # transformers' MixtralConfig default for router_aux_loss_coef
# The rotary embedding (rope_parameters, or rope_scaling with the top-level rope_theta):
# its kind (rope_type, or the older key type), then that kind's fields.
ROPE_KIND = (Field("rope_type", STRING, default=None, choices=("default", "llama3"), nullable=True),
             Field("type", STRING, default=None, choices=("default", "llama3"), nullable=True))
ROPE = {
    "default": (*ROPE_KIND, Field("rope_theta", NUMBER, POSITIVE, None)),
    "llama3": (*ROPE_KIND, Field("rope_theta", NUMBER, POSITIVE, None), Field("factor", NUMBER, POSITIVE),
               Field("low_freq_factor", NUMBER, POSITIVE), Field("high_freq_factor", NUMBER, POSITIVE),
               Field("original_max_position_embeddings", INTEGER, POSITIVE)),
}
RULES = (
    Rule("num_key_value_heads", lambda v: v["num_attention_heads"] % v["num_key_value_heads"] == 0,
         "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"),
    Rule("head_dim", lambda v: v["head_dim"] >= 1 and v["head_dim"] % 2 == 0,
         "must be a positive even number (got {head_dim}, from hidden_size / num_attention_heads if not given)"),
    Rule("num_experts_per_tok", lambda v: v.get("num_local_experts") is None or v["num_experts_per_tok"] <= v["num_local_experts"],
         "{num_experts_per_tok} is more than num_local_experts {num_local_experts}"),
)
LLAMA3_RULES = (  # the blend between the two divides by their difference
    Rule("high_freq_factor", lambda v: v["high_freq_factor"] > v["low_freq_factor"],
         "{high_freq_factor} must be more than low_freq_factor {low_freq_factor}"),
)

UnsupportedConfig = Invalid  # a config.json this model cannot reproduce; `field` names what

# The widest sliding window kept: positions are int32, so a window this wide already hides
# no key of any sequence, and a wider one (transformers takes any integer; configs that mean
# "no window" write 1e15) would overflow them at the first step.
WIDEST_WINDOW = 2**31 - 1


def window_of(sliding_window: int | None) -> int | None:
    """config.json's `sliding_window` as our window: clamped to WIDEST_WINDOW (None: none)."""
    return None if sliding_window is None else min(sliding_window, WIDEST_WINDOW)


def config_values(hf: dict) -> dict:
    """config.json checked against its schema: {field: value}, defaults filled in."""
    return checked(hf, ARCHITECTURES, lambda architecture: CONFIG + MIXTRAL if architecture == "MixtralForCausalLM"
                   else CONFIG, RULES)


def checked(hf: dict, architectures: dict[str, str], fields: Callable[[str], tuple[Field, ...]],
            rules: tuple[Rule, ...]) -> dict:
    """A config.json of one of `architectures` (each with its model_type) checked against
    the `fields` of its architecture and the `rules`: {field: value}, defaults filled in
    (shared with the families that extend Llama's config)."""
    if not isinstance(hf, dict):
        raise Invalid("", "must hold a mapping")
    given = hf.get("architectures") or []
    if not isinstance(given, list) or len(given) != 1 or given[0] not in architectures:
        raise Invalid("architectures", f"{given!r} is not one of {', '.join(architectures)}")
    # transformers' AutoModelForCausalLM builds the class model_type names, and these tensors
    # are the one architectures names: a file that names two models is refused, not read as either.
    model_type = hf.get("model_type")
    if model_type is not None and model_type != architectures[given[0]]:
        raise Invalid("model_type", f"{model_type!r} contradicts architectures {given!r}, whose model_type is "
                                    f"{architectures[given[0]]!r} (transformers builds the model model_type names); "
                                    f"correct the one that is wrong")
    values = check(hf, fields(given[0]), others="is not a field this loader knows; it may change the model")
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    values["head_dim"] = values["head_dim"] or values["hidden_size"] // values["num_attention_heads"]
    enforce(values, rules)
    return values


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our config of a Llama or Mixtral config.json; anything it cannot compute exactly is refused."""
    return config_of(config_values(hf))


def config_of(v: dict, cls: type[LlamaConfig] = LlamaConfig) -> LlamaConfig:
    """The config (`cls`: Llama's, or a family's that extends it) of checked config.json values."""
    theta, scaling = _rope(v)
    moe = None
    if "num_local_experts" in v:  # trained as transformers trains it: the pooled balance loss, no z-loss
        coef = v["router_aux_loss_coef"]
        moe = MoEConfig(experts=v["num_local_experts"], top_k=v["num_experts_per_tok"],
                        expert_mlp=v["intermediate_size"], balance_loss="pooled", z_loss_weight=0.0,
                        aux_loss_weight=MIXTRAL_AUX_LOSS_COEF if coef is None else float(coef))
    return cls(
        vocab=v["vocab_size"], embed=v["hidden_size"], layers=v["num_hidden_layers"],
        heads=v["num_attention_heads"], kv_heads=v["num_key_value_heads"], head_dim=v["head_dim"],
        mlp=v["intermediate_size"], rope_theta=theta, rope_scaling=scaling, norm_eps=float(v["rms_norm_eps"]),
        tie_embeddings=v["tie_word_embeddings"], moe=moe, pad_token=pad_token_of(v),
    )


def pad_token_of(v: dict) -> int | None:
    """config.json's pad_token_id, a row of the embedding (transformers refuses another)."""
    pad = v["pad_token_id"]
    if pad is not None and pad >= v["vocab_size"]:
        raise Invalid("pad_token_id", f"{pad} is not a row of the embedding (vocab_size {v['vocab_size']})")
    return pad


def pad_token_to_hf(cfg: LlamaConfig) -> dict:
    return {} if cfg.pad_token is None else {"pad_token_id": cfg.pad_token}


def _rope(v: dict) -> tuple[float, RopeScaling | None]:
    """rope_theta and rope_scaling (published configs), or transformers 5's rope_parameters."""
    where, kind, r, theta = rope_fields(v, ROPE_KIND, ROPE)
    if kind == "default":
        return theta, None
    enforce(r, LLAMA3_RULES, f"{where}.")
    return theta, RopeScaling(factor=float(r["factor"]), low_freq_factor=float(r["low_freq_factor"]),
                              high_freq_factor=float(r["high_freq_factor"]),
                              original_max_position=r["original_max_position_embeddings"])


def rope_fields(v: dict, kinds: tuple[Field, ...], fields: dict[str, tuple[Field, ...]]):
    """The rotary embedding's fields, from rope_parameters or rope_scaling (with the top-level
    rope_theta), checked against those of its kind (`kinds` name it, `fields` by kind).
    -> (where they were, the kind, {field: value}, rope_theta)"""
    if v["rope_parameters"] is not None and v["rope_scaling"] is not None:
        raise Invalid("rope_scaling", "and rope_parameters are both given; give one")
    where = "rope_parameters" if v["rope_parameters"] is not None else "rope_scaling"
    given = v[where] or {}
    named = check(given, kinds, f"{where}.", others=None)
    kind = named["rope_type"] or named["type"] or "default"
    r = check(given, fields[kind], f"{where}.", others=f"is not a field of rope_type {kind}")
    return where, kind, r, float(v["rope_theta"] if r["rope_theta"] is None else r["rope_theta"])


def config_to_hf(cfg: LlamaConfig) -> dict:
    """The config.json of our config, in the published form (rope_theta and rope_scaling)."""
    architecture = "MixtralForCausalLM" if cfg.moe else "LlamaForCausalLM"
    hf = {
        "architectures": [architecture], "model_type": ARCHITECTURES[architecture],
        "vocab_size": cfg.vocab, "hidden_size": cfg.embed, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.moe.expert_mlp if cfg.moe else cfg.mlp, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
    } | pad_token_to_hf(cfg)
    if cfg.rope_scaling:
        r = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                              "high_freq_factor": r.high_freq_factor,
                              "original_max_position_embeddings": r.original_max_position}
    if cfg.moe:
        hf |= {"num_local_experts": cfg.moe.experts, "num_experts_per_tok": cfg.moe.top_k, "sliding_window": None,
               "router_aux_loss_coef": cfg.moe.aux_loss_weight}
    else:
        hf["mlp_bias"] = False
    return hf


def supported(cfg: LlamaConfig) -> str | None:
    """Why our config has no Hugging Face equivalent (None: it has one)."""
    moe = cfg.moe
    if cfg.window or cfg.qkv_bias or cfg.qk_norm:
        return "LlamaForCausalLM and MixtralForCausalLM have no sliding window, q/k/v biases or q/k norms"
    if moe and (moe.shared_experts or moe.every != 1 or cfg.mlp_only_layers or moe.scoring != "softmax"):
        return "Mixtral has no shared experts, MoE in every layer and softmax routing"
    if moe and cfg.mlp != moe.expert_mlp:
        return "Mixtral's intermediate_size is the experts' width; the dense width must equal it"
    return None


# ------------------------------------------------------------------ parameters

@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of our parameters (`ours`: its path) and the published tensors it is made of;
    `stacked`: how many slices it has along the stacked layers' axis (0: not stacked), and
    the published names are those of slice `i`."""

    ours: tuple[str, ...]
    stacked: int
    names: Callable[[int], list[str]]  # slice -> published names
    shapes: Sequence[tuple[int, ...]]  # the published tensors' shapes (per slice: as many as names)
    to_ours: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of each step of the stacked layers: its path (`ours`), the number of
    steps, and the published layer of step i."""

    ours: tuple
    steps: int
    layer_of: Callable[[int], int]
    moe: bool  # the block's feed-forward is a mixture of experts

    def names(self, *names: str) -> Callable[[int], list[str]]:
        """The published names of step i's tensors `names` (after `model.layers.N.`)."""
        return lambda i: [f"model.layers.{self.layer_of(i)}.{n}" for n in names]


def blocks(cfg: LlamaConfig) -> list[Block]:
    """The blocks of a step: one block per layer; in an MoE model, moe.every - 1 dense
    blocks then an MoE one (models.llama.MoEGroup), and the dense layers at other positions
    (`dense_positions`) in a stack of their own. Their layers are listed when a layer is
    first named, not here: `tensor_count` counts from these before a config's depth is
    checked against the files."""
    if cfg.moe is None:
        return [Block(("blocks",), cfg.layers, lambda i: i, False)]
    every, steps = cfg.moe.every, functools.cache(lambda: cfg.stack_layers("blocks"))
    dense = [Block(("blocks", "dense", j), cfg.layer_steps, lambda i, j=j: steps()[i] + j, False)
             for j in range(every - 1)]
    return [*prefix_block(cfg), *dense, Block(("blocks", "moe"), cfg.layer_steps, lambda i: steps()[i] + every - 1, True)]


def prefix_block(cfg: LlamaConfig) -> list[Block]:
    """The stack of dense layers among MoE ones (`LlamaConfig.dense_positions`), if any."""
    dense = cfg.dense_positions
    return [Block(("prefix",), len(dense), lambda i: dense[i], False)] if dense else []


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """Where a family publishes an MoE layer's router and experts (after `model.layers.N.`;
    {j}: the expert)."""

    router: str
    gate: str
    up: str
    down: str


MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                              "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight")


def tensors(cfg: LlamaConfig, experts: ExpertNames = MIXTRAL_EXPERTS) -> list[Tensor]:
    e, v = cfg.embed, cfg.vocab
    found = [
        Tensor(("embedding",), 0, lambda i: ["model.embed_tokens.weight"], [(v, e)], only, listed),
        Tensor(("final_norm", "scale"), 0, lambda i: ["model.norm.weight"], [(e,)], only, listed),
    ]
    if not cfg.tie_embeddings:
        found.append(Tensor(("head",), 0, lambda i: ["lm_head.weight"], [(v, e)], lambda t: t[0].T, lambda w: [w.T]))
    for block in blocks(cfg):
        found += _attention(cfg, block) + (expert_tensors(cfg, block, experts) if block.moe else mlp_tensors(cfg, block))
    return found


def norm_name(cfg: LlamaConfig, path: tuple[str, ...]) -> str:
    """A block norm's published module (after `model.layers.N.`): transformers names the norm
    before the MLP post_attention_layernorm where it is the only one after attention (Llama)
    and pre_feedforward_layernorm where a norm of attention's output takes that name (Gemma 3)."""
    return {("attn_norm",): "input_layernorm", ("post_attn_norm",): "post_attention_layernorm",
            ("mlp_norm",): "pre_feedforward_layernorm" if cfg.NORMS.after else "post_attention_layernorm",
            ("post_mlp_norm",): "post_feedforward_layernorm", ("attn", "q_norm"): "self_attn.q_norm",
            ("attn", "k_norm"): "self_attn.k_norm"}[path]


def norm_tensors(cfg: LlamaConfig, b: Block) -> list[Tensor]:
    """Every norm of block `b`, from the description the model builds them from
    (`LlamaConfig.block_norms`); published flat, as torch's RMSNorm holds a scale."""
    found = []
    for path, (shape, _) in cfg.block_norms().items():
        size = math.prod(shape)
        found.append(Tensor((*b.ours, *path, "scale"), b.steps, b.names(f"{norm_name(cfg, path)}.weight"), [(size,)],
                            lambda t, shape=shape: t[0].reshape(shape), lambda w, size=size: [w.reshape(size)]))
    return found


def _attention(cfg: LlamaConfig, b: Block) -> list[Tensor]:
    e, h, k, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
    return [
        *norm_tensors(cfg, b),
        Tensor((*b.ours, "attn", "wq"), b.steps, b.names("self_attn.q_proj.weight"), [(h * d, e)],
               lambda t: t[0].T.reshape(e, h, d), lambda w: [w.reshape(e, h * d).T]),
        # Query head n reads key/value head n // (h / k), as transformers' repeat_kv.
        Tensor((*b.ours, "attn", "wkv"), b.steps, b.names("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
               [(k * d, e), (k * d, e)], lambda t: np.stack([t[0].T, t[1].T], axis=1).reshape(e, 2, k, d).swapaxes(1, 2),
               lambda w: [w[:, :, 0].reshape(e, k * d).T, w[:, :, 1].reshape(e, k * d).T]),
        Tensor((*b.ours, "attn", "wo"), b.steps, b.names("self_attn.o_proj.weight"), [(e, h * d)],
               lambda t: t[0].T.reshape(h, d, e), lambda w: [w.reshape(h * d, e).T]),
    ]


def mlp_tensors(cfg: LlamaConfig, b: Block) -> list[Tensor]:
    e, m = cfg.embed, cfg.mlp
    return [
        Tensor((*b.ours, "mlp", "gate_up"), b.steps, b.names("mlp.gate_proj.weight", "mlp.up_proj.weight"),
               [(m, e), (m, e)], lambda t: np.stack([t[0].T, t[1].T], axis=1), lambda w: [w[:, 0].T, w[:, 1].T]),
        Tensor((*b.ours, "mlp", "down"), b.steps, b.names("mlp.down_proj.weight"), [(e, m)],
               lambda t: t[0].T, lambda w: [w.T]),
    ]


def expert_tensors(cfg: LlamaConfig, b: Block, names: ExpertNames) -> list[Tensor]:
    e, n, m = cfg.embed, cfg.moe.experts, cfg.moe.expert_mlp
    # Named when a layer is read, not here: a config's expert count is checked against the
    # files (`tensor_count`, counted from these) before any list as long as the experts.
    each = lambda *templates: lambda i: b.names(*(t.format(j=j) for t in templates for j in range(n)))(i)  # noqa: E731
    return [
        Tensor((*b.ours, "mlp", "router"), b.steps, b.names(names.router), [(n, e)], lambda t: t[0].T, lambda w: [w.T]),
        Tensor((*b.ours, "mlp", "gate_up"), b.steps, each(names.gate, names.up), Repeated((m, e), 2 * n),
               lambda t: np.stack([np.stack(t[:n]), np.stack(t[n:])], axis=2).transpose(0, 3, 2, 1),
               lambda w: [w[j, :, s].T for s in (0, 1) for j in range(n)]),
        Tensor((*b.ours, "mlp", "down"), b.steps, each(names.down), Repeated((e, m), n),
               lambda t: np.stack(t).transpose(0, 2, 1), lambda w: list(w.transpose(0, 2, 1))),
    ]


# Where each LoRA target (models.lora) is: the module it adapts, and its module name after
# `model.layers.N.`.
PROJECTIONS = {"q_proj": ("attn", "self_attn.q_proj"), "k_proj": ("attn", "self_attn.k_proj"),
               "v_proj": ("attn", "self_attn.v_proj"), "o_proj": ("attn", "self_attn.o_proj"),
               "gate_proj": ("mlp", "mlp.gate_proj"), "up_proj": ("mlp", "mlp.up_proj"), "down_proj": ("mlp", "mlp.down_proj")}


PEFT_PREFIX = "base_model.model."  # PEFT's name of the adapted model, before the model's own names


def adapter_tensors(cfg: LlamaConfig, targets: tuple[str, ...], rank: int) -> list[Tensor]:
    """A LoRA adapter's tensors as PEFT saves them: per adapted projection of each layer,
    `<module>.lora_A.weight` (rank, inputs) and `<module>.lora_B.weight` (outputs, rank);
    ours are A (*inputs, rank) and B (rank, *outputs). Experts take none."""
    found = []
    for block in blocks(cfg):
        for target in targets:
            (module, name), (inputs, outputs) = PROJECTIONS[target], cfg.projection_shapes()[target]
            if module == "mlp" and block.moe:
                continue
            ours, n_in, n_out = (*block.ours, module, f"lora_{target}"), math.prod(inputs), math.prod(outputs)
            published = lambda matrix, name=name, block=block: lambda i: [  # noqa: E731
                PEFT_PREFIX + n for n in block.names(f"{name}.{matrix}.weight")(i)]
            found += [
                Tensor((*ours, "a"), block.steps, published("lora_A"), [(rank, n_in)],
                       lambda t, inputs=inputs: t[0].T.reshape(*inputs, rank), lambda w, n=n_in: [w.reshape(n, rank).T]),
                Tensor((*ours, "b"), block.steps, published("lora_B"), [(n_out, rank)],
                       lambda t, outputs=outputs: t[0].T.reshape(rank, *outputs),
                       lambda w, n=n_out: [w.reshape(rank, n).T]),
            ]
    return found


class Repeated(Sequence):
    """One shape `n` times, without a list of n (a config's expert count is checked against
    the files only after `tensor_count` has counted them)."""

    def __init__(self, shape: tuple[int, ...], n: int):
        self.shape, self.n = shape, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.shape] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.shape


def counted(found: list[Tensor]) -> int:
    """How many published tensors `found` names over every slice, without naming them."""
    return sum(len(t.shapes) * (t.stacked or 1) for t in found)


def count_of(tensors_of: Callable[[LlamaConfig], list[Tensor]], experts_field: str = "num_local_experts"
             ) -> Callable[[LlamaConfig], tuple[int, str]]:
    """A layout's `tensor_count`: how many published tensors `tensors_of(cfg)` names, counted
    from that same list (never restated), and the config.json fields that decide it. A
    loader checks a config's depth against the files with it before any per-layer work."""
    def tensor_count(cfg: LlamaConfig) -> tuple[int, str]:
        fields = f"num_hidden_layers {cfg.layers}" + (f", {experts_field} {cfg.moe.experts}" if cfg.moe else "")
        return counted(tensors_of(cfg)), fields

    return tensor_count


tensor_count = count_of(tensors)


TIED_HEAD = "config.json ties it to (tie_word_embeddings true); set it false to use this head"


def copies(cfg: LlamaConfig) -> dict[str, tuple[str, str]]:
    """Published tensors a checkpoint may hold beside the one they copy (name -> the
    tensor copied, and what ties them, said if they differ): a tied model's lm_head.weight
    (Qwen3-0.6B ships one). Accepted when equal, as transformers' tie_weights re-ties an
    equal copy; one that differs is a head the tied config would drop."""
    return {"lm_head.weight": ("model.embed_tokens.weight", TIED_HEAD)} if cfg.tie_embeddings else {}


def only(t: list[np.ndarray]) -> np.ndarray:
    return t[0]


def listed(w: np.ndarray) -> list[np.ndarray]:
    return [w]
