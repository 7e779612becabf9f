"""The Llama family's config: the shapes and the choices of one model, as data. The other
families' configs extend it with their defaults (models/<family>/model.py), and the
module (models.llama.model) reads its flags."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from models.moe import MoEConfig


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's stretch of the rotary frequencies for long contexts: wavelengths longer
    than original_max_position / low_freq_factor are slowed by `factor`, those shorter
    than original_max_position / high_freq_factor kept, those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def with_factor(self, factor: float) -> RopeScaling:
        return dataclasses.replace(self, factor=factor)


@dataclasses.dataclass(frozen=True)
class Norms:
    """Where a family's blocks norm (its config's NORMS, not a field: the family states it).
    `before`: each sublayer's input (`attn_norm`, `mlp_norm`: pre-norm, as Llama);
    `after`: each sublayer's output, before the residual sum (`post_attn_norm`,
    `post_mlp_norm`: Gemma 3 has both, OLMo 2 these alone); `qk`: where `qk_norm`, the
    query and key norms' span: "head" (each head alone, one scale of head_dim shared by
    every head: Qwen3, Gemma 3) or "projection" (the whole q and k projections, a scale
    per element: OLMo 2)."""

    before: bool = True
    after: bool = False
    qk: str = "head"


# Gemma 3's choices, fields of every family's config before they moved to models.gemma3, at
# the values that leave them off: a run saved then holds them so.
GEMMA_FIELDS_OFF = {"layer_types": None, "local_rope_theta": None, "rope_linear_factor": 1.0, "query_scale": None,
                    "norm_offset": False, "sandwich_norms": False, "activation": "silu", "embed_scale": False}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    embed: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    moe: MoEConfig | None = None  # MoE feed-forward in every moe.every-th layer
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotation (Qwen3)
    window: int | None = None  # sliding window of every layer's attention: a query sees this many keys (Mistral)
    qkv_bias: bool = False  # biases on the query, key and value projections, not the output's (Qwen2)
    # config.json's pad_token_id: transformers builds the embedding with padding_idx=pad_token_id,
    # so that row gets no gradient from the lookup (a tied head still trains it); so here.
    pad_token: int | None = None
    family: str = "llama"  # which family's config this is, kept when it is saved as data (models.config_from_dict)
    # Identity layers after the stacked ones, so that pipeline stages of equal depth hold a
    # depth that does not divide into them (spmd.run.config's --empty-layers): they have
    # weights, which nothing trains or exports, and stages run them without effect.
    empty_layers: int = 0
    NORMS = Norms()  # (not a field) a block's norms: before attention and before the MLP
    # In an MoE model with MoE in every layer (moe.every 1): the layers whose feed-forward is
    # dense (Qwen3-MoE's mlp_only_layers), at any positions. They are a stack of their own
    # (`dense_positions`), run in the model's order between runs of the MoE stack.
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        dense = self.dense_positions
        if not dense:
            return
        if self.moe is None or self.moe.every != 1:
            raise ValueError("dense layers among MoE ones (mlp_only_layers) need MoE in each of the others (moe.every 1)")
        if list(dense) != sorted(set(dense)) or dense[0] < 0 or dense[-1] >= self.layers or len(dense) == self.layers:
            raise ValueError(f"the dense layers {list(dense)} must be distinct layers of 0 to {self.layers - 1}, in "
                             "order, and leave at least one MoE layer")

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """The config of `dataclasses.asdict(config)` (as a run saves it)."""
        values = dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        for name, value in GEMMA_FIELDS_OFF.items():  # (a run saved when every family had them)
            if name not in names and values.get(name, value) == value:
                values.pop(name, None)
        for name, nested in (("rope_scaling", RopeScaling), ("moe", MoEConfig)):
            if values.get(name) is not None:
                values[name] = nested(**values[name])
        if values.get("mlp_only_layers") is not None:  # saved as a list; a config is hashable
            values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
        return cls(**values)

    def _frequencies(self, theta: float) -> np.ndarray:
        # As transformers computes them, in float32, so that long positions agree too.
        exponent = np.arange(0, self.head_dim, 2).astype(np.float32) / np.float32(self.head_dim)
        return np.float32(1.0) / np.float32(theta) ** exponent

    @property
    def local_layers(self) -> np.ndarray | None:
        """Per layer, whether it is a sliding one, where layers differ in kind (a family's
        layer pattern: models.gemma3); None: every layer alike, windowed if `window`."""
        return None

    @property
    def rope_frequencies(self) -> np.ndarray:
        """Angle per position of each rotated pair (head_dim / 2,), float32."""
        freqs = self._frequencies(self.rope_theta)
        r = self.rope_scaling
        if r is None:
            return freqs
        wavelength = 2 * np.pi / freqs
        slowed = freqs / r.factor
        blend = (r.original_max_position / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        blended = (1 - blend) * slowed + blend * freqs
        long_waves = wavelength > r.original_max_position / r.low_freq_factor
        short_waves = wavelength < r.original_max_position / r.high_freq_factor
        return np.where(long_waves, slowed, np.where(short_waves, freqs, blended)).astype(np.float32)

    def attended_keys(self, seq: int) -> float:
        """Keys a query attends to, on average over a sequence of `seq` and every layer, in
        the continuous form FLOP counts use (PaLM's): seq / 2 under the causal mask, and
        w - w^2 / 2 seq under a window w (w for most queries, fewer for the first w)."""
        w = min(self.window or seq, seq)
        windowed = w - w * w / (2 * seq)
        if self.local_layers is None:
            return windowed
        local = float(np.mean(self.local_layers))
        return local * windowed + (1 - local) * seq / 2

    def block_norms(self) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple[str, ...]]]:
        """Every norm of a block, from NORMS: its path in the block -> its scale's shape and
        logical names. The one description the model builds, the Hugging Face layout
        names (models.llama.hf.norm_tensors) and `num_params` counts."""
        e, h, k, d, n = self.embed, self.heads, self.kv_heads, self.head_dim, self.NORMS
        embed = ((e,), ("embed",))
        norms = {}
        for sublayer in ("attn", "mlp"):
            norms |= {(f"{sublayer}_norm",): embed} if n.before else {}
            norms |= {(f"post_{sublayer}_norm",): embed} if n.after else {}
        if self.qk_norm and n.qk == "head":
            norms |= {("attn", "q_norm"): ((d,), ("head_dim",)), ("attn", "k_norm"): ((d,), ("head_dim",))}
        elif self.qk_norm:  # laid out as the projections' outputs, so that tp splits them alike
            norms |= {("attn", "q_norm"): ((h, d), ("heads", "head_dim")),
                      ("attn", "k_norm"): ((k, d), ("kv_heads", "head_dim"))}
        return norms

    def block_norm_params(self) -> int:
        """A block's norms' parameters (`block_norms`)."""
        return sum(math.prod(shape) for shape, _ in self.block_norms().values())

    def projection_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each projection's input and output dimensions as the model lays them out, by its
        Hugging Face name (the LoRA targets, models.lora)."""
        e, h, k, d, m = self.embed, self.heads, self.kv_heads, self.head_dim, self.mlp
        return {"q_proj": ((e,), (h, d)), "k_proj": ((e,), (k, d)), "v_proj": ((e,), (k, d)), "o_proj": ((h, d), (e,)),
                "gate_proj": ((e,), (m,)), "up_proj": ((e,), (m,)), "down_proj": ((m,), (e,))}

    @property
    def dense_positions(self) -> tuple[int, ...]:
        """The layers of an MoE model that are dense and not in the stacked blocks: a stack
        of their own (`prefix`, run outside pipeline stages). A family may name them otherwise
        (models.deepseek3: its first `dense_layers`)."""
        return self.mlp_only_layers

    def layer_runs(self) -> tuple[tuple[str, int, int], ...]:
        """The model's layers in order, as runs of one stack: (stack, first step, steps), the
        stack "prefix" (`dense_positions`) or "blocks" (the stacked blocks, less empty steps)."""
        dense = set(self.dense_positions)
        if not dense:
            return (("blocks", 0, self.layer_steps),)
        runs, taken = [], {"prefix": 0, "blocks": 0}
        for layer in range(self.layers):
            stack = "prefix" if layer in dense else "blocks"
            if runs and runs[-1][0] == stack:
                runs[-1][2] += 1
            else:
                runs.append([stack, taken[stack], 1])
            taken[stack] += 1
        return tuple(map(tuple, runs))

    def stack_layers(self, stack: str) -> tuple[int, ...]:
        """Per step of `stack` ("prefix" or "blocks", less its empty steps), the model's
        layer it begins with (a step of MoE groups holds moe.every layers)."""
        dense = self.dense_positions
        if stack == "prefix":
            return dense
        if not dense:
            return tuple(range(0, self.layer_steps * self.layers_per_step, self.layers_per_step))
        return tuple(sorted(set(range(self.layers)) - set(dense)))

    @property
    def dense_prefix_only(self) -> bool:
        """Whether the dense layers (`dense_positions`) all come first: only then can pipeline
        stages take the stacked blocks, the prefix running before them."""
        return [stack for stack, _, _ in self.layer_runs()] in (["blocks"], ["prefix", "blocks"])

    @property
    def stacked_layers(self) -> int:
        """The layers the stacked blocks hold (pipeline stages split them): all but the dense
        ones of `dense_positions`, and the empty ones."""
        return self.layers - len(self.dense_positions) + self.empty_layers

    @property
    def prefix_layers(self) -> int:
        """The layers outside the stacked ones, which run outside pipeline stages (the
        dense layers of `dense_positions`)."""
        return self.layers + self.empty_layers - self.stacked_layers

    @property
    def moe_layers_run(self) -> int:
        """The MoE layers a pipelined step runs: the model's, and those of its empty steps."""
        return self.moe_layers + (self.empty_steps if self.moe else 0)

    @property
    def layers_per_step(self) -> int:
        """Layers per step of the stacked blocks: an MoE group's (moe.every), else one."""
        return self.moe.every if self.moe else 1

    @property
    def layer_steps(self) -> int:
        """Steps of the stacked blocks that hold layers (the empty ones come after them)."""
        return (self.stacked_layers - self.empty_layers) // self.layers_per_step

    @property
    def empty_steps(self) -> int:
        return self.empty_layers // self.layers_per_step

    def filled_steps(self) -> np.ndarray | None:
        """Per step of the stacked blocks, whether it holds layers rather than empty ones
        (None: no empty ones)."""
        if not self.empty_layers:
            return None
        return np.arange(self.layer_steps + self.empty_steps) < self.layer_steps

    def attention_width(self) -> int:
        """Per head, the width of q k^T plus that of the weights times v."""
        return 2 * self.head_dim

    def attention_input_gradient(self) -> int:
        """Per token and layer, the elements of the gradient that tp sums in attention's
        backward pass: of the input of its head-split projections, the block's input."""
        return self.embed

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe.every - len(self.dense_positions) if self.moe else 0

    def num_params(self, active: bool = False) -> int:
        """Parameter count from the shapes (matches the built model); `active`: only those
        one token multiplies with (its top-k experts)."""
        attn = ((self.embed + self.qkv_bias) * self.head_dim * (self.heads + 2 * self.kv_heads)
                + self.embed * self.heads * self.head_dim)
        dense = self.layers - self.moe_layers
        blocks = self.layers * (attn + self.block_norm_params()) + dense * 3 * self.embed * self.mlp
        if self.moe:
            per_layer = self.moe.active_per_layer if active else self.moe.params_per_layer
            blocks += self.moe_layers * per_layer(self.embed)
        head = 0 if self.tie_embeddings else self.embed * self.vocab
        return self.vocab * self.embed + blocks + self.embed + head
