"""A Llama-family decoder written for one device.

RMSNorm, rotary embeddings, grouped-query attention (with Qwen3's RMSNorm of each query
and key head, `qk_norm`; Qwen2's query, key and value biases, `qkv_bias`; Mistral's
sliding window, `window`; Gemma 3's sliding and global layers and its norms, see
models.gemma3) and a SwiGLU MLP, or a mixture of experts in every n-th layer
(models.moe); the blocks are created stacked (one leading
"layers" axis) and run with a scan, so compile time does not grow with depth. Every
parameter and the important activations carry logical axis names (`batch, seq,
residual_seq, embed, heads, kv_heads, head_dim, mlp, vocab, experts, layers`); nothing
here knows about meshes, devices or parallel strategies.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.annotate import ACTIVATION, PREFIX_LAYERS, UP_PROJECTED, assembled, constrain, copies, weight
from models.attention import Packing, attend, cached_attention
from models.fp8 import linear
from models.llama.config import LlamaConfig
from models.llama.layers import Decoding, RMSNorm, normal_param, rotary, zeros_param
from models.llama.stack import each_stacked, joined, stack_of, steps_of, with_empty_steps
from models.lookup import looked_up
from models.lora import Adapter, LoRA, current_layer, dropping
from models.lora import layer as lora_layer
from models.lora import merged as merged_adapters
from models.moe import MoE, Routing

# Activation checkpointing of each block. Every policy keeps only what it lists, so a
# weight as used (`models.annotate.weight`: cast, and gathered if it is stored split) is
# never kept for the backward pass: it is fetched again, as FSDP does, instead of holding
# every layer's gathered weights at once. "none" keeps every matmul output and every
# annotated activation, and recomputes only elementwise ops.
REMAT_POLICIES = {
    "none": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(ACTIVATION, UP_PROJECTED)),
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Attention(nnx.Module):
    NORM = RMSNorm  # of the query and key heads (a family's blocks may norm otherwise: models.gemma3)

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, lora: LoRA | None = None):
        e, h, k, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        # Queries; keys and values in one projection ([:, :, 0] keys, [:, :, 1] values).
        # Query head n reads key/value head n // (heads / kv_heads), so a split of the
        # heads that is a split of the kv heads too keeps each query with its key and value;
        # finer splits share a kv head between devices.
        self.wq = normal_param(rngs, (e, h, d), ("embed", "heads", "head_dim"), e**-0.5)
        self.wkv = normal_param(rngs, (e, k, 2, d), ("embed", "kv_heads", None, "head_dim"), e**-0.5)
        self.wo = normal_param(rngs, (h, d, e), ("heads", "head_dim", "embed"), (h * d) ** -0.5)
        if cfg.qkv_bias:  # laid out as wq and wkv are
            self.bq = zeros_param((h, d), ("heads", "head_dim"))
            self.bkv = zeros_param((k, 2, d), ("kv_heads", None, "head_dim"))
        if cfg.qk_norm:  # per head, or over the whole projection (`LlamaConfig.block_norms`)
            (q_shape, q_names), (k_shape, k_names) = (cfg.block_norms()[("attn", n)] for n in ("q_norm", "k_norm"))
            self.q_norm, self.k_norm = self.NORM(q_shape, cfg.norm_eps, q_names), self.NORM(k_shape, cfg.norm_eps, k_names)
        embed, kv = ((e,), ("embed",)), ((k, d), ("kv_heads", "head_dim"))
        for target, (inputs, in_names), (outputs, out_names) in (
                ("q_proj", embed, ((h, d), ("heads", "head_dim"))), ("k_proj", embed, kv), ("v_proj", embed, kv),
                ("o_proj", ((h, d), ("heads", "head_dim")), embed)):
            if lora and lora.adapts(target):
                setattr(self, f"lora_{target}", Adapter(lora, target, inputs, in_names, outputs, out_names, rngs))
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x: jax.Array, positions: jax.Array, packing: Packing | None = None,
                 local: jax.Array | None = None) -> jax.Array:
        """`positions` (seq,): the columns' order; `packing`: the examples of packed rows
        (their positions are what the rotation reads); `local`: whether this layer is a
        sliding one, where layers differ (`LlamaConfig.local_layers`)."""
        segments = None if packing is None else packing.segments
        q, k, v = self._project(x, positions if packing is None else packing.positions, local)
        if local is None:
            return self._output(attend(q, k, v, positions, segments, self.cfg.window))
        # Both kinds are compiled (a kernel takes its window while tracing); a layer runs one.
        out = jax.lax.cond(local, lambda: attend(q, k, v, positions, segments, self.cfg.window),
                           lambda: attend(q, k, v, positions, segments, None))
        return self._output(out)

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict, block: tuple[jax.Array, int],
               at: Decoding, local: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Attention of new tokens (`positions` (batch, seq)) to themselves and to what the
        key/value cache holds for `block` (its index in `cache`'s two leading dimensions);
        their keys and values are written into the cache, in place, at `at`."""
        q, k, v = self._project(x, positions, local)
        b, s, _, _, d = q.shape
        q = q.reshape(b, s, self.cfg.kv_heads, -1, d)  # the cache holds each kv head once
        cache = dict(cache)
        for name, new in (("k", k), ("v", v)):
            new = new[:, :, ::copies("kv_heads")]
            start = (*block, 0, 0, at.slot, 0)
            new = new.swapaxes(1, 2)[None, None].astype(cache[name].dtype)  # (1, 1, batch, kv_heads, seq, head_dim)
            cache[name] = jax.lax.dynamic_update_slice(cache[name], new, start)
        length = cache["k"].shape[-2]

        def read(start, size):
            """Slots start..start + size of this block's keys and values (only those are read)."""
            shape = (1, 1, *cache["k"].shape[2:-2], size, cache["k"].shape[-1])
            return tuple(constrain(jax.lax.dynamic_slice(cache[name], (*block, 0, 0, start, 0), shape)[0, 0],
                                   "batch", "kv_heads", None, "head_dim").astype(q.dtype) for name in ("k", "v"))

        window = self.cfg.window
        if local is not None:  # a window past the cache's end shows all of it
            window = jnp.where(local, window, length + 1)
        return self._output(cached_attention(q, read, length, at.slots(x.shape[1]), at.valid, window)), cache

    def _project(self, x: jax.Array, positions: jax.Array, local: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (batch, seq, kv slots, heads per slot, head_dim), keys and values (batch,
        seq, kv slots, head_dim), rotated by their positions. A slot is a kv head, or one of
        its `copies` (models.annotate) when a trainer splits the query heads more finely.

        For a family: keys and values are computed once per slot, not per kv head, so that
        every device holds the kv heads its query heads read without a gather. What a family
        adds per kv head (a bias, a norm's scale, an adapter's output) is repeated `copies`
        times along the kv_heads axis here, and what it computes over all the keys (a norm
        over the whole projection) is unchanged by equal copies (RMSNorm's `copies`); the
        cache (`decode`) keeps one copy of each."""
        cfg, dt = self.cfg, self.dtype
        b, s = x.shape[:2]
        c = copies("kv_heads")
        slots, per_slot = cfg.kv_heads * c, cfg.heads // (cfg.kv_heads * c)
        # One matmul, so that x has one gradient (one reduction when the heads are split):
        # each slot's queries, key and value side by side, (embed, slots, per_slot + 2, head_dim).
        # Query head n is in slot n // per_slot and reads kv head n // (heads / kv_heads).
        wq = weight(self.wq, dt, lay_out=False).reshape(cfg.embed, slots, per_slot, cfg.head_dim)
        wkv = weight(self.wkv, dt, lay_out=False)
        wkv = jnp.repeat(wkv, c, axis=1) if c > 1 else wkv
        # Slots are split like the query heads.
        wqkv = assembled(jnp.concatenate([wq, wkv], axis=2), "embed", "heads", None, "head_dim")
        qkv = linear("bse,ekgd->bskgd", x, wqkv, parts=("g", (per_slot, 1, 1)))
        if cfg.qkv_bias:  # side by side as the weights are: (slots, per_slot + 2, head_dim)
            # Added in float32, as norm scales are used: their gradients are sums over every token.
            bq = weight(self.bq, jnp.float32, lay_out=False).reshape(slots, per_slot, cfg.head_dim)
            bkv = weight(self.bkv, jnp.float32, lay_out=False)
            bkv = jnp.repeat(bkv, c, axis=0) if c > 1 else bkv
            qkv = (qkv + assembled(jnp.concatenate([bq, bkv], axis=1), "heads", None, "head_dim")).astype(dt)
        q, k = qkv[:, :, :, :per_slot].reshape(b, s, cfg.heads, cfg.head_dim), qkv[:, :, :, per_slot]
        v = qkv[:, :, :, per_slot + 1]
        q = _adapted(self, q, x, "q_proj")
        k, v = (_adapted(self, w, x, target, c) for w, target in ((k, "k_proj"), (v, "v_proj")))
        if cfg.qk_norm:  # over each head, or the whole projection (the keys' with each kv head c times)
            whole = cfg.NORMS.qk == "projection"
            q, k = self.q_norm(q), self.k_norm(k, c if whole else 1)
        freqs = self._frequencies(local)
        q = self._scaled(q)
        q = constrain(rotary(q, positions, freqs), "batch", "seq", "heads", "head_dim")
        k = constrain(rotary(k, positions, freqs), "batch", "seq", "kv_heads", "head_dim")
        v = constrain(v, "batch", "seq", "kv_heads", "head_dim")
        return q.reshape(b, s, slots, per_slot, cfg.head_dim), k, v

    def _frequencies(self, local: jax.Array | None) -> jax.Array:
        """The rotation's angle per position of each pair, in a layer of kind `local`."""
        return self.cfg.rope_frequencies

    def _scaled(self, q: jax.Array) -> jax.Array:
        """The queries as the kernels take them (they divide the scores by sqrt(head_dim))."""
        return q

    def _output(self, out: jax.Array) -> jax.Array:
        b, s = out.shape[:2]
        out = constrain(out.reshape(b, s, self.cfg.heads, self.cfg.head_dim), "batch", "seq", "heads", "head_dim")
        return _adapted(self, linear("bshd,hde->bse", out, weight(self.wo, self.dtype)), out, "o_proj")


def _adapted(module: nnx.Module, y: jax.Array, x: jax.Array, target: str, copies: int = 1) -> jax.Array:
    """A projection's output `y` of `x`, plus that of the module's adapter of `target`
    (models.lora), if it has one; keys' and values' with each kv head `copies` times, as
    they are computed with."""
    adapter = getattr(module, f"lora_{target}", None)
    if adapter is None:
        return y
    delta = adapter(x)
    return y + (jnp.repeat(delta, copies, axis=2) if copies > 1 else delta)


class SwiGLU(nnx.Module):
    """The gated MLP: act(x gate) * (x up), down; act SiLU (a family may gate otherwise:
    models.gemma3's GeGLU)."""

    ACTIVATION = staticmethod(jax.nn.silu)

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, lora: LoRA | None = None):
        e, m = cfg.embed, cfg.mlp
        # Gate and up projections in one matmul (one gradient for x): [:, 0] gate, [:, 1] up.
        self.gate_up = normal_param(rngs, (e, 2, m), ("embed", None, "mlp"), e**-0.5)
        self.down = normal_param(rngs, (m, e), ("mlp", "embed"), m**-0.5)
        embed, mlp = ((e,), ("embed",)), ((m,), ("mlp",))
        for target, inputs, outputs in (("gate_proj", embed, mlp), ("up_proj", embed, mlp), ("down_proj", mlp, embed)):
            if lora and lora.adapts(target):
                setattr(self, f"lora_{target}", Adapter(lora, target, *inputs, *outputs, rngs))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        gate_up = linear("bse,eim->bsim", x, weight(self.gate_up, dt), parts=("i", (1, 1)))
        # Split, not indexed: the backward pass joins the two gradients instead of adding zero-padded copies.
        gate, up = (part.squeeze(2) for part in jnp.split(gate_up, 2, axis=2))
        gate, up = _adapted(self, gate, x, "gate_proj"), _adapted(self, up, x, "up_proj")
        hidden = constrain(self.ACTIVATION(gate) * up, "batch", "seq", "mlp")
        return _adapted(self, linear("bsm,me->bse", hidden, weight(self.down, dt)), hidden, "down_proj")



class Block(nnx.Module):
    """Attention then a feed-forward layer: SwiGLU, or a mixture of experts (`routing`),
    with the norms the config's NORMS states: before each sublayer (pre-norm), after each
    on its output before the residual sum, or both. A family whose blocks differ subclasses
    it and names its parts (models.deepseek3's attention, models.gemma3's norm and MLP)."""

    ATTENTION = Attention
    MLP = SwiGLU
    NORM = RMSNorm

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, routing: Routing | None = None,
                 lora: LoRA | None = None):
        norms = cfg.block_norms()
        if ("attn_norm",) in norms:
            self.attn_norm = self.NORM(cfg.embed, cfg.norm_eps)
        self.attn = self.ATTENTION(cfg, dtype, rngs, lora)
        if ("mlp_norm",) in norms:
            self.mlp_norm = self.NORM(cfg.embed, cfg.norm_eps)
        self.mlp = self.MLP(cfg, dtype, rngs, lora) if routing is None else MoE(cfg.embed, cfg.moe, routing, dtype, rngs)
        for name in ("post_attn_norm", "post_mlp_norm"):
            if (name,) in norms:
                setattr(self, name, self.NORM(cfg.embed, cfg.norm_eps))

    def __call__(self, x: jax.Array, positions: jax.Array, packing: Packing | None = None,
                 local: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """The new residual stream, and the MoE layer's statistics (empty if dense)."""
        # The residual stream (and the norms on it) may be split along the sequence more
        # finely than the attention and MLP inside ("residual_seq", e.g. Megatron-SP).
        y = self.attn(constrain(self._normed(x, "attn_norm"), "batch", "seq", "embed"), positions, packing, local)
        x = constrain(x + self._normed(y, "post_attn_norm"), "batch", "residual_seq", "embed")
        normed = constrain(self._normed(x, "mlp_norm"), "batch", "seq", "embed")
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(normed, positions)
        else:
            y, stats = self.mlp(normed), {}
        return constrain(x + self._normed(y, "post_mlp_norm"), "batch", "residual_seq", "embed"), stats

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict, block: tuple[jax.Array, int], at: Decoding,
               local: jax.Array | None = None):
        """As a call, for new tokens against a key/value cache (see Attention.decode)."""
        y, cache = self.attn.decode(constrain(self._normed(x, "attn_norm"), "batch", "seq", "embed"), positions, cache,
                                    block, at, local)
        x = x + self._normed(y, "post_attn_norm")
        normed = constrain(self._normed(x, "mlp_norm"), "batch", "seq", "embed")
        y = self.mlp(normed, at.slots(x.shape[1]))[0] if isinstance(self.mlp, MoE) else self.mlp(normed)
        return constrain(x + self._normed(y, "post_mlp_norm"), "batch", "seq", "embed"), cache

    def _normed(self, x: jax.Array, norm: str) -> jax.Array:
        """`x` through the block's norm `norm`, or unchanged where NORMS gives it none."""
        module = getattr(self, norm, None)
        return x if module is None else module(x)


class MoEGroup(nnx.Module):
    """moe.every layers: every-1 dense blocks, then one MoE block (the unit that is stacked
    and scanned in an MoE model, so every scan step has the same structure)."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, routing: Routing, lora: LoRA | None = None,
                 block: type[Block] = Block):
        self.dense = nnx.List([block(cfg, dtype, rngs, lora=lora) for _ in range(cfg.moe.every - 1)])
        self.moe = block(cfg, dtype, rngs, routing, lora)

    def __call__(self, x: jax.Array, positions: jax.Array, packing: Packing | None = None) -> tuple[jax.Array, dict]:
        first = current_layer() * len(self.blocks)  # the group's first layer (for adapters' dropout)
        for j, block in enumerate(self.dense):
            with lora_layer(first + j):
                x, _ = block(x, positions, packing)
        with lora_layer(first + len(self.dense)):
            return self.moe(x, positions, packing)

    @property
    def blocks(self) -> list[Block]:
        return [*self.dense, self.moe]


class Llama(nnx.Module):
    """Decoder-only transformer: tokens (batch, seq) -> float32 logits (batch, seq, vocab)."""

    # What a trainer needs to know of the parameters, so that it never names them itself.
    STACKED = "blocks"  # stacked along a leading "layers" axis: scanned, split into pipeline stages
    # Stacked matrices (paths below the stack) whose input is not a named activation
    # (models.annotate.constrain), so that the backward pass under remat "none" recomputes
    # it (spmd.planner.theory: zb-v's input-gradient pass computes their gradients).
    RECOMPUTED_INPUT_WEIGHTS: tuple[str, ...] = ()
    LOOKUP_TABLE = "embedding"  # read by row lookups (in float32: a lookup has no FLOPs to save)
    # A family's parts: its block (models.gemma3's), and whether embeddings are scaled by sqrt(embed).
    BLOCK = Block
    EMBED_SCALE = False

    @staticmethod
    def decays(path: tuple[str, ...]) -> bool:
        """Whether weight decay applies to the parameter at `path`: matrices yes; norm scales
        and biases no (as transformers' Trainer leaves them)."""
        return path[-1] not in ("scale", "bq", "bkv", "bias")

    # Where each LoRA target is among the weights: the weight beside its adapter, and its
    # part of a fused weight (keys and values [:, :, 0|1], gate and up [:, 0|1]).
    FUSED = {"q_proj": ("wq", None), "k_proj": ("wkv", 0), "v_proj": ("wkv", 1), "o_proj": ("wo", None),
             "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", None)}

    @classmethod
    def merge_adapters(cls, params: dict, cfg: LlamaConfig, lora: LoRA) -> dict:
        """The parameters with their LoRA adapters merged into the weights (models.lora.merged)."""
        inputs = {target: len(shapes[0]) for target, shapes in cfg.projection_shapes().items()}
        return merged_adapters(params, lora, cls.FUSED, inputs)

    REMAT = tuple(REMAT_POLICIES)  # the `remat` policies it takes

    def remat_policy(self):
        """The blocks' checkpoint policy, by `remat` (a family may add its own: models.deepseek3)."""
        return REMAT_POLICIES[self.remat]

    @staticmethod
    def head_params(cfg: LlamaConfig) -> tuple[str, ...]:
        """The top-level parameters that `logits` reads (a tied model's head is its table)."""
        return ("final_norm", "embedding" if cfg.tie_embeddings else "head")

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, remat: str = "none",
                 routing: Routing = Routing(), lora: LoRA | None = None, rngs: nnx.Rngs):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        # A tied table is also the output head, so it starts at the head's scale.
        self.embedding = normal_param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"),
                                cfg.embed**-0.5 if cfg.tie_embeddings else 1.0)

        # Stacked along a leading "layers" axis: blocks, or groups of blocks in an MoE model;
        # an MoE model's dense layers at other positions (`dense_positions`) in a stack of their own.
        block = self.BLOCK
        make = (lambda r: MoEGroup(cfg, dtype, r, routing, lora, block)) if cfg.moe else (
            lambda r: block(cfg, dtype, r, lora=lora))
        self.blocks = with_empty_steps(stack_of(make, rngs, cfg.layer_steps, "layers"), cfg)
        if cfg.dense_positions:
            self.prefix = stack_of(lambda r: block(cfg, dtype, r, lora=lora), rngs, len(cfg.dense_positions),
                                   PREFIX_LAYERS)
        self.final_norm = self.BLOCK.NORM(cfg.embed, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = normal_param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.embed**-0.5)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, packing: Packing | None = None
                 ) -> jax.Array:
        """`positions` (seq,): where each column sits in the sequence (default: in order;
        a trainer may reorder the columns, e.g. to balance causal attention); `packing`:
        the examples of packed rows, in the same column order (models.attention.Packing)."""
        return self.forward(tokens, positions, packing)[0]

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None, packing: Packing | None = None
                ) -> tuple[jax.Array, dict]:
        """Logits, and the MoE layers' statistics stacked along a leading layer axis
        (`models.moe`; empty for a dense model)."""
        x, stats = self.hidden(tokens, positions, packing)
        return self.logits(x), stats

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, packing: Packing | None = None
               ) -> tuple[jax.Array, dict]:
        """`forward`'s last layer's output (batch, seq, embed), before the final norm."""
        if positions is None:
            positions = np.arange(tokens.shape[1])  # a constant: kernels can see the order
        x = self.embed(tokens, positions, packing)
        runs, stats = self.cfg.layer_runs(), []
        for stack, first, count in runs[1:] if runs[0][0] == "prefix" else runs:  # (embed ran a leading prefix)
            x, run_stats = self.run_stack(stack, first, count, x, positions, packing)
            stats += [run_stats] if stack == "blocks" else []
        return x, joined(stats)

    def run_stack(self, stack: str, first: int, count: int, x: jax.Array, positions: jax.Array,
                  packing: Packing | None = None) -> tuple[jax.Array, dict]:
        """Run steps first to first + count of a stack (`LlamaConfig.layer_runs`)."""
        if stack == "prefix":  # (their adapters' dropout draws come after the stacked blocks')
            layers = jnp.arange(first, first + count) + self.cfg.stacked_layers if dropping() else None
            return self.run_layers(steps_of(self.prefix, first, count), x, positions, packing, layers=layers,
                                   axis=PREFIX_LAYERS)
        kinds = self.layer_kinds(self.cfg)
        return self.run_layers(steps_of(self.filled_blocks(), first, count), x, positions, packing,
                               None if kinds is None else kinds[first:first + count],
                               jnp.arange(first, first + count) if first else None)

    def filled_blocks(self) -> Block | MoEGroup:
        """The stacked blocks less their empty steps (`LlamaConfig.empty_layers`), which
        only pipeline stages of equal depth need."""
        if not self.cfg.empty_layers:
            return self.blocks
        return each_stacked(self.blocks, lambda a: a[:self.cfg.layer_steps])

    # The three parts of `forward`, for a trainer that runs the layers elsewhere (e.g. in
    # pipeline stages): the embedding, any slice of the stacked layers, the output head.

    def embed(self, tokens: jax.Array, positions: jax.Array | None = None, packing: Packing | None = None
              ) -> jax.Array:
        """What the stacked layers receive: the embedding, then the dense layers before the
        first stacked one, if any (`LlamaConfig.layer_runs`; pipeline stages take the stacked
        blocks after it). `positions` and `packing` as `forward`'s."""
        x = self.lookup(tokens)
        stack, first, count = self.cfg.layer_runs()[0]
        if stack != "prefix":
            return x
        positions = np.arange(tokens.shape[1]) if positions is None else positions
        return self.run_stack(stack, first, count, x, positions, packing)[0]

    def lookup(self, tokens: jax.Array) -> jax.Array:
        """The tokens' embeddings."""
        x = looked_up(self.embedding, tokens, self.dtype, math.sqrt(self.cfg.embed) if self.EMBED_SCALE else None)
        if self.cfg.pad_token is not None:  # transformers' padding_idx: no gradient to that row from here
            x = jnp.where((tokens == self.cfg.pad_token)[..., None], jax.lax.stop_gradient(x), x)
        return constrain(x, "batch", "residual_seq", "embed")

    def run_layers(self, blocks: Block | MoEGroup, x: jax.Array, positions: jax.Array,
                   packing: Packing | None = None, local: jax.Array | None = None,
                   layers: jax.Array | None = None, axis: str = "layers", filled: jax.Array | None = None
                   ) -> tuple[jax.Array, dict]:
        """Run stacked `blocks` (this model's, or a slice of them along the layer axis) in
        order; `local`: which of them are sliding layers (`layer_kinds`), where layers differ;
        `layers`: their indices in the model (default: from 0), which adapters' dropout reads;
        `axis`: the logical name of the stack's leading axis; `filled`: which of them are
        not empty (`LlamaConfig.filled_steps`), where a pipeline stage holds empty ones:
        those pass their input on and their statistics are zeros."""
        def run_block(block: Block | MoEGroup, x: jax.Array, local, filled) -> tuple[jax.Array, dict]:
            y, stats = block(x, positions, packing) if local is None else block(x, positions, packing, local)
            if filled is None:
                return y, stats
            return jnp.where(filled, y, x), jax.tree.map(lambda s: jnp.where(filled, s, jnp.zeros_like(s)), stats)

        run_block = nnx.remat(run_block, policy=self.remat_policy())

        @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: axis})
        def over_layers(x: jax.Array, block: Block | MoEGroup, local, index, filled) -> tuple[jax.Array, dict]:
            with lora_layer(0 if index is None else index):
                return run_block(block, x, local, filled)

        if layers is None and dropping():  # (only then: a run without dropout scans nothing more)
            layers = jnp.arange(jax.tree.leaves(nnx.state(blocks))[0].shape[0])
        return over_layers(x, blocks, local, layers, filled)

    @staticmethod
    def layer_kinds(cfg: LlamaConfig) -> np.ndarray | None:
        """Per step of the stacked layers, whether it is a sliding-window layer, where the
        layers are not all alike (None where they are). A trainer that runs slices of the
        layers elsewhere (pipeline stages) passes the slices' kinds to `run_layers`."""
        return cfg.local_layers

    # Decoding with a key/value cache: a prompt's tokens at once (prefill), then one token
    # at a time, each attending to the cache instead of recomputing the past.

    @staticmethod
    def cache_layout(cfg: LlamaConfig, batch: int, length: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
        """The cache's arrays, each as (shape, logical names): keys and values, one per block,
        stacked as the blocks are (scan steps, blocks per step), then (batch, kv_heads,
        length, head_dim): the layout attention reads, so that no token copies it.
        Grouped-query attention keeps it at kv_heads."""
        per_step = cfg.moe.every if cfg.moe else 1
        shape = (cfg.layers // per_step, per_step, batch, cfg.kv_heads, length, cfg.head_dim)
        names = ("layers", None, "batch", "kv_heads", None, "head_dim")
        return {"k": (shape, names), "v": (shape, names)}

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict, at: Decoding) -> tuple[jax.Array, dict]:
        """Logits of `tokens` (batch, seq) at `positions` (batch, seq), which the cache
        (`cache_layout`) takes at slots `at`; -> (logits, the new cache)."""

        # The cache is carried through the layers whole and written in place (a slice of it
        # per layer would be copied out and back at every token).
        cfg, kinds = self.cfg, self.layer_kinds(self.cfg)
        x = self.lookup(tokens)
        for stack, first, count in cfg.layer_runs():
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry,
                      transform_metadata={nnx.PARTITION_NAME: PREFIX_LAYERS if stack == "prefix" else "layers"})
            def over_layers(carry: tuple[jax.Array, dict], unit: Block | MoEGroup, i: jax.Array):
                x, cache = carry
                local = None if kinds is None else jnp.asarray(kinds)[i]
                for j, block in enumerate(unit.blocks if isinstance(unit, MoEGroup) else [unit]):
                    x, cache = block.decode(x, positions, cache, (i, j), at, local)
                return x, cache

            units = steps_of(self.prefix if stack == "prefix" else self.filled_blocks(), first, count)
            cache_steps = np.array(cfg.stack_layers(stack)[first:first + count]) // cfg.layers_per_step
            x, cache = over_layers((x, cache), units, jnp.asarray(cache_steps))
        return self.logits(x), cache

    def logits(self, x: jax.Array, norm: RMSNorm | None = None) -> jax.Array:
        """float32 logits (batch, seq, vocab) of the last layer's output, through the final
        norm (or `norm`: a module that shares the head, models.deepseek3's multi-token prediction)."""
        cfg, dt = self.cfg, self.dtype
        x = constrain((norm or self.final_norm)(x), "batch", "seq", "embed")
        if cfg.tie_embeddings:
            head = weight(self.embedding, dt).T
        else:
            head = weight(self.head, dt)
        logits = jnp.einsum("bse,ev->bsv", x, head).astype(jnp.float32)
        return constrain(logits, "batch", "seq", "vocab")
