"""The sharded train state and the compiled train step.

State is born sharded: the initializer is jitted with output shardings, so no device ever
holds the whole model. The step takes the state (donated) and one global batch of token
rows (batch, seq + 1), and returns the new state and a few scalar metrics.

Packed rows (fine-tuning data, `packed`) come as a dict of such arrays; what their loss
is: spmd.parallel.objective.

Gradient accumulation scans over microbatches. To reduce gradients once per step rather
than once per microbatch, each batch shard accumulates its own gradients inside the scan
(a vmap over shards, the mapped axis split over the batch axes, so no device talks to
another), and the shards are summed once after it: the `no_sync` of DDP, for free.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

from models.annotate import PREDICTIONS, computed_copies, storage
from models.attention import KERNELS, attention_implementation
from models.fp8 import active as fp8_recipe
from models.lora import dropout as lora_dropout
from models.lora import folded, joined
from models.moe import expert_implementation, slots_implementation
from spmd.parallel import balance
from spmd.parallel.context import make_attention, make_capacity_slots, zigzag_order
from spmd.parallel.experts import make_experts
from spmd.parallel.kernels import make_kernel
from spmd.parallel.kernels import resolve as resolve_kernel
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import BATCH_AXES
from spmd.parallel.objective import aux_losses, model_loss, prediction_depth, target_count, target_counts
from spmd.parallel.optim import applied_updates, make_optimizer, schedule
from spmd.parallel.options import StepOptions, step_options
from spmd.parallel.pipeline import manual_axes
from spmd.parallel.rules import EXPERT_AXIS, spec_for
from spmd.parallel.skeleton import DTYPES, build_model, is_names
from spmd.parallel.staged import Auxiliary, one_f_one_b_grads, pipelined_loss


def _split_locally(rows: jax.Array, shards: int, k: int) -> jax.Array:
    """Rows (b, width) split over `shards` -> (k, shards, b / (shards k), width): part i is
    each shard's own rows [i*r, (i+1)*r), so nothing moves between devices."""
    b, width = rows.shape
    return rows.reshape(shards, k, b // (shards * k), width).swapaxes(0, 1)


def _with_empty_layers(expert_load: jax.Array, model_cfg) -> jax.Array:
    """The MoE layers' loads (layers, experts), with an even load for each empty layer
    after them (LlamaConfig.empty_layers), which leaves its router state as it is: in
    place of the empty layers' zeros where pipeline stages give every stacked layer's
    (spmd.parallel.staged), added after the MoE layers' where the model gives those."""
    if not model_cfg.empty_layers:
        return expert_load
    even = jnp.asarray(1.0 / expert_load.shape[-1], expert_load.dtype)
    if len(expert_load) > model_cfg.layer_steps:
        return jnp.where(jnp.arange(len(expert_load))[:, None] < model_cfg.layer_steps, expert_load, even)
    return jnp.concatenate([expert_load, jnp.full((model_cfg.empty_steps, expert_load.shape[-1]), even)])


def _step_metrics(metrics: dict, ep: int, layers: int) -> dict:
    """Expert loads (layers, experts), each a share of all choices, become the load
    imbalance: max over mean tokens per expert, averaged over the `layers` MoE layers
    (empty ones, with no load, add nothing); and with ep > 1, the same over the ep
    devices, of what their slots took (experts split in order, or their copies as placed)."""
    metrics = dict(metrics)
    load, slot_load = metrics.pop("expert_load", None), metrics.pop("slot_load", None)
    if load is not None:
        metrics["imbalance"] = jnp.sum(jnp.max(load, axis=-1) * load.shape[-1]) / layers
        if ep > 1:
            metrics["device_imbalance"] = balance.device_imbalance(load if slot_load is None else slot_load, ep, layers)
    return metrics


def model_context(layout: Layout, attention: str = "ring", local_axes: tuple[str, ...] = (),
                  data_axes: tuple[str, ...] | None = None, kernel: str = "xla", fp8: str | None = None
                  ) -> contextlib.ExitStack:
    """What the model runs under on `layout`: the rules its annotations read
    (models.annotate), the attention `kernel` (spmd.parallel.kernels), and the parallel
    implementations swapped in for attention across sp (`attention`: ring or all-gather)
    and experts across the batch shards; `fp8`: the linear layers' FP8 recipe (models.fp8). `local_axes`:
    axes the values are local to (a vmap over batch shards, a map manual over them);
    `data_axes`: what splits the batch (default: the layout's)."""
    rules, data_axes = layout.rules, data_axes or layout.data_axes
    stack = contextlib.ExitStack()
    stack.enter_context(nnx.logical_axis_rules(rules.activation_rules(local_axes, data_axes)))
    # (Pipelines gather the table for the lookup: multi-token prediction looks it up in
    # the stages too, and the two gradients are summed before they are reduced.)
    stack.enter_context(storage(rules.storage(local_axes, moves_rows=layout.schedule is None)))
    stack.enter_context(computed_copies({"kv_heads": layout.kv_copies}))
    stack.enter_context(fp8_recipe(fp8))
    # The maps' rows: split as the batch is (outside pipeline stages over pp too, where a
    # dense prefix runs: a map over the batch axes alone gathered its rows over pp, and
    # each pp rank attended to all of them).
    batch_axes = tuple(a for a in data_axes if a not in local_axes)
    if layout.shape["sp"] > 1:
        stack.enter_context(attention_implementation(make_attention(layout.mesh, attention, batch_axes, KERNELS[kernel])))
        stack.enter_context(slots_implementation(make_capacity_slots(layout.mesh, batch_axes)))
    else:
        stack.enter_context(attention_implementation(make_kernel(layout.mesh, kernel, batch_axes)))
    # Experts: each device routes its own tokens (its rows, its chunk of the sequence;
    # all-to-all over ep when ep > 1). Inside a vmap over all the batch shards, or a map
    # manual over them, without sp, a shard's experts are all at hand: the one-device
    # computation (chosen explicitly: an enclosing context's, for the whole batch, would not fit here).
    if layout.skeleton.model_cfg.moe is not None:
        # (Experts split over ep are never all at hand, ep manual or not.)
        split = math.prod(layout.shape[a] for a in {*batch_axes, "sp", EXPERT_AXIS}) > 1
        stack.enter_context(expert_implementation(make_experts(layout.mesh, batch_axes) if split else None))
    return stack


def _fresh_params(cfg, layout: Layout, key) -> dict:
    """A fresh model's parameters, as the layout stores them. Adapters draw from a stream of
    their own, so the base is the same with or without them."""
    model = build_model(layout.skeleton.model_cfg, cfg.model.dtype, cfg.model.remat, layout.skeleton.routing,
                        layout.skeleton.lora, nnx.Rngs(params=key, lora=jax.random.fold_in(key, 1)))
    return layout.stored(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def initial_params(cfg, layout: Layout):
    """key -> a fresh model's parameters (a jitted function), born in `layout`'s shardings."""
    return jax.jit(functools.partial(_fresh_params, cfg, layout), out_shardings=layout.shardings(layout.rules.params),
                   compiler_options=init_compiler_options(layout))


def with_fresh_predictions(cfg, layout: Layout, params: dict, key) -> dict:
    """A Hugging Face directory's parameters (`params`) with the multi-token prediction
    modules it did not hold (`--mtp-depth` beyond its prediction layers) drawn as a fresh
    model's from `key`: the initializer is compiled for them alone (XLA drops the rest)."""
    shapes = traverse_util.flatten_dict(layout.skeleton.shapes)
    held = traverse_util.flatten_dict(params)
    missing = [path for path in shapes if path[0] == PREDICTIONS and path not in held]
    if not missing:
        return params
    shardings = traverse_util.flatten_dict(layout.shardings(layout.rules.params))
    fresh = jax.jit(lambda k: [traverse_util.flatten_dict(_fresh_params(cfg, layout, k))[p] for p in missing],
                    out_shardings=[shardings[p] for p in missing], compiler_options=init_compiler_options(layout))
    return traverse_util.unflatten_dict(held | dict(zip(missing, fresh(key))))


def init_compiler_options(layout: Layout) -> dict:
    """The initializer runs once: on the CPU, LLVM optimizing its random draws took 7 of
    its 8 seconds (tiny model), so it is compiled unoptimized there."""
    return {"xla_backend_optimization_level": 0} if layout.mesh.devices.flat[0].platform == "cpu" else {}


class Program:
    """The compiled pieces of one training run on one layout (the decoding program,
    spmd.inference.decode.Decoder, has the same shape): built from the config and the layout, the
    jitted entry points `init(key) -> state`, `start(params) -> state`, `step(state, batch)
    -> (state, metrics)` and `evaluate(params, batch) -> {"loss", "tokens"}`, and their AOT
    compilation. `packed`: batches are packed rows (the module docstring)."""

    def __init__(self, cfg, layout: Layout, packed: bool = False):
        self.cfg, self.layout, self.packed = cfg, layout, packed
        self.kernel = resolve_kernel(cfg.model.attention_kernel, layout.mesh.devices.flat[0])
        self.graphdef = layout.skeleton.graphdef
        # Expert copies (spmd.parallel.balance): their gradients are tied and clipped here, with a
        # norm that counts each expert once.
        self.copies = layout.skeleton.routing.slots is not None
        self.expert_dims = balance.expert_dims(layout.skeleton.names)
        # Pipeline stages split the stacked layers over pp: each device ties its own.
        self.tie_stages = (layout.mesh, 1 if layout.repeats > 1 else 0) if layout.schedule else None
        self.tx = make_optimizer(cfg, layout.skeleton.model_cfg, clip=not self.copies)
        self.lr_at = schedule(cfg)
        skeleton = layout.skeleton
        # With LoRA only the adapters train (the state's "params"); the rest is "frozen".
        param_sh = layout.shardings(layout.rules.params)
        self.grad_sh = layout.shardings(layout.rules.grads, trained=True)
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        state_sh = {
            "step": layout.replicated,
            "params": skeleton.trained(param_sh),
            "opt_state": layout.opt_state_shardings(self.tx, shapes["opt_state"]),
        }
        if skeleton.lora:
            state_sh["frozen"] = skeleton.frozen(param_sh)
            # Fresh adapters for a base read from elsewhere (a Hugging Face directory).
            self.new_adapters = jax.jit(lambda key: skeleton.trained(self._model_params(key)),
                                        out_shardings=state_sh["params"],
                                        compiler_options=init_compiler_options(layout))
        if "routing" in shapes:
            state_sh["routing"] = jax.tree.map(lambda n: layout.named(spec_for(n, layout.rules.params)),
                                               layout.skeleton.router_names, is_leaf=is_names)
        self.abstract_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                           shapes, state_sh)
        self.order = zigzag_order(cfg.training.seq, layout.shape["sp"]) if layout.shape["sp"] > 1 else None
        batch_sh = layout.batch_sharding
        rows = jax.ShapeDtypeStruct((cfg.training.batch, cfg.training.seq + 1), jnp.int32, sharding=batch_sh)
        self.batch_struct = rows if not packed else {
            "tokens": rows, "segments": rows,
            "loss_mask": jax.ShapeDtypeStruct(rows.shape, jnp.bool_, sharding=batch_sh)}
        self.init = jax.jit(self._init, out_shardings=state_sh, compiler_options=init_compiler_options(layout))
        self.start = jax.jit(self._start, in_shardings=(param_sh,), out_shardings=state_sh, donate_argnums=0)
        self.step = jax.jit(self._train_step, in_shardings=(state_sh, batch_sh),
                            out_shardings=(state_sh, layout.replicated), donate_argnums=0)
        # evaluate(params, rows[, router]): all the model's parameters (`model_params`), and
        # the router state too, if the model keeps one.
        eval_sh = (param_sh, batch_sh) + ((state_sh["routing"],) if "routing" in state_sh else ())
        self.evaluate = jax.jit(self._eval_loss, in_shardings=eval_sh, out_shardings=layout.replicated)
        if self.copies:  # the placement is an input: every rebalancing runs this one program
            self._move = jax.jit(self._moved, in_shardings=(state_sh, layout.replicated), out_shardings=state_sh,
                                 donate_argnums=0)

    def compile_step(self):
        """AOT-compile the step for the abstract state and batch (nothing is allocated)."""
        with jax.set_mesh(self.layout.mesh):
            return self.step.lower(self.abstract_state, self.batch_struct).compile()

    def compile_eval(self):
        router = (self.abstract_state["routing"],) if "routing" in self.abstract_state else ()
        with jax.set_mesh(self.layout.mesh):
            return self.evaluate.lower(model_params(self.abstract_state), self.batch_struct, *router).compile()

    # ------------------------------------------------------------ the jitted functions

    def _model_params(self, key):
        return _fresh_params(self.cfg, self.layout, key)

    def _init(self, key):
        return self._start(self._model_params(key))

    def _start(self, params):
        """The state of a run starting from `params` (all the model's, adapters included)."""
        skeleton = self.layout.skeleton
        trained = skeleton.trained(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": trained, "opt_state": self.tx.init(trained)}
        if skeleton.lora:  # stored in --base-dtype
            state["frozen"] = jax.tree.map(lambda w: w.astype(DTYPES[self.cfg.lora.base_dtype]),
                                           skeleton.frozen(params))
        if self.layout.skeleton.router_shapes:  # as the model starts it: no bias, even load, copies in order
            state["routing"] = balance.initial(self.layout.skeleton.router_shapes)
        return state

    def metrics_and_grads(self, state, rows):
        """The step's metrics and the gradients of the trained parameters (the adapters of a
        LoRA run), for one global batch, whatever accumulates or pipelines them."""
        params = state["params"]
        # Packed rows: the loss is a mean over the step's counted targets, wherever they are.
        depth = prediction_depth(self.layout.skeleton.model_cfg)
        denominator = target_counts(rows, depth) if self.packed else None
        aux = aux_losses(self.cfg, state["step"])  # (multi-token prediction's weight changes with the step)
        inputs = Auxiliary(aux, state.get("routing"), denominator, state.get("frozen"))
        # Adapters' dropout: masks drawn anew each step (and each microbatch of it).
        with lora_dropout(self.cfg.lora.lora_dropout,
                          jax.random.fold_in(jax.random.key(self.cfg.training.seed), state["step"])):
            if self.cfg.training.grad_accum == 1:
                return self._loss_and_grads(params, rows, inputs)
            if self.layout.schedule:
                return self._pipeline_rounds(params, rows, inputs)
            return self._accumulated(params, rows, inputs)

    def _train_step(self, state, rows):
        cfg, params, router, frozen = self.cfg, state["params"], state.get("routing"), state.get("frozen")
        metrics, grads = self.metrics_and_grads(state, rows)
        loss = metrics["loss"]
        grads = jax.lax.with_sharding_constraint(grads, self.grad_sh)
        if self.copies:
            placement, experts = balance.states(router)[0]["placement"], self.layout.skeleton.model_cfg.moe.experts
            grads = balance.tie(grads, self.expert_dims, placement, experts, self.tie_stages)
            grad_norm = balance.logical_norm(grads, self.expert_dims, placement, experts)
            grads = balance.clip(grads, grad_norm, cfg.optimizer.clip)
        else:
            grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], params)
        # A non-finite loss, gradient or update (a NaN learning rate, a moment gone bad)
        # never reaches the state: that update is dropped.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
        keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = {
            "step": state["step"] + 1,
            "params": keep_if_finite(optax.apply_updates(params, updates), params),
            "opt_state": keep_if_finite(opt_state, state["opt_state"]),
        }
        if frozen is not None:
            new_state["frozen"] = frozen
        if router is not None:
            load = _with_empty_layers(metrics["expert_load"], self.layout.skeleton.model_cfg)
            new_state["routing"] = keep_if_finite(balance.updated(router, load, cfg.moe.router_bias_rate), router)
        metrics = _step_metrics(metrics, self.layout.shape["ep"], self.layout.skeleton.model_cfg.layer_steps) | {
            "grad_norm": grad_norm, "lr": self.lr_at(applied_updates(state["opt_state"])), "skipped": ~finite}
        return new_state, metrics

    def rebalance(self, state: dict) -> dict:
        """Expert copies placed anew from the measured load (spmd.parallel.balance.placement_for),
        their weights and optimizer state moved to their slots. Reads the router state on
        the host: a sync, once every --rebalance-every steps."""
        router = jax.device_get(balance.states(state["routing"])[0])
        load, placement = np.asarray(router["load"]), np.asarray(router["placement"])
        slots, ep = placement.shape[-1], self.layout.shape["ep"]
        new = [balance.placement_for(layer_load, slots, ep, current)  # one MoE layer at a time
               for layer_load, current in zip(load.reshape(-1, load.shape[-1]), placement.reshape(-1, slots))]
        return self._move(state, np.stack(new).reshape(placement.shape))

    def _moved(self, state, new):
        old = balance.states(state["routing"])[0]["placement"]
        return {**state, "params": balance.move(state["params"], self.expert_dims, old, new),
                "opt_state": balance.move_opt_state(self.tx, state["opt_state"], self.expert_dims, old, new),
                "routing": balance.placed(state["routing"], new)}

    def _eval_loss(self, params, rows, router=None):
        """The same loss, without its gradients (1F1B's: as GPipe), and the number of targets
        it is the mean of (so that means over batches can be weighted exactly)."""
        count = target_count(rows)
        with self._annotated():
            inputs = Auxiliary(router=router, denominator=count[None] if self.packed else None)
            return {"loss": self._loss(params, rows, inputs)[1]["loss"],
                    "tokens": count}

    # ------------------------------------------------------------ their parts

    def _annotated(self, local_axes: tuple[str, ...] = (), data_axes: tuple[str, ...] | None = None):
        return model_context(self.layout, self.cfg.parallelism.attention, local_axes, data_axes, self.kernel,
                             self.cfg.model.fp8)

    def _in_stage(self):
        # Inside a stage the map is manual over pp, dp and ep (spmd.parallel.pipeline): none splits `batch` there.
        return self._annotated(manual_axes(self.layout.shape), BATCH_AXES)

    def _loss(self, params, rows, inputs: Auxiliary = Auxiliary()):
        """The loss of `params` (the trained ones, with the `inputs.frozen` rest if any);
        `inputs.aux`: what is added to it (None: the run's, without multi-token prediction,
        as evaluated)."""
        params = params if inputs.frozen is None else joined(inputs.frozen, params)
        aux = inputs.aux or aux_losses(self.cfg)
        if self.layout.schedule:
            return pipelined_loss(self.graphdef, params, rows, self.layout, self._in_stage, self.order,
                                  inputs._replace(aux=aux))
        return model_loss(self.graphdef, params, rows, self.order, aux, inputs.router, inputs.denominator)

    def _loss_and_grads(self, params, rows, inputs: Auxiliary = Auxiliary()):
        """Metrics, and the gradients of the trained `params` (not of the `inputs.frozen` rest)."""
        schedule = self.layout.schedule
        with self._annotated():
            if schedule and schedule.writes_backward:
                return one_f_one_b_grads(self.graphdef, params, rows, self.layout, self._in_stage, self.order,
                                          inputs._replace(aux=inputs.aux or aux_losses(self.cfg)))
            (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, rows, inputs)
            return metrics, grads

    def _accumulated(self, params, rows, inputs: Auxiliary):
        """Gradient accumulation: each shard of the accumulation axes sums its own
        microbatches' gradients (a vmap over those shards), and the shards are summed
        once after the scan. Inside the vmap, the other axes (sp, tp, and ep with split
        experts) work as without accumulation, their reductions in every microbatch."""
        layout = self.layout
        k, axes = self.cfg.training.grad_accum, layout.accumulation_axes
        shards = math.prod(layout.shape[a] for a in axes)
        # (k, all batch shards, rows, width) -> (k, accumulation shards, the rest's rows, width):
        # ep is the innermost batch axis, so its shards stay inside one accumulation shard.
        micro = jax.tree.map(lambda r: _split_locally(r, layout.batch_shards, k).reshape(k, shards, -1, r.shape[1]),
                             rows)
        inner = tuple(a for a in BATCH_AXES if a not in axes)
        micro = jax.lax.with_sharding_constraint(micro, jax.P(None, axes, inner or None))
        per_shard_spec = layout.per_shard_specs(axes)
        # Each part's loss over its share of the step's count: the parts' mean is the step's.
        part = None if inputs.denominator is None else inputs.denominator / (k * shards)

        def shard_grads(p, shard_rows):
            with self._annotated(local_axes=axes):
                (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
                    p, shard_rows, inputs._replace(denominator=part))
                return metrics, grads

        per_shard = jax.vmap(shard_grads, in_axes=(None, 0), spmd_axis_name=axes)
        metric_shapes, _ = jax.eval_shape(per_shard, params, jax.tree.map(lambda m: m[0], micro))

        def body(carry, mb):
            mb, i = mb
            with folded(i):
                metrics, grads = per_shard(params, mb)
            total_metrics, total = carry
            total = jax.tree.map(jnp.add, total, grads)
            total = jax.tree.map(jax.lax.with_sharding_constraint, total, per_shard_spec)
            return (jax.tree.map(jnp.add, total_metrics, metrics), total), None

        zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros((shards, *p.shape), p.dtype), s),
                             params, per_shard_spec)
        no_metrics = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), metric_shapes)
        (metrics, grads), _ = jax.lax.scan(body, (no_metrics, zeros), (micro, jnp.arange(k)))
        # The one reduction over the accumulation axes: sum the shards' gradients.
        scale = 1.0 / (k * shards)
        return (jax.tree.map(lambda m: jnp.sum(m, axis=0) * scale, metrics),
                jax.tree.map(lambda g: jnp.sum(g, axis=0) * scale, grads))

    def _pipeline_rounds(self, params, rows, inputs: Auxiliary):
        """Accumulation with pipeline stages: one full pipeline pass per round (each
        reduces its gradients over dp as it ends), summed in a scan."""
        layout = self.layout
        k, shards = self.cfg.training.grad_accum, math.prod(layout.shape[a] for a in layout.data_axes)
        rounds = jax.tree.map(lambda r: _split_locally(r, shards, k).reshape(k, r.shape[0] // k, r.shape[1]), rows)
        rounds = jax.lax.with_sharding_constraint(rounds, jax.P(None, layout.data_axes))
        part = None if inputs.denominator is None else inputs.denominator / k  # each round's share of the step's count
        inputs = inputs._replace(denominator=part)

        def body(total, round_rows):
            round_rows, i = round_rows
            with folded(i):
                return jax.tree.map(jnp.add, total, self._loss_and_grads(params, round_rows, inputs)), None

        shapes = jax.eval_shape(lambda p, r: self._loss_and_grads(p, r, inputs), params,
                                jax.tree.map(lambda r: r[0], rounds))
        total, _ = jax.lax.scan(body, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), (rounds, jnp.arange(k)))
        return jax.tree.map(lambda x: x / k, total)


def build_program(cfg: StepOptions, layout: Layout, packed: bool = False) -> Program:
    return Program(step_options(cfg), layout, packed)


def model_params(state: dict) -> dict:
    """All the model's parameters in a train state: the trained ones, with the frozen base
    of a LoRA run."""
    return state["params"] if "frozen" not in state else joined(state["frozen"], state["params"])
