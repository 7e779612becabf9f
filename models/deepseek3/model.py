"""DeepSeek-V3: multi-head latent attention (MLA), a dense prefix, then MoE layers with
group-limited sigmoid routing (models.moe), written for one device as Llama is.

MLA compresses a token's keys and values into a latent of kv_rank (normed) plus one
rotary key shared by every head; each head's keys and values are up-projected from it
(`wkv_b`). Queries come through a rank of their own (`wq_a`, norm, `wq_b`) or directly.
Each head's query and key are a part that does not rotate and a rotary part, whose
weights are stored in rotate-half order (models.deepseek3.hf permutes DeepSeek's
interleaved pairs on the way in and out, which leaves every score unchanged).

Training runs the decompressed form through the attention kernels every family uses
(and the sequence-parallel ones that replace them): keys of head_dim, values padded with
zeros from v_dim to head_dim (the kernels take one size), the padding cut from the
output. Decoding caches the latent and the rotary key only, kv_rank + rope_dim numbers
per token and layer, and attends in the order that costs less (`LatentAttention.decode`).

The dense prefix is a stack of its own (Llama's `prefix`), run after the embedding
(`Llama.embed`): pipeline stages take the MoE stack, and the prefix runs with the embedding,
on rows split over every data axis and pp, as the embedding does (see docs/moe.md)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.annotate import ACTIVATION, PREFIX_LAYERS, UP_PROJECTED, constrain, weight
from models.attention import Packing, attend, cached_attention
from models.deepseek3.config import DeepSeekV3Config
from models.fp8 import linear
from models.llama.layers import Decoding, RMSNorm, normal_param, rotary
from models.llama.model import REMAT_POLICIES, Block, Llama
from models.llama.stack import stack_of, with_empty_steps
from models.lora import LoRA
from models.moe import Routing


class LatentAttention(nnx.Module):
    """Llama's Attention's interface (the block calls it alike); `lora` and `local` are
    never given here (the model refuses adapters; every layer is global)."""

    def __init__(self, cfg: DeepSeekV3Config, dtype, rngs: nnx.Rngs, lora: LoRA | None = None):
        e, h, d, r = cfg.embed, cfg.heads, cfg.head_dim, cfg.kv_rank
        # The ranks are split as the hidden size is (fsdp, ZeRO): each is an up-projection's input.
        if cfg.q_rank is None:
            self.wq = normal_param(rngs, (e, h, d), ("embed", "heads", "head_dim"), e**-0.5)
        else:
            self.wq_a = normal_param(rngs, (e, cfg.q_rank), ("embed", None), e**-0.5)
            self.q_norm = RMSNorm(cfg.q_rank, cfg.norm_eps, (None,))
            self.wq_b = normal_param(rngs, (cfg.q_rank, h, d), ("embed", "heads", "head_dim"), cfg.q_rank**-0.5)
        # The latent and the rotary key, [:, :kv_rank] and [:, kv_rank:]: every head reads them whole.
        self.wkv_a = normal_param(rngs, (e, cfg.latent_dim), ("embed", None), e**-0.5)
        self.kv_norm = RMSNorm(r, cfg.norm_eps, (None,))
        # Each head's key (its part that does not rotate) and value, [..., :nope_dim] and [..., nope_dim:].
        self.wkv_b = normal_param(rngs, (r, h, cfg.nope_dim + cfg.v_dim), ("embed", "heads", "head_dim"), r**-0.5)
        self.wo = normal_param(rngs, (h, cfg.v_dim, e), ("heads", "head_dim", "embed"), (h * cfg.v_dim) ** -0.5)
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x: jax.Array, positions: jax.Array, packing: Packing | None = None,
                 local: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        q, latent, rotary_key = self._project(x, positions if packing is None else packing.positions)
        k, v = self._keys_values(latent, rotary_key)
        segments = None if packing is None else packing.segments
        out = attend(q[:, :, :, None], k, v, positions, segments, None)[:, :, :, 0]
        return self._output(out[..., :cfg.v_dim])

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (batch, seq, heads, head_dim), rotated and scaled for the kernels' head_dim
        ** -0.5; the normed latent (batch, seq, kv_rank) and the rotated key (batch, seq, rope_dim)."""
        cfg, dt = self.cfg, self.dtype
        if cfg.q_rank is None:
            q = linear("bse,ehd->bshd", x, weight(self.wq, dt))
        else:
            q = self.q_norm(linear("bse,er->bsr", x, weight(self.wq_a, dt)))
            q = linear("bsr,rhd->bshd", q, weight(self.wq_b, dt))
        compressed = linear("bse,ec->bsc", x, weight(self.wkv_a, dt))
        latent = self.kv_norm(compressed[..., :cfg.kv_rank])
        freqs, yarn = cfg.rope_frequencies, cfg.yarn
        q_rotary = rotary(q[..., cfg.nope_dim:], positions, freqs)
        rotary_key = rotary(compressed[:, :, None, cfg.kv_rank:], positions, freqs)[:, :, 0]
        if yarn and yarn.rotation_scale != 1.0:  # transformers scales cos and sin
            q_rotary, rotary_key = (a * np.float32(yarn.rotation_scale).astype(a.dtype) for a in (q_rotary, rotary_key))
        q = jnp.concatenate([q[..., :cfg.nope_dim], q_rotary], axis=-1)
        if yarn and yarn.softmax_scale != 1.0:
            q = q * np.float32(yarn.softmax_scale).astype(q.dtype)
        return constrain(q, "batch", "seq", "heads", "head_dim", saved_as=UP_PROJECTED), latent, rotary_key

    def _keys_values(self, latent: jax.Array, rotary_key: jax.Array, heads_first: bool = False):
        """Each head's keys (batch, seq, heads, head_dim) and values, zero-padded to head_dim
        (`heads_first`: (batch, heads, seq, head_dim), as the cache is read)."""
        cfg = self.cfg
        layout = "bshd" if not heads_first else "bhsd"
        kv = linear(f"bsr,rhd->{layout}", latent, weight(self.wkv_b, self.dtype))
        rotary_key = rotary_key[:, None] if heads_first else rotary_key[:, :, None]
        k = jnp.concatenate([kv[..., :cfg.nope_dim], jnp.broadcast_to(rotary_key, (*kv.shape[:3], cfg.rope_dim))], -1)
        v = jnp.pad(kv[..., cfg.nope_dim:], [(0, 0)] * 3 + [(0, cfg.head_dim - cfg.v_dim)])
        if heads_first:
            return k, v
        names = ("batch", "seq", "kv_heads", "head_dim")
        return constrain(k, *names, saved_as=UP_PROJECTED), constrain(v, *names, saved_as=UP_PROJECTED)

    def _output(self, out: jax.Array) -> jax.Array:
        out = constrain(out, "batch", "seq", "heads", "head_dim")
        return linear("bshd,hde->bse", out, weight(self.wo, self.dtype))

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict, block: tuple[jax.Array, int], at: Decoding,
               local: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """New tokens against the latent cache ({"latent": (layers, 1, batch, length,
        kv_rank + rope_dim)}), which takes theirs at `at`.

        Absorbed order (few new tokens): the keys' up-projection moves into the query
        (q_nope wkv_b -> kv_rank numbers per head) and the values' into the output, so a
        step reads the latent once for every head, and nothing per head is rebuilt. The
        decompressed order (a long prompt) up-projects each chunk of the cache it reads;
        it costs less once the new tokens outnumber kv_rank (nope_dim + v_dim) / (2 kv_rank
        + rope_dim - head_dim - v_dim) (170 for DeepSeek-V3's shapes)."""
        cfg = self.cfg
        q, latent, rotary_key = self._project(x, positions)
        b, s, h, _ = q.shape
        entry = jnp.concatenate([latent, rotary_key], axis=-1)[None, None].astype(cache["latent"].dtype)
        cache = {**cache, "latent": jax.lax.dynamic_update_slice(cache["latent"], entry, (*block, 0, at.slot, 0))}
        length = cache["latent"].shape[-2]

        def read_latent(start, size):
            shape = (1, 1, b, size, cfg.latent_dim)
            piece = jax.lax.dynamic_slice(cache["latent"], (*block, 0, start, 0), shape)[0, 0].astype(q.dtype)
            return constrain(piece, "batch", None, None)

        wkv_b = weight(self.wkv_b, self.dtype)
        if s * (2 * cfg.kv_rank + cfg.rope_dim - cfg.head_dim - cfg.v_dim) <= cfg.kv_rank * (cfg.nope_dim + cfg.v_dim):
            # One "key/value head", the latent; every query head in its group. The kernel
            # divides by sqrt(latent_dim), where the model's scale is sqrt(head_dim).
            q_latent = jnp.einsum("bshd,rhd->bshr", q[..., :cfg.nope_dim], wkv_b[..., :cfg.nope_dim])
            q = jnp.concatenate([q_latent, q[..., cfg.nope_dim:]], axis=-1)
            q = q * np.float32(math.sqrt(cfg.latent_dim / cfg.head_dim)).astype(q.dtype)

            def read(start, size):
                piece = read_latent(start, size)[:, None]
                return piece, piece  # the values are the latent; the rotary part of the output is dropped

            out = cached_attention(q[:, :, None], read, length, at.slots(s), at.valid)[:, :, 0]
            out = jnp.einsum("bshr,rhd->bshd", out[..., :cfg.kv_rank], wkv_b[..., cfg.nope_dim:])
        else:
            def read(start, size):
                piece = read_latent(start, size)
                return self._keys_values(piece[..., :cfg.kv_rank], piece[..., cfg.kv_rank:], heads_first=True)

            out = cached_attention(q[:, :, :, None], read, length, at.slots(s), at.valid)[:, :, :, 0, :cfg.v_dim]
        return self._output(out), cache


RECOMPUTE_UP = "mla"  # --remat mla: DeepSeek-V3's recomputation (`recompute_up_projections`)


def recompute_up_projections(cfg: DeepSeekV3Config):
    """DeepSeek-V3's own checkpoint policy (the report, section 3.2.3): what remat "none"
    keeps, but for MLA's up-projections, which the backward pass computes again from
    their latents (q_rank and kv_rank numbers a token, where the per-head queries, keys
    and values they make are heads x head_dim each), and the RMSNorms, which "none"
    recomputes already. An up-projection is a matmul of a latent with a (rank, heads,
    per head) weight: the policy keeps every other matmul's output."""
    ranks = {cfg.kv_rank, cfg.q_rank} - {None}
    named = jax.checkpoint_policies.save_only_these_names(ACTIVATION)  # not UP_PROJECTED

    def policy(prim, *avals, **params) -> bool:
        if prim is jax.lax.dot_general_p:
            (_, contracted), _ = params["dimension_numbers"]
            w = avals[1]
            return not (w.ndim == 3 and tuple(contracted) == (0,) and w.shape[0] in ranks and w.shape[1] == cfg.heads)
        return named(prim, *avals, **params)

    return policy


class LatentBlock(Block):
    ATTENTION = LatentAttention


class PredictionModule(nnx.Module):
    """One depth k of multi-token prediction (the DeepSeek-V3 report, section 2.2). At
    column i it reads the previous depth's hidden state there (depth 1: the model's last
    layer's output, before the final norm) and the embedding of the input k columns on,
    each through an RMSNorm; a projection joins them (DeepSeek's `eh_proj`, whose first
    half reads the embedding, as its released code concatenates them: here its two halves,
    each a matrix of its own, so that each half's gradient is reduce-scattered as it is
    stored, where XLA all-reduces a stacked pair), one block runs on the result, and
    the model's head, through this module's own norm, predicts the token k + 1 after
    column i's target. The block is the model's MoE block; its router keeps no state (no
    selection bias learned, no expert copies) and adds no balance loss: the prediction
    loss alone trains it."""

    def __init__(self, cfg: DeepSeekV3Config, dtype, rngs: nnx.Rngs, routing: Routing):
        e = cfg.embed
        self.embedding_norm = RMSNorm(e, cfg.norm_eps)
        self.hidden_norm = RMSNorm(e, cfg.norm_eps)
        self.join_embedded = normal_param(rngs, (e, e), ("embed", None), (2 * e) ** -0.5)
        self.join_hidden = normal_param(rngs, (e, e), ("embed", None), (2 * e) ** -0.5)
        self.block = LatentBlock(cfg, dtype, rngs, dataclasses.replace(routing, balanced=False, slots=None))
        self.norm = RMSNorm(e, cfg.norm_eps)
        self.dtype = dtype

    def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array,
                 packing: Packing | None = None) -> jax.Array:
        x = (jnp.einsum("bse,ef->bsf", self.embedding_norm(embedded), weight(self.join_embedded, self.dtype))
             + jnp.einsum("bse,ef->bsf", self.hidden_norm(hidden), weight(self.join_hidden, self.dtype)))
        return self.block(constrain(x, "batch", "residual_seq", "embed"), positions, packing)[0]


class DeepSeekV3(Llama):
    """Tokens (batch, seq) -> float32 logits (batch, seq, vocab); see the module's doc."""

    REMAT = (*REMAT_POLICIES, RECOMPUTE_UP)
    # The latent up-projections read their latent through its norm, which is not named.
    RECOMPUTED_INPUT_WEIGHTS = ("attn.wq_b", "attn.wkv_b")

    def __init__(self, cfg: DeepSeekV3Config, *, dtype=jnp.float32, remat: str = "none",
                 routing: Routing = Routing(), lora: LoRA | None = None, rngs: nnx.Rngs):
        if remat not in self.REMAT:
            raise ValueError(f"remat must be one of {self.REMAT}, got {remat!r}")
        if lora is not None:
            raise ValueError("LoRA adapts Llama's projections (q_proj, ...); DeepSeek-V3's latent attention has none")
        self.cfg, self.dtype, self.remat = cfg, dtype, remat
        self.embedding = normal_param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), 1.0)

        if cfg.dense_layers:
            self.prefix = stack_of(lambda r: LatentBlock(cfg, dtype, r), rngs, cfg.dense_layers, PREFIX_LAYERS)
        self.blocks = with_empty_steps(stack_of(lambda r: LatentBlock(cfg, dtype, r, routing), rngs, cfg.moe_layers,
                                                "layers"), cfg)
        self.final_norm = RMSNorm(cfg.embed, cfg.norm_eps)
        self.head = normal_param(rngs, (cfg.embed, cfg.vocab), ("embed", "vocab"), cfg.embed**-0.5)
        if cfg.mtp_depth:
            self.mtp = nnx.List([PredictionModule(cfg, dtype, rngs, routing) for _ in range(cfg.mtp_depth)])

    def predictions(self, hidden: jax.Array, later_inputs: jax.Array, positions: jax.Array,
                    packing: Packing | None = None) -> list[jax.Array]:
        """Multi-token prediction: per depth k = 1..mtp_depth, float32 logits (batch, seq,
        vocab) of the token k + 1 after each column's target, from `hidden` (the model's
        last layer's output) and `later_inputs` (batch, seq, mtp_depth): for each column,
        the input k columns on in its row ([..., k - 1]; spmd.parallel.objective lays them
        out, in the columns' order). Columns whose k-th later input is past the row's end
        (or its example's) predict nothing that counts."""
        run = nnx.remat(lambda module, *args: module(*args), policy=self.remat_policy())
        logits = []
        for k, module in enumerate(self.mtp):
            hidden = run(module, hidden, self.lookup(later_inputs[..., k]), positions, packing)
            logits.append(self.logits(hidden, module.norm))
        return logits

    def remat_policy(self):
        return recompute_up_projections(self.cfg) if self.remat == RECOMPUTE_UP else super().remat_policy()

    @staticmethod
    def cache_layout(cfg: DeepSeekV3Config, batch: int, length: int) -> dict:
        """The latent cache: per layer (prefix first), each token's latent and rotary key."""
        return {"latent": ((cfg.layers, 1, batch, length, cfg.latent_dim), ("layers", None, "batch", None, None))}

    @staticmethod
    def head_params(cfg: DeepSeekV3Config) -> tuple[str, ...]:
        # Multi-token prediction runs where the head does, with the table it looks up.
        return ("final_norm", "head") + (("embedding", "mtp") if cfg.mtp_depth else ())
