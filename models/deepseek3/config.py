"""DeepSeek-V3's config: Llama's fields (heads, widths, MoE) and those of multi-head latent
attention (query and key/value ranks, a rotary part and a value size of their own per
head), a dense prefix before the MoE layers, and YaRN's stretch of the rotary frequencies."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from models.llama.config import LlamaConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN (rope_type "yarn"): wavelengths longer than the original context / beta_slow
    rotations are slowed by `factor`, those shorter than it / beta_fast kept, a linear ramp
    between (over the frequency index, its ends rounded outward when `truncate`). The
    rotation is scaled by mscale(mscale) / mscale(mscale_all_dim), and the softmax by
    mscale(mscale_all_dim)^2 (both as transformers computes them)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def frequencies(self, dim: int, theta: float) -> np.ndarray:
        def turns_at(rotations: float) -> float:  # the frequency index that makes `rotations` turns over the context
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = turns_at(self.beta_fast), turns_at(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        kept = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolated = 1 - ramp.astype(np.float32)
        return ((1.0 / (np.float32(self.factor) * kept)) * (1 - extrapolated) + (1.0 / kept) * extrapolated
                ).astype(np.float32)

    @property
    def rotation_scale(self) -> float:
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale(self) -> float:
        """What the scores are multiplied by beyond head_dim ** -0.5."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Config(LlamaConfig):
    """`head_dim` is a query's and a key's size per head (qk_nope_head_dim +
    qk_rope_head_dim), of which the last `rope_dim` rotate; `v_dim` a value's; keys and
    values come from a shared latent of `kv_rank` (+ the rotary key, shared by every head),
    queries from one of `q_rank` (None: from the hidden state directly). `kv_heads` equals
    `heads`. The first `dense_layers` layers have a dense MLP of width `mlp`, the rest `moe`."""

    kv_rank: int = 512
    rope_dim: int = 64
    v_dim: int = 128
    q_rank: int | None = None
    dense_layers: int = 0
    yarn: Yarn | None = None
    # Multi-token prediction (models.deepseek3.mtp): modules after the model, the k-th
    # predicting the token k + 1 ahead of the next; trained, never exported or served.
    mtp_depth: int = 0
    norm_eps: float = 1e-6
    family: str = "deepseek_v3"

    def __post_init__(self):
        if self.kv_heads != self.heads:
            raise ValueError(f"latent attention has a key and value per head: kv_heads ({self.kv_heads}) must equal "
                             f"heads ({self.heads})")
        if not 0 < self.rope_dim < self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim ({self.rope_dim}) must be even and less than head_dim ({self.head_dim})")
        if self.v_dim > self.head_dim:  # values are padded to the key size for the kernels (models.deepseek3.model)
            raise ValueError(f"v_dim ({self.v_dim}) must be at most head_dim ({self.head_dim})")
        if self.moe is None or self.moe.every != 1 or not 0 <= self.dense_layers < self.layers:
            raise ValueError(f"DeepSeek-V3 has MoE in every layer after its {self.dense_layers} dense ones, and at "
                             f"least one: {self.layers} layers")
        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth ({self.mtp_depth}) must be 0 or more")
        m = self.moe
        if m.experts % m.groups or m.top_k > m.experts // m.groups * m.top_groups:
            raise ValueError(f"{m.experts} experts do not split into {m.groups} groups of which {m.top_groups} "
                             f"hold top-{m.top_k}")
        super().__post_init__()

    @classmethod
    def from_dict(cls, d: dict) -> DeepSeekV3Config:
        values = dict(d)
        yarn = values.pop("yarn", None)
        cfg = super().from_dict(values)
        return dataclasses.replace(cfg, yarn=Yarn(**yarn)) if yarn else cfg

    @property
    def nope_dim(self) -> int:
        """The part of a query's and a key's head that does not rotate."""
        return self.head_dim - self.rope_dim

    @property
    def latent_dim(self) -> int:
        """What the cache keeps per token and layer: the latent and the rotary key."""
        return self.kv_rank + self.rope_dim

    @property
    def rope_frequencies(self) -> np.ndarray:
        if self.yarn:
            return self.yarn.frequencies(self.rope_dim, self.rope_theta)
        exponent = np.arange(0, self.rope_dim, 2).astype(np.float32) / np.float32(self.rope_dim)
        return np.float32(1.0) / np.float32(self.rope_theta) ** exponent

    @property
    def dense_positions(self) -> tuple[int, ...]:
        return tuple(range(self.dense_layers))  # a stack of its own, the prefix

    def attention_width(self) -> int:
        return self.head_dim + self.v_dim

    def attention_input_gradient(self) -> int:
        """The query's rank (or the block's input) and the latent and the rotary key, which
        every head's up-projection reads."""
        return (self.q_rank or self.embed) + self.kv_rank + self.rope_dim

    def projection_shapes(self) -> dict:
        return {}  # LoRA's targets are Llama's projections, which latent attention does not have

    def attention_params(self) -> int:
        e, h, d = self.embed, self.heads, self.head_dim
        query = e * h * d if self.q_rank is None else e * self.q_rank + self.q_rank + self.q_rank * h * d
        keys_values = e * self.latent_dim + self.kv_rank + self.kv_rank * h * (self.nope_dim + self.v_dim)
        return query + keys_values + h * self.v_dim * e

    def num_params(self, active: bool = False) -> int:
        per_layer = self.moe.active_per_layer if active else self.moe.params_per_layer
        blocks = (self.layers * (self.attention_params() + self.block_norm_params())
                  + self.dense_layers * 3 * self.embed * self.mlp + self.moe_layers * per_layer(self.embed))
        # Each prediction module: its join of two normed inputs, an MoE block, its norm (the
        # embedding and head are the model's).
        mtp = self.mtp_depth * (2 * self.embed * self.embed + 5 * self.embed + self.attention_params()
                                + per_layer(self.embed))
        return 2 * self.vocab * self.embed + blocks + self.embed + mtp
