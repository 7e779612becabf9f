"""What each device should hold during a step, in bytes: the state (parameters and Adam's
two moments, as the rules table splits them), the reduced gradient, the weights gathered
for use, and the activations kept for the backward pass (by remat policy, attention kernel
and pipeline schedule). spmd.plan sets these beside XLA's memory analysis; the
collectives' theory is spmd.planner.theory's, from the same walk over the parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import flash, model_class
from spmd.parallel import pipeline
from spmd.parallel.experts import ragged_exchange
from spmd.parallel.layout import Layout
from spmd.parallel.rules import axes_of
from spmd.parallel.skeleton import DTYPES
from spmd.planner.activations import tied_rows_bytes
from spmd.planner.counting import (Param, compute_table, expert_rows, head_in_stages, in_head, live, params, spec_axes,
                                   tokens_per_device, uses, ways)


def memory(cfg, layout: Layout) -> dict[str, float]:
    """Bytes per device: the state (parameters, Adam's two moments) and the step's working
    set (the reduced gradient, gathered weights, saved activations and logits)."""
    shape, rules = layout.shape, layout.rules
    compute_bytes = jnp.dtype(DTYPES[cfg.model.dtype]).itemsize
    used_table = compute_table(layout)

    def held(p: Param, axes, bytes_each=None) -> float:
        return p.numel * (bytes_each or p.itemsize) / ways(axes, shape)

    def total(table, trained_only: bool = False) -> float:
        return sum(held(p, spec_axes(p.names, table)) for p in params(layout, cfg) if p.trained or not trained_only)

    model = layout.skeleton.model_cfg
    gathered = gathered_head = gradients = 0.0
    for p in params(layout, cfg):
        compute = spec_axes(p.names, used_table)
        if live(set(spec_axes(p.names, rules.params)) - set(compute), shape):
            # Stacked weights are gathered a layer at a time (two alive: this one and the
            # next, of the device's layers); a prefix's too. Of the rest, the output head
            # (a tied table in the compute dtype) is what the loss holds gathered.
            if p.stacked or p.prefix:
                used = held(p, compute, sum(uses(p, model, compute_bytes)))
                gathered += used * (2 * shape["pp"] / model.stacked_layers if p.stacked else min(1, 2 / p.prefix))
            elif in_head(layout, p) or (model.tie_embeddings and p.path == model_class(model).LOOKUP_TABLE):
                gathered_head += held(p, compute, compute_bytes)
        # With accumulation each device sums its own microbatches' gradients (laid out as
        # computed, float32) and reduces once; so does each batch shard of pipeline stages
        # over the ticks (`_summed_in_stages`); otherwise the reduced gradient is what is
        # held. A LoRA run's frozen weights have none.
        if not p.trained:
            continue
        if cfg.training.grad_accum > 1:
            gradients += held(p, compute, 4)
        elif layout.schedule and (p.stacked or head_in_stages(layout) and in_head(layout, p)):
            gradients += _summed_in_stages(layout, p, held)
        else:
            gradients += held(p, spec_axes(p.names, rules.grads))
    if compiler(layout) == "tpu":
        # XLA:TPU makes the head's gradient whole, in the compute dtype, while the logits
        # and the gathered head live, and reduce-scatters it after: two head-sized buffers
        # at the loss (its buffer assignment on TPU v5p), where XLA:GPU holds one.
        gathered_head *= 2
    # zb-v and DualPipe run a second chunk on each device, received from the mirror device
    # each step (zb-v's half a stage, DualPipe's whole one: its parameters twice), with a
    # gradient of its own summed over the ticks, both as stored (spmd.parallel.pipeline.zero_bubble).
    share = layout.schedule.mirrored_share if layout.schedule else 0.0
    for p in params(layout, cfg):
        if share and p.stacked:
            stored = held(p, spec_axes(p.names, rules.params))
            gathered += share * stored
            gradients += share * stored if p.trained else 0
    # Expert copies tie the 2R rows of a layer's expert gradients a row at a time: one
    # picked and reduced, both alive (spmd.parallel.balance.tie).
    gradients += tied_rows_bytes(cfg, layout, rows_of_one_copy=True) * shape["pp"] / model.stacked_layers
    # The MoE layers' router state (spmd.parallel.balance), replicated: a few numbers per expert.
    router = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(layout.skeleton.router_shapes))
    return {
        "params": total(rules.params) + router,
        "opt_state": 2 * total(rules.opt_state, trained_only=True),  # Adam's mu and nu, float32 like the parameters
        "gradients": gradients,
        "gathered_weights": gathered,
        "gathered_head": gathered_head,
        **activation_bytes(cfg, layout, compute_bytes),
    }


def peak(cfg, layout: Layout, memory: dict[str, float]) -> float:
    """The step's peak per device from `memory`'s parts, by what lives when. Without
    pipeline stages the step has two high points, and the peak is the higher: the loss
    (the kept activations, the logits and multi-token prediction's, the gathered head) and
    the layers' backward pass (the kept activations, the gradients being written, one
    layer's working set, its gathered weights and as much again of their gradients before
    they are reduced); an accumulated gradient lives through both. Pipeline stages run
    forwards and backwards in the same ticks: every part at once, but for a layer's
    working set and the loss's (the logits, multi-token prediction's, the head), which a
    tick holds one after the other (the head runs between the last chunk's forward and
    its backward). XLA:GPU's pool for the ragged exchange is an allocation of its own: it
    adds to either."""
    if layout.schedule is not None:
        apart = {"working": memory["working"], "loss": memory["logits"] + memory["predictions"] + memory["gathered_head"]}
        return sum(memory.values()) - sum(apart.values()) + max(apart.values())
    state = memory["params"] + memory["opt_state"]
    kept, gradients = memory["activations"], memory["gradients"]
    loss = (kept + memory["logits"] + memory["predictions"] + memory["gathered_head"]
            + (gradients if cfg.training.grad_accum > 1 else 0))
    layers = kept + gradients + memory["working"] + 2 * memory["gathered_weights"]
    return state + memory["exchange_pool"] + max(loss, layers)


def activation_bytes(cfg, layout: Layout, compute_bytes: int) -> dict[str, float]:
    """What the step computes and keeps, in four parts: `activations`, kept for the
    backward pass by remat policy (models.llama) and, in pipeline stages, the queue of
    microbatches entering them; `working`, one layer's recomputed activations and its
    attention blocks' scores; `logits`, the float32 logits, which their gradient
    overwrites; `predictions`, multi-token prediction's (its blocks' and logits)."""
    m, t = layout.skeleton.model_cfg, layout.shape["tp"]
    # Keys and values per kv slot: a kv head, or each copy of one where tp shares it.
    e, qkv, heads = m.embed, (m.heads + 2 * m.kv_heads * layout.kv_copies) * m.head_dim, m.heads * m.head_dim
    tokens = tokens_per_device(cfg, layout.shape, microbatch=True)
    # Per token and layer, in elements: "none" keeps matmul outputs and annotated
    # activations (block input, both residual sums, the attention and MLP outputs, the
    # qkv projection and rotated q/k/v, per-head attention output, the scores, the MLP's
    # gate/up and hidden); "dots" keeps matmuls without batch dimensions; "full" only the
    # block input, and recomputes one layer at a time during the backward pass.
    # Scores: each query token's whole row, kept like an activation, by the xla kernel
    # only. The chunked and fused kernels (models.flash, spmd.parallel.kernels), and ring attention
    # across sp, recompute them in the backward pass a block pair at a time: float32
    # scores, weights and their gradient for one block of queries and keys, one layer.
    sp = layout.shape["sp"]
    kept_scores = cfg.model.attention_kernel == "xla" and not (sp > 1 and cfg.parallelism.attention == "ring")
    # Under a window the xla kernel keeps a band of two windows per query, where the
    # sequence is in order (one sp rank: sp's zig-zag is not).
    row = 2 * m.window if m.window and m.window < cfg.training.seq and sp == 1 else cfg.training.seq
    attention = 4 * e + (2 * qkv + 2 * heads + (m.heads * row if kept_scores else 0)) / t
    length = cfg.training.seq // (2 * sp) if sp > 1 and cfg.parallelism.attention == "ring" else cfg.training.seq
    block = min(flash.default_block(length), length)
    block_scores = 0 if kept_scores else 3 * 4 * m.heads / t * block * block * tokens / cfg.training.seq
    everything = attention + 3 * m.mlp / t
    # "mla" (DeepSeek-V3's): as "none", but the up-projections and the per-head queries,
    # keys and values they make are kept as their latents, and made again a layer at a time.
    up = 2 * qkv / t - ((getattr(m, "q_rank", 0) or 0) + getattr(m, "latent_dim", 0))
    per_layer = {"none": everything, "dots": 3 * e + (qkv + 2 * m.mlp) / t, "full": e,
                 "mla": everything - up}[cfg.model.remat]
    working = {"none": 0, "mla": 2 * qkv / t}.get(cfg.model.remat, everything)
    dense_layers = m.stacked_layers + m.prefix_layers - m.moe_layers_run  # (empty ones too: stages run them)
    kept = dense_layers * per_layer
    if m.moe_layers:
        # An MoE layer keeps, per row its experts run (spmd.parallel.experts), the row as received
        # and as returned and the two matmul outputs; per token the router's scores and
        # the shared expert like an MLP.
        rows = expert_rows(cfg, layout) / tokens
        moe = (attention + m.moe.experts + rows * (3 * e + 2 * m.moe.expert_mlp / t)
               + 3 * m.moe.shared_experts * m.moe.expert_mlp / t)
        moe_kept = {"none": moe, "dots": 3 * e + qkv / t + rows * 2 * m.moe.expert_mlp / t, "full": e,
                    "mla": moe - up}[cfg.model.remat]
        kept += m.moe_layers_run * moe_kept
        working = max(working, {"none": 0, "mla": 2 * qkv / t}.get(cfg.model.remat, moe))
    logits = _logits_bytes(layout, compute_bytes)
    predictions = _prediction_bytes(cfg, m, moe_kept, moe, logits, compute_bytes) if getattr(m, "mtp_depth", 0) else 0
    pool = _ragged_pool(cfg, layout, tokens)
    schedule = layout.schedule
    if schedule is None:
        return {"activations": tokens * kept * compute_bytes, "working": tokens * working * compute_bytes + block_scores,
                "logits": tokens * logits, "predictions": tokens * predictions,
                "exchange_pool": tokens * pool * compute_bytes}
    # A device keeps its 1/p of the layers for every tick (gpipe, circular), or for the
    # residual ring's (2vp - 1)/v microbatches (1f1b, interleaved-1f1b: Schedule.
    # kept_microbatches), on microbatches of p/m of its `tokens`; one tick's (a 1/v chunk
    # of its layers) are built apart before they are filed. The queue holds all its rows;
    # schedules that write their backward pass hold their gradient beside them, and run
    # the head a microbatch at a time. zb-v's and DualPipe's queue is the rank's own
    # rows and their gradients (m/p microbatches each), with a microbatch of each in flight
    # per end where rows enter and one entering and leaving (spmd.parallel.pipeline.kit.Conveyor).
    p, v = schedule.stages, schedule.repeats
    mb = tokens * p / schedule.microbatches
    kept_tokens = mb * schedule.kept_microbatches / p
    queues, head_tokens = (2, mb) if schedule.writes_backward else (1, tokens)
    queued = queues * tokens * p
    if schedule.name in pipeline.SPLIT_BACKWARD:
        queued = 2 * tokens + (2 * (2 if schedule.name == "dualpipe" else 1) + 2) * mb
    return {"activations": (kept_tokens * kept + mb * kept / (p * v) + queued * e) * compute_bytes,
            "working": mb * working * compute_bytes, "logits": head_tokens * logits,
            "predictions": head_tokens * predictions, "exchange_pool": mb * pool * compute_bytes}


def _logits_bytes(layout: Layout, compute_bytes: int) -> float:
    """Per token, the logits' bytes: float32, which the loss's backward pass reads and
    overwrites with their gradient (one buffer, as XLA:GPU assigns them for the presets).
    XLA:TPU holds them in the compute dtype (the cast fused into the loss's reductions)
    and makes their gradient inside the head's two gradient matmuls; in pipeline stages,
    where the loss runs in the loop's body, it writes that gradient in a buffer of its own."""
    vocab = layout.skeleton.model_cfg.vocab / ways(axes_of(layout.rules.activations["vocab"]), layout.shape)
    if compiler(layout) == "tpu":
        return vocab * compute_bytes * (2 if layout.schedule else 1)
    return vocab * 4


def _ragged_pool(cfg, layout: Layout, tokens: int) -> float:
    """Per token, the elements of XLA:GPU's pool for the ragged exchange's results
    (spmd.parallel.experts): symmetric memory, allocated apart and sized by its own peak,
    three of each of an MoE layer's two results (the rows received, padded to the worst
    case, and the rows returned): the zero-filled buffer and the two the double-buffered
    layer loop has in flight (Qwen3-30B-A3B's and Qwen3-235B-A22B's presets: 3.4 and 6.8
    GiB, as XLA:GPU's buffer assignment has them)."""
    m = layout.skeleton.model_cfg
    if not (m.moe_layers and cfg.moe.moe_dispatch == "dropless" and ragged_exchange(layout.mesh)
            and compiler(layout) in ("gpu", "cuda")):
        return 0
    return 3 * (expert_rows(cfg, layout) / tokens + m.moe.top_k) * m.embed


def _prediction_bytes(cfg, m, moe_kept: float, moe: float, logits: float, compute_bytes: int) -> float:
    """Per token where the head runs, multi-token prediction's (models.deepseek3's modules):
    per depth an MoE block kept as the model's are (`moe_kept`) and float32 logits of its
    own; under remat one block's working set (`moe`) at a time. Held while the head runs:
    the modules' backward pass ends before the layers' begins."""
    recomputed = moe if cfg.model.remat in ("dots", "full") else 0
    return m.mtp_depth * (moe_kept * compute_bytes + logits) + recomputed * compute_bytes


def compiler(layout: Layout) -> str:
    """The platform whose XLA compiles the step ("cpu", "tpu", "gpu" or "cuda"): where the
    compilers hold the same values in different buffers, the theory follows each."""
    return layout.mesh.devices.flat[0].platform


def _summed_in_stages(layout: Layout, p: Param, held) -> float:
    """Bytes of a gradient the stages' map sums over its ticks: the head's (in the stages)
    float32, as stored, split as the weight is, ZeRO's axes slicing it as the map ends. A
    stacked weight's (summed over the manual batch axes as the map ends, split as the
    weights are: ZeRO's other axes slice it after that sum, spmd.planner.theory._gradients)
    and beside the sum: under autodiff (gpipe, circular) a copy of it; under a written-out
    backward pass the tick's chunk gradient being added (1/v of it), and the sum as the map
    ends (XLA:GPU's buffers of llama3-70b-128xh100-3d under each schedule: within 4%)."""
    shape, rules, schedule = layout.shape, layout.rules, layout.schedule
    kept, manual = in_map_split(layout, p), pipeline.manual_axes(shape)
    if not p.stacked:
        return held(p, [a for a in spec_axes(p.names, rules.params) if a not in manual or a in kept], 4)
    batch = pipeline.batch_axes(manual)
    summed = any(shape[a] > 1 for a in batch if a not in kept)
    split = spec_axes(p.names, rules.params if summed else rules.grads)
    copies = 1 + 1 / schedule.repeats + summed if schedule.writes_backward else 2
    return copies * held(p, [a for a in split if a not in batch or a in kept])


def in_map_split(layout: Layout, p: Param) -> set[str]:
    """The manual axes a weight enters the pipeline's map split over (pp for the stacked
    layers, ep for experts: `spmd.parallel.pipeline.manual_spec`); over the other batch
    axes it is whole there, and its gradient summed over them as the map ends."""
    return {a for a in pipeline.manual_spec(p.names, p.stacked, pipeline.manual_axes(layout.shape)) if a}
