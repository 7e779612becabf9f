"""Expert load balancing: the router's selection bias and redundant expert slots (EPLB).

The router state lives in the MoE layers (`models.moe.RouterState`: `bias`, `load`,
`placement`, one row per MoE layer); this module is what the trainer does with it.

- Bias balancing (DeepSeek-V3's auxiliary-loss-free method): after each step, every
  expert's bias moves by `rate` towards the mean load: + rate if the expert took fewer
  than its share of the step's choices, - rate if more.
- Redundant experts: the experts' weights live in `slots` = experts + R slots, split over
  ep; an expert may have several copies, which split its tokens. Copies are kept equal:
  each copy's gradient is the sum over all of its expert's copies (`tie`: only the R
  copies' gradients and their homes' move, 2R rows per layer), and the gradient norm
  counts every expert once, so the optimizer sees the model without copies. Every
  `rebalance_every` steps a placement is computed from the measured load (a moving
  average): the heaviest experts get the spare slots, then the copies are packed onto
  devices to even out their load (`placement_for`), and the weights and their optimizer
  state move to their new slots (`move`), inside one compiled program whose placement is
  an input: nothing is recompiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.annotate import PREDICTIONS
from models.moe import initial_placement
from spmd.parallel.rules import STAGE_AXIS
from spmd.parallel.skeleton import is_names

EXPERTS = "experts"  # the logical name of the experts' dimension (models.moe)
REBALANCE_EVERY = 50  # --rebalance-every's default
LOAD_DECAY = 0.9  # the measured load is a moving average: each step weighs 1 - LOAD_DECAY


def expert_dims(names) -> dict:
    """For each parameter, the position of its experts' dimension, where its experts have
    copies (-1: none; the multi-token prediction modules' experts have no copies)."""
    return {name: jax.tree.map(lambda n: n.index(EXPERTS) if EXPERTS in n and name != PREDICTIONS else -1, tree,
                               is_leaf=is_names) for name, tree in names.items()}


def _per_layer(fn, leaf, dim: int, placement):
    """fn(layer's slots-first array, layer's placement) over the layers of a stacked leaf
    whose experts' dimension is `dim`; the dimensions before it are the layers' (one, or
    a pipeline's chunks and their layers), as are all but the last of `placement`'s.
    One vmap per leading dimension, not a reshape to one: a pipeline's stack is split over
    pp on its second dimension, which a merge of the two would gather."""
    for _ in range(dim):
        fn = jax.vmap(fn)
    return fn(leaf, placement)


def _copies(placement: jax.Array, experts: int) -> jax.Array:
    """How many slots hold each slot's expert, shaped like `placement`."""
    return _per_layer(lambda _, where: jnp.bincount(where, length=experts)[where], placement, placement.ndim - 1,
                      placement)


def homes_and_copies(placement: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
    """One layer's copy slots and their homes: each expert's home is its first slot; the
    other slots, R = slots - experts of them (every expert has a slot), are copies, in
    slot order. -> (copies, their homes), each (R,)."""
    slots = placement.shape[-1]
    first = jnp.argmax(placement[None, :] == jnp.arange(experts)[:, None], axis=1)  # (experts,)
    home = first[placement]  # each slot's expert's home slot
    copies = jnp.nonzero(home != jnp.arange(slots), size=slots - experts, fill_value=0)[0]
    return copies, home[copies]


def tie(grads, dims, placement: jax.Array, experts: int, stages=None):
    """Each slot's gradient becomes the sum over the slots that hold the same expert.

    Only the copies' rows move, one at a time: each of the R copy slots' gradient is added
    to its home's, then each home's total is written back to its copies (with slots split
    over ep, XLA picks a row on the device that holds it and all-reduces that one row over
    ep, and each device adds or writes into its own slots): 2R rows move, and one is alive
    at a time, not 2R (DeepSeek-V3's 128 rows of a layer were 21 GiB per device). Home
    and copies get the same total, bit for bit. A layer at a time (a loop over the stack).
    `stages`: (mesh, the position of the layers' dimension) where pipeline stages split
    the layers over pp; each device loops over its own layers, in a map manual over pp."""
    def summed(g, where):
        copies, homes = homes_and_copies(where, experts)
        if copies.shape[0] == 0:
            return g
        slot = jnp.arange(g.shape[0]).reshape(-1, *[1] * (g.ndim - 1))

        def pick(g, s):
            # A contraction with a one-hot over the slots: each device sums its own slots
            # and the one row is all-reduced (indexing a split dimension gathers it whole).
            return jnp.tensordot((jnp.arange(g.shape[0]) == s).astype(g.dtype), g, axes=1)

        def gather(g, pair):
            copy, home = pair
            return jnp.where(slot == home, g + pick(g, copy), g), None

        def spread(g, pair):
            copy, home = pair
            return jnp.where(slot == copy, pick(g, home), g), None
        g = jax.lax.scan(gather, g, (copies, homes))[0]
        return jax.lax.scan(spread, g, (copies, homes))[0]

    def layer_by_layer(g, dim, where):
        flat = (g.reshape(-1, *g.shape[dim:]), where.reshape(-1, where.shape[-1]))
        return jax.lax.map(lambda layer: summed(*layer), flat).reshape(g.shape)

    leaves, tree = jax.tree.flatten(grads)
    dim_of = jax.tree.leaves(dims)  # (the experts' dimension of each leaf, -1 for none)
    tied = [i for i, d in enumerate(dim_of) if d >= 0]

    def tie_all(rows, where):
        return [layer_by_layer(g, dim_of[i], where) for g, i in zip(rows, tied)]

    if stages is None:
        done = tie_all([leaves[i] for i in tied], placement)
    else:
        mesh, layer_dim = stages
        split = jax.P(*([None] * layer_dim), STAGE_AXIS)
        done = jax.shard_map(tie_all, mesh=mesh, in_specs=([split] * len(tied), split), out_specs=[split] * len(tied),
                             axis_names=frozenset({STAGE_AXIS}), check_vma=False)([leaves[i] for i in tied], placement)
    for i, g in zip(tied, done):
        leaves[i] = g
    return jax.tree.unflatten(tree, leaves)


def logical_norm(grads, dims, placement: jax.Array, experts: int) -> jax.Array:
    """The global norm of tied gradients with every expert counted once."""
    copies = _copies(placement, experts).astype(jnp.float32)

    def squares(g, d):
        if d < 0:
            return jnp.sum(jnp.square(g.astype(jnp.float32)))
        per_slot = jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(d + 1, g.ndim)))  # (layers..., slots)
        return jnp.sum(per_slot / copies)
    return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(squares, grads, dims))))


def clip(grads, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm's arithmetic, with a norm computed elsewhere."""
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm.astype(g.dtype) * max_norm), grads)


def updated(router: dict, expert_load: jax.Array, rate: float) -> dict:
    """The router state after a step whose loads (MoE layers, experts; shares of the
    choices) are `expert_load`: the bias moved towards the mean load, the load averaged."""
    def leaves(state: dict) -> dict:
        n = state["bias"].shape[-1]
        bias = state["bias"] + rate * jnp.sign(1.0 / n - expert_load).reshape(state["bias"].shape)
        load = LOAD_DECAY * state["load"] + (1 - LOAD_DECAY) * expert_load.reshape(state["load"].shape)
        return {**state, "bias": bias, "load": load}
    return _map_states(leaves, router)


def _map_states(fn, tree):
    """fn on each MoE layer's router state (a dict holding `placement`) in a pytree of them."""
    if isinstance(tree, dict) and "placement" in tree:
        return fn(tree)
    return {k: _map_states(fn, v) for k, v in tree.items()}


def initial(shapes) -> dict:
    """The router state as a model starts it (from its shapes): no bias, an even load, and
    slot j holding expert j % experts (models.moe.initial_placement)."""
    def start(state: dict) -> dict:
        n, slots = state["bias"].shape[-1], state["placement"].shape[-1]
        placement = jnp.broadcast_to(initial_placement(n, slots), state["placement"].shape)
        return {"bias": jnp.zeros(state["bias"].shape), "load": jnp.full(state["load"].shape, 1.0 / n),
                "placement": placement}
    return _map_states(start, shapes)


def with_bias(params: dict, router: dict) -> dict:
    """Params with each MoE layer's selection bias beside its weights (a served model's)."""
    if "placement" in router:
        return {**params, "bias": router["bias"]}
    return {**params, **{k: with_bias(params.get(k, {}), v) for k, v in router.items()}}


def states(tree) -> list[dict]:
    found = []
    _map_states(lambda s: found.append(s) or s, tree)
    return found


def device_imbalance(slot_load: jax.Array, ep: int, layers: int) -> jax.Array:
    """Max over mean of the choices each ep device's slots take (slots split evenly, in
    order), averaged over the `layers` MoE layers. slot_load: (layers, slots) shares (and
    empty layers' zeros after them)."""
    per_device = slot_load.reshape(slot_load.shape[0], ep, -1).sum(-1)
    return jnp.sum(jnp.max(per_device, axis=-1) * ep) / layers


# ------------------------------------------------------------------------------ placement

def placement_for(load: np.ndarray, slots: int, devices: int, current: np.ndarray | None = None) -> np.ndarray:
    """EPLB for one layer: experts' measured loads (n,) -> the expert of each of `slots`
    slots (devices x slots / devices, in device order). The spare slots go one by one to
    the expert with the highest load per copy; then the copies, heaviest first, each go to
    the least loaded device with a free slot (one not holding that expert yet if any).
    On a device, an expert keeps the slot it had in `current`, so fewer weights move."""
    n, per_device = len(load), slots // devices
    copies = np.ones(n, np.int64)
    for _ in range(slots - n):
        copies[np.argmax(load / copies)] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(n) for _ in range(copies[e])), key=lambda t: (-t[0], t[1]))
    device_load, held = np.zeros(devices), [[] for _ in range(devices)]
    for weight, expert in items:
        free = [d for d in range(devices) if len(held[d]) < per_device]
        fresh = [d for d in free if expert not in held[d]] or free
        d = min(fresh, key=lambda d: (device_load[d], d))
        held[d].append(expert)
        device_load[d] += weight
    placement = np.empty(slots, np.int32)
    for d in range(devices):
        own = range(d * per_device, (d + 1) * per_device)
        left = list(held[d])
        keep = {j: int(current[j]) for j in own if current is not None and current[j] in left}
        for expert in keep.values():
            left.remove(expert)
        for j in own:
            placement[j] = keep[j] if j in keep else left.pop(0)
    return placement


def placed(router, placement: jax.Array):
    """The router state with a new placement (layers, slots)."""
    return _map_states(lambda state: {**state, "placement": placement.astype(state["placement"].dtype)}, router)


def first_copies(tree, dims, placement: jax.Array, experts: int):
    """Params with copies -> the model's: each expert's first slot, in expert order."""
    firsts = jnp.argmax(placement[..., None, :] == jnp.arange(experts)[:, None], axis=-1)

    def logical(x, d):
        return x if d < 0 else _per_layer(lambda x, first: x[first], x, d, firsts)
    return jax.tree.map(logical, tree, dims)


def move(tree, dims, old: jax.Array, new: jax.Array):
    """Params or optimizer state with each slot's arrays taken from a slot that held its
    new expert in `old` (itself, if its expert stays). old, new: (layers, slots)."""
    def source(old, new):
        first = jnp.argmax(old[None, :] == new[:, None], axis=1)
        return jnp.where(old == new, jnp.arange(old.shape[0]), first)

    sources = jax.vmap(source)(old.reshape(-1, old.shape[-1]), new.reshape(-1, new.shape[-1])).reshape(old.shape)

    def moved(x, d):
        return x if d < 0 else _per_layer(lambda x, src: x[src], x, d, sources)
    return jax.tree.map(moved, tree, dims)


def move_opt_state(tx: optax.GradientTransformation, opt_state, dims, old, new):
    """`move` on every parameter-shaped leaf of the optimizer state."""
    return optax.tree_map_params(tx, lambda x, d: x if d < 0 else move(x, d, old, new), opt_state, dims)
