"""Pipeline stages over the `pp` axis, with `jax.shard_map`.

The stacked layers are cut into p stages (rules table: `layers` -> pp); a step's rows are
cut into m microbatches that stream through them. The map is manual over pp and dp; fsdp,
ep, sp and tp stay automatic inside a stage, so a stage is the model's own layer scan under
the same rules as without a pipeline (the experts' and ring attention's maps nest inside,
manual over the axes this one leaves; MoE layers' statistics come out with the outputs,
and 1F1B feeds what they add to the loss into its backward pass). Being manual over dp lets each dp shard sum its own
gradients over the ticks and reduce them once, where the map ends (automatic, XLA would
reduce them every tick). Activations move to the next stage by `ppermute` once per tick;
every stage runs every tick (a bubble tick computes on zeros and its result is dropped),
so the compiled program executes (ticks / useful ticks) times the useful work: the
schedule's bubble, exactly.

Outside the map, pp is one more data axis: the embedding, the output head and the loss
run on rows split over (dp, fsdp, ep, pp). The microbatches enter as one copy per stage
(an all-gather over pp; stage 0 reads its copy) and leave as the sum of the stages'
results, zero but on stage 0 (a reduce-scatter: each pp rank gets m/p microbatches).
Both happen outside the map, where XLA keeps the rows split over fsdp and reduces
bfloat16 safely (XLA:CPU aborts on a bfloat16 reduction inside a partly manual map).

A microbatch may come with side inputs that every stage reads but no stage changes (the
segment ids and positions of packed rows): `side`, (m, mb, ...) arrays handed to every
stage whole (replicated over pp), of which a stage passes microbatch k's to `stage_fn`
when it runs microbatch k.

Schedules:
- gpipe: tick t, stage s runs microbatch t - s; m + p - 1 ticks forward, then autodiff
  runs them backward. Bubble (p-1)/(m+p-1); every microbatch's activations are kept.
- circular (`repeats` v): stage s holds v chunks of layers, s, s+p, ... (stored as a
  (v, layers/v) stack split over pp on its second axis, so each device holds its chunks
  and a row-major reshape gives the model's order). A microbatch goes around the ring v
  times; stage 0 keeps what comes back from the last stage in its input queue until the
  microbatch's next round. v*m + p - 1 ticks, bubble (p-1)/(v*m+p-1); needs m >= p.
- 1f1b: the backward pass is written out, so each tick runs one forward and one backward
  on every stage: microbatch k's forward at stage s in tick k + s, its backward in tick
  k + 2(p-1) - s. A stage keeps at most 2(p-1-s)+1 <= 2p-1 microbatches' residuals
  (a ring of 2p-1 slots), however large m is. The last stage computes the head and loss
  of each microbatch in its forward tick, so its backward starts at once. Warm-up (p-1
  ticks, forwards only), steady state (m ticks) and cool-down (p-1, backwards only) are
  three scans, so the executed work is GPipe's: bubble (p-1)/(m+p-1).
- interleaved-1f1b (`repeats` v): 1f1b on circular chunks (stored as circular's). Stage
  s's i-th forward runs in tick i + s on round i % (pv) // p of microbatch
  (i // (pv)) p + i % p: groups of p microbatches go around the ring v times, so what
  stage 0 receives from the last stage is its next input and needs no queue. Backwards
  run the rounds of a group in reverse, from tick vp - 1 (the last stage's first final
  round: its backward uses the head's gradient of the same tick). Warm-up vp - 1 ticks,
  steady v*m + p - 1 - (vp - 1), cool-down vp - 1: each stage runs v*m + p - 1 chunk
  forwards and as many backwards, bubble (p-1)/(v*m+p-1) as circular. A chunk's
  residuals live at most 2(vp-1) ticks: a ring of 2vp - 1 chunk residuals, (2vp-1)/v
  microbatches through the stage's layers (1f1b's 2p - 1 at v = 1).
- zb-v: two chunks per stage in a V, the backward split into input and weight gradients
  (spmd.parallel.zero_bubble).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from spmd.parallel.rules import STAGE_AXIS

AXIS = STAGE_AXIS  # the rules table splits the stacked layers over it
BATCH_AXIS = "dp"  # also manual in the map: gradients are reduced over it once per step
MANUAL_AXES = (AXIS, BATCH_AXIS)
PP_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-v")
REPEATED_SCHEDULES = ("circular", "interleaved-1f1b")  # those with --pp-repeats chunks per stage
WRITTEN_OUT = ("1f1b", "interleaved-1f1b", "zb-v")  # schedules that run their backward pass themselves


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    microbatches: int  # m
    repeats: int = 1  # v (circular, interleaved-1f1b)
    remat: str = "none"  # the model's remat policy (zb-v defers its weight gradients only under "none")

    @classmethod
    def of(cls, cfg, stages: int) -> "Schedule":
        """The schedule a run's options ask for on `stages` pipeline stages."""
        # zb-v: two chunks per stage, stored as circular's (spmd.parallel.zero_bubble)
        repeats = 2 if cfg.pp_schedule == "zb-v" else cfg.pp_repeats
        return cls(cfg.pp_schedule, stages, cfg.microbatches or stages, repeats, cfg.remat)

    @property
    def defers_weights(self) -> bool:
        """Whether the backward pass is split into B and a deferred W (zb-v under remat
        "none"). Under a remat policy the matmuls' inputs are recomputed inside the
        backward pass, so zb-v runs each chunk's whole backward in B's tick: its
        activations are the policy's, its bubble 1F1B's (spmd.parallel.zero_bubble)."""
        return self.name == "zb-v" and self.remat == "none"

    @property
    def ticks(self) -> int:
        """Ticks that run a chunk's forward (gpipe, circular, 1f1b, interleaved-1f1b:
        v*m + p - 1; zb-v: 2m + 2p - 2, half a stage each)."""
        if self.name == "zb-v":
            return 2 * (self.microbatches + self.stages - 1)
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Share of the executed forward (and backward) stage work that is idle (computes
        on padding). zb-v: of its forwards and input gradients; its weight gradients
        have none (spmd.parallel.zero_bubble.executed_over_useful)."""
        p, useful = self.stages, self.repeats * self.microbatches
        if self.name == "zb-v":
            useful = self.microbatches
        return (p - 1) / (useful + p - 1)

    @property
    def compute_overhead(self) -> float:
        """Executed over useful stage compute: 1 / (1 - bubble); zb-v's weight gradients
        have no bubble, so with a chunk's forward, B and W alike (its matmuls, each once
        per pass) 1 + 2(p-1)/(3m) (spmd.parallel.zero_bubble.executed_over_useful)."""
        if self.defers_weights:
            return 1 + 2 * (self.stages - 1) / (3 * self.microbatches)
        return 1 / (1 - self.bubble)

    @property
    def writes_backward(self) -> bool:
        """Whether the schedule runs the backward pass itself (`one_f_one_b`), not autodiff."""
        return self.name in WRITTEN_OUT

    @property
    def residual_slots(self) -> int:
        """Chunk residuals a stage keeps at once (1f1b, interleaved-1f1b): a forward's
        live at most 2(vp - 1) ticks."""
        return 2 * self.repeats * self.stages - 1

    @property
    def kept_microbatches(self) -> float:
        """A stage's activations kept at once, in microbatches through all its layers:
        m + p - 1 ticks' (gpipe), v*m + p - 1 ticks of 1/v of them (circular), or the
        residual ring's (2vp - 1) / v."""
        if self.defers_weights:
            # The longest-kept part: the matmuls' inputs for W, 5p - 2 chunks (what B
            # reads: 4p - 1; the matmul outputs' cotangents from B to W: 2p - 1).
            return (5 * self.stages - 2) / 2
        # (zb-v with W in B's tick: B's ring of 4p - 1 chunks, interleaved-1f1b's at v = 2)
        if self.writes_backward:
            return self.residual_slots / self.repeats
        return self.ticks / self.repeats


# ------------------------------------------------------------------ rows <-> microbatches

def to_microbatches(x: jax.Array, shards: int, schedule: Schedule) -> jax.Array:
    """Rows (b, ...) split over (batch axes, pp) -> (m, b/m, ...): pp rank i's rows are
    microbatches [i*m/p, (i+1)*m/p), each taking an equal share of every batch shard's
    rows, so the reshuffle moves nothing between devices."""
    p, m = schedule.stages, schedule.microbatches
    b = x.shape[0]
    x = x.reshape(shards, p, m // p, b // (shards * m), *x.shape[1:])
    return jnp.moveaxis(x, 0, 2).reshape(m, b // m, *x.shape[4:])


def from_microbatches(x: jax.Array, shards: int, schedule: Schedule) -> jax.Array:
    """The inverse of `to_microbatches`."""
    p, m = schedule.stages, schedule.microbatches
    b = x.shape[0] * x.shape[1]
    x = x.reshape(p, m // p, shards, b // (shards * m), *x.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(b, *x.shape[4:])


def stage_view(leaf: jax.Array, repeats: int) -> jax.Array:
    """A stage's local slice of a stacked parameter -> (repeats, layers per chunk, ...)."""
    return leaf.reshape(repeats, -1, *leaf.shape[(2 if repeats > 1 else 1):])


def stacked_spec(repeats: int) -> jax.P:
    """How the stacked layers are split over pp: (layers,) or (repeats, layers / repeats)."""
    return jax.P(None, AXIS) if repeats > 1 else jax.P(AXIS)


def _ring(p: int, shift: int) -> list[tuple[int, int]]:
    return [(s, (s + shift) % p) for s in range(p)]


def _copies(x: jax.Array, mesh, rows: jax.P) -> jax.Array:
    """Microbatches (m, ...), split over pp along m -> one copy per stage (p, m, ...),
    split over pp along the copies: an all-gather over pp (stage 0 reads its copy). Done
    outside the map, where XLA keeps the rows laid out as `rows` says (one microbatch's
    spec: batch axes, and sp on the sequence), and the copies' gradients are summed there
    too: a reduce-scatter."""
    p = mesh.shape[AXIS]
    return jax.lax.with_sharding_constraint(jnp.broadcast_to(x, (p, *x.shape)),
                                            jax.NamedSharding(mesh, jax.P(AXIS, None, *rows)))


def _from_stage_0(per_stage: jax.Array, mesh, rows: jax.P) -> jax.Array:
    """Each stage's (m, ...) results, zero but on stage 0 -> stage 0's, split over pp along
    m: a reduce-scatter over pp (and its gradient an all-gather)."""
    return jax.lax.with_sharding_constraint(jnp.sum(per_stage, axis=0),
                                            jax.NamedSharding(mesh, jax.P(AXIS, *rows)))


def _statistics(stats: dict, valid, repeat, totals: dict) -> dict:
    """Add a tick's statistics (a chunk's MoE layers' on one microbatch) to `totals`
    (one entry per chunk, `repeat` the tick's), if the tick computed a real microbatch."""
    return jax.tree.map(lambda total, x: total.at[repeat].add(jnp.where(valid, x, 0)), totals, stats)


def _stage_statistics(totals: dict, m: int) -> dict:
    """The stage's statistics: means over its microbatches and dp shards, with a leading
    stage axis (the map's output is split over pp along it)."""
    return jax.tree.map(lambda total: jax.lax.pmean(total / m, BATCH_AXIS)[None], totals)


def layer_statistics(per_stage: dict) -> dict:
    """(stages, chunks, layers per chunk, ...) statistics -> (layers, ...), in the order the
    stacked layers are stored (chunk-major: `stacked_spec`), which per-layer state updated
    from them (the MoE layers' router, spmd.parallel.balance) follows."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[3:]), per_stage)


def _only_stage_0(x: jax.Array, stage: jax.Array) -> jax.Array:
    return jnp.where(stage == 0, x, jnp.zeros_like(x))[None]


# ----------------------------------------------------------------------- gpipe / circular

def micro(side, k):
    """Microbatch k's side inputs (None: none)."""
    return jax.tree.map(lambda s: s[k], side)


def _run_chunk(stage_fn, policy, chunks, repeat, x, side):
    """stage_fn on chunk `repeat` of the stage's layers (chunks: (v, layers, ...)).

    Autodiff of the tick loop keeps what the stage computes from its weights each tick:
    with one chunk (v = 1) the weights are the same every tick and nothing is copied; with
    several, the chunk picked each tick would be kept once per tick, so the tick runs under
    the model's remat `policy` (a picked chunk is neither a matmul output nor a named
    activation: the backward pass picks it again). Under remat "full" that runs the
    tick's forward once more in the backward pass."""
    if jax.tree.leaves(chunks)[0].shape[0] == 1:
        return stage_fn(jax.tree.map(lambda w: w[0], chunks), x, side)

    def run(chunks, repeat, x, side):
        return stage_fn(jax.tree.map(lambda w: w[repeat], chunks), x, side)
    return jax.checkpoint(run, policy=policy)(chunks, repeat, x, side)


def _no_statistics(stage_fn, chunks, x, side, fixed=None) -> dict:
    """Zeros shaped like what `stage_fn` reports for one chunk, one entry per chunk."""
    first = lambda tree: jax.tree.map(lambda w: w[0], tree)  # noqa: E731
    shapes = jax.eval_shape(stage_fn, first(chunks), x, side, first(fixed))[1]
    v = jax.tree.leaves(chunks)[0].shape[0]
    return jax.tree.map(lambda s: jnp.zeros((v, *s.shape), s.dtype), shapes)


def pipeline(mesh, schedule: Schedule, stage_fn, blocks, x: jax.Array, rows: jax.P, policy=None, side=None):
    """Run microbatches x (m, mb, ...), split over pp along m, through the stages;
    differentiable by `jax.grad`. `stage_fn(chunk, x, side) -> (y, statistics)` runs one
    chunk of stacked layers (leading axis: the chunk's layers) on one microbatch (with its
    `side` inputs, or None) and reports per-layer statistics (MoE layers'; a dict of arrays
    with a leading layer axis, empty for dense layers); `rows`: one microbatch's spec;
    `policy`: the model's remat policy; `side`: the microbatches' side inputs (module
    docstring), or None. Returns the outputs, laid out like x, and the statistics of every
    layer, each a mean over the microbatches (`layer_statistics`)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats

    def run(blocks, x, side):
        stage, x = jax.lax.axis_index(AXIS), x[0]
        chunks = jax.tree.map(lambda w: stage_view(w, v), blocks)

        def tick(carry, t):
            queue, arrived, totals = carry
            i = t - stage  # this stage's iteration: repeat i // m, microbatch i % m
            repeat = jnp.clip(i // m, 0, v - 1)
            inp = jnp.where(stage == 0, queue[t % m], arrived)
            out, stats = _run_chunk(stage_fn, policy, chunks, repeat, inp, micro(side, jnp.clip(i, 0, v * m - 1) % m))
            totals = _statistics(stats, (i >= 0) & (i < v * m), repeat, totals)
            arrived = jax.lax.ppermute(out, AXIS, _ring(p, 1))
            # Stage 0 files what the last stage finished into its queue (that microbatch's
            # next round, or its final output).
            last = t - (p - 1)
            filed = (stage == 0) & (last >= 0) & (last < v * m)
            slot = jnp.clip(last, 0, v * m - 1) % m
            queue = queue.at[slot].set(jnp.where(filed, arrived, queue[slot]))
            return (queue, arrived, totals), None

        start = (x, jnp.zeros_like(x[0]), _no_statistics(stage_fn, chunks, x[0], micro(side, 0)))
        (queue, _, totals), _ = jax.lax.scan(tick, start, jnp.arange(schedule.ticks))
        return _only_stage_0(queue, stage), _stage_statistics(totals, m)

    copies = jax.P(AXIS, None, BATCH_AXIS)
    out, stats = jax.shard_map(run, mesh=mesh, in_specs=(stacked_spec(v), copies, jax.P(None, BATCH_AXIS)),
                               out_specs=(copies, jax.P(AXIS)), axis_names=frozenset(MANUAL_AXES),
                               check_vma=False)(blocks, _copies(x, mesh, rows), side)
    return _from_stage_0(out, mesh, rows), layer_statistics(stats)


# ---------------------------------------------------------------------------------- 1f1b

def _weighted_statistics(no_stats: dict, statistics_weights, seed: float) -> dict:
    """What each statistic of one chunk adds to what is minimized, per microbatch of the
    whole batch (zeros if nothing: `statistics_weights` None)."""
    weights = jax.tree.map(lambda total: total[0], no_stats)
    return weights if statistics_weights is None else jax.tree.map(lambda w: seed * w, statistics_weights(weights))


def _head(head_fn, head_params, targets, seed: float):
    """head(y, k, here) -> (loss, d_head, dy): microbatch k's loss from the last chunk's
    output y and its gradients (seeded with `seed`), on the device where `here`; zeros
    elsewhere. `targets`: the microbatches' (m, mb, ...) arrays, or a tree of them."""
    def on_this_device(y, k):
        loss, vjp = jax.vjp(lambda h, y: head_fn(h, y, micro(targets, k)), head_params, y)
        d_head, dy = vjp(jnp.asarray(seed, loss.dtype))
        return loss, d_head, dy

    def elsewhere(y, k):
        return jnp.zeros(()), jax.tree.map(jnp.zeros_like, head_params), jnp.zeros_like(y)

    return lambda y, k, here: jax.lax.cond(here, on_this_device, elsewhere, y, k)


def _split_vjp(stage_fn, chunk, example: jax.Array, side_example=None, fixed=None):
    """The stage's forward and backward passes as two functions joined by arrays:
    forward(chunk, x, side, fixed) -> (y, residuals), backward(chunk, residuals, dy, fixed)
    -> (d_chunk, dx), and the residuals' shapes; `fixed`: weights of the chunk that are not
    differentiated (frozen ones). The weights are left out of the residuals: the backward
    pass reads them again rather than a copy being kept per microbatch in flight. What it
    reads of the side inputs is a residual."""
    found = {}

    def structure(chunk, x, side, fixed):
        _, vjp = jax.vjp(lambda chunk, x: stage_fn(chunk, x, side, fixed), chunk, x)
        leaves, found["tree"] = jax.tree.flatten(vjp)
        weights = jax.tree.leaves((chunk, fixed))
        # For each leaf of the backward pass, which weight it is (-1: a residual).
        found["where"] = tuple(next((j for j, w in enumerate(weights) if leaf is w), -1) for leaf in leaves)
        return [leaf for leaf, j in zip(leaves, found["where"]) if j < 0]

    shapes = jax.eval_shape(structure, chunk, example, side_example, fixed)
    tree, where = found["tree"], found["where"]

    def forward(chunk, x, side=None, fixed=None):
        y, vjp = jax.vjp(lambda chunk, x: stage_fn(chunk, x, side, fixed), chunk, x)
        return y, [leaf for leaf, j in zip(jax.tree.leaves(vjp), where) if j < 0]

    def backward(chunk, residuals, cotangent, fixed=None):
        weights, kept = jax.tree.leaves((chunk, fixed)), iter(residuals)
        return jax.tree.unflatten(tree, [weights[j] if j >= 0 else next(kept) for j in where])(cotangent)

    return forward, backward, shapes


def _order(i, p: int, v: int):
    """A stage's i-th forward (or backward) iteration -> (round, microbatch, its forward
    iteration): microbatches go around the ring in groups of p, each group v times
    before the next group starts, so what stage 0 receives from the last stage is what
    it runs next (no queue). Backward runs the rounds of a group in reverse."""
    group, rest = i // (p * v), i % (p * v)
    return rest // p, group * p + rest % p, group * p * v


def one_f_one_b(mesh, schedule: Schedule, stage_fn, head_fn, blocks, head, x: jax.Array, targets,
                rows: jax.P, statistics_weights=None, side=None, fixed=None):
    """Loss and gradients with the 1F1B schedule, or interleaved 1F1B (`repeats` v > 1:
    stage s holds chunks s, s+p, ... stored as for circular), with no `jax.grad` around
    it: the backward pass is interleaved with the forward here.

    `stage_fn(chunk, x, side) -> (y, statistics)` runs a chunk of the stage's layers on one
    microbatch (statistics and side inputs as for `pipeline`); `head_fn(head, y, targets) ->
    loss` is the loss of one microbatch from the last stage's output (its mean, or its
    share of the step's: the schedule averages them), `head` the parameters it uses
    (replicated over pp). `statistics_weights(statistics) -> weights`: how much
    each statistic adds to what is minimized, per microbatch of the whole batch (e.g. an
    MoE balance loss's weight over the number of MoE layers); None: nothing.
    x: (m, mb, ...) embedded microbatches, split over pp along m; targets (m, mb, ...), or
    a tree of such arrays; `rows`: one microbatch's spec; `side`: the microbatches' side inputs;
    `fixed`: stacked weights stored as `blocks` are, which the stages read but which are not
    differentiated (a frozen base), passed to `stage_fn(chunk, x, side, fixed_chunk)`.
    Returns (loss, d_blocks, d_head, dx, statistics): the mean loss, the gradients of the
    stacked layers (split over pp) and of `head`, dx, the gradient of x (laid out like x),
    from which the embedding's follows, and the layers' statistics (`layer_statistics`)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    slots = schedule.residual_slots
    # The last stage's backward of a microbatch's last round runs in the tick of its
    # forward (the head's gradient at hand): stage p-1's first forward of round v-1.
    first_backward = v * p - 1

    def run(blocks, head_params, x, targets, side, fixed):
        stage, x = jax.lax.axis_index(AXIS), x[0]
        last = stage == p - 1
        chunks, fixed_chunks = (jax.tree.map(lambda w: stage_view(w, v), tree) for tree in (blocks, fixed))
        if v == 1:  # the same weights every tick: nothing picked
            def pick(r, chunks=chunks):
                return jax.tree.map(lambda w: w[0], chunks)
        else:
            def pick(r, chunks=chunks):
                return jax.tree.map(lambda w: w[r], chunks)
        dp = jax.lax.psum(1, BATCH_AXIS)
        seed = 1.0 / (m * dp)  # each dp shard's microbatch loss is a mean over its own rows
        forward, backward, shapes = _split_vjp(stage_fn, pick(0), x[0], micro(side, 0), pick(0, fixed_chunks))
        no_stats = _no_statistics(stage_fn, chunks, x[0], micro(side, 0), fixed_chunks)
        stats_weights = _weighted_statistics(no_stats, statistics_weights, seed)
        head = _head(head_fn, head_params, targets, seed)

        def tick(carry, t, *, forwards: bool, backwards: bool):
            arrived, returned, ring, d_chunks, d_head, loss, dx, totals = carry
            if forwards:
                i = t - stage
                r, k, _ = _order(i, p, v)
                valid = (i >= 0) & (i < v * m)
                k = jnp.clip(k, 0, m - 1)
                # Stage 0 starts a microbatch's first round from x; later rounds continue
                # from what the last stage sent it in the previous tick.
                inp = jnp.where((stage == 0) & (r == 0), x[k], arrived)
                (y, stats), residuals = forward(pick(r), inp, micro(side, k), pick(r, fixed_chunks))
                totals = _statistics(stats, valid, r, totals)
                ring = [buf.at[i % slots].set(res) for buf, res in zip(ring, residuals)]
                final = last & (r == v - 1)
                head_loss, head_grads, dy = head(y, k, final)
                keep = valid & final
                loss = loss + jnp.where(keep, head_loss, 0.0)
                d_head = jax.tree.map(lambda acc, g: acc + jnp.where(keep, g, 0), d_head, head_grads)
                arrived = jax.lax.ppermute(y, AXIS, _ring(p, 1))
            if backwards:
                j = t - first_backward - (p - 1 - stage)
                rest, k, group_start = _order(j, p, v)
                r = v - 1 - rest
                valid = (j >= 0) & (j < v * m)
                # Its forward's iteration, whose residuals the ring holds (a forward's
                # residuals live at most 2(vp-1) ticks: 2vp-1 slots).
                i = group_start + r * p + j % p
                cotangent = jnp.where(last & (r == v - 1), dy, returned) if forwards else returned
                d_chunk, d_inp = backward(pick(r), [buf[i % slots] for buf in ring], (cotangent, stats_weights),
                                          pick(r, fixed_chunks))
                d_chunks = jax.tree.map(lambda acc, g: acc.at[r].add(jnp.where(valid, g, 0)), d_chunks, d_chunk)
                slot = jnp.clip(k, 0, m - 1)
                dx = dx.at[slot].set(jnp.where(valid & (stage == 0) & (r == 0), d_inp, dx[slot]))
                returned = jax.lax.ppermute(d_inp, AXIS, _ring(p, -1))
            return (arrived, returned, ring, d_chunks, d_head, loss, dx, totals), None

        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        ring = [jnp.zeros((slots, *s.shape), s.dtype) for s in shapes]
        carry = (jnp.zeros_like(x[0]), jnp.zeros_like(x[0]), ring, zeros(chunks), zeros(head_params), jnp.zeros(()),
                 jnp.zeros_like(x), no_stats)
        # Warm-up (forwards only), steady state (both), cool-down (backwards only).
        both = v * m + p - 1
        phases = ((0, first_backward, True, False), (first_backward, both - first_backward, True, True),
                  (both, first_backward, False, True))
        for start, length, forwards, backwards in phases:
            body = functools.partial(tick, forwards=forwards, backwards=backwards)
            carry, _ = jax.lax.scan(body, carry, start + jnp.arange(length))
        _, _, _, d_chunks, d_head, loss, dx, totals = carry
        d_blocks = jax.tree.map(lambda g, w: g.reshape(w.shape), d_chunks, blocks)
        loss = jax.lax.psum(loss, AXIS) / m
        return (jax.lax.pmean(loss, BATCH_AXIS), jax.lax.psum(d_blocks, BATCH_AXIS),
                jax.lax.psum(d_head, MANUAL_AXES), _only_stage_0(dx, stage), _stage_statistics(totals, m))

    copies = jax.P(AXIS, None, BATCH_AXIS)
    per_microbatch = jax.P(None, BATCH_AXIS)
    loss, d_blocks, d_head, dx, stats = jax.shard_map(
        run, mesh=mesh, in_specs=(stacked_spec(v), jax.P(), copies, per_microbatch, per_microbatch, stacked_spec(v)),
        out_specs=(jax.P(), stacked_spec(v), jax.P(), copies, jax.P(AXIS)), axis_names=frozenset(MANUAL_AXES),
        check_vma=False,
    )(blocks, head, _copies(x, mesh, rows), targets, side, fixed or {})
    return loss, d_blocks, d_head, _from_stage_0(dx, mesh, rows), layer_statistics(stats)
