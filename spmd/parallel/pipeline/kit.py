"""What every schedule's tick is made of: the microbatches' copies into the stages and
out of stage 0 (or, `Conveyor`, moved to where they enter a rank at a time), a chunk run
on one microbatch, the statistics summed over ticks, the head's loss and gradient on the
last stage, and a stage's forward and backward passes as two functions joined by arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.annotate import RUNS_SCOPE
from spmd.parallel.pipeline.schedule import AXIS, map_batch_axes


def ring_pairs(p: int, shift: int) -> list[tuple[int, int]]:
    return [(s, (s + shift) % p) for s in range(p)]


def stage_copies(x: jax.Array, mesh, rows: jax.P) -> jax.Array:
    """Microbatches (m, ...), split over pp along m -> one copy per stage (p, m, ...),
    split over pp along the copies: an all-gather over pp (stage 0 reads its copy). Done
    outside the map, where XLA keeps the rows laid out as `rows` says (one microbatch's
    spec: batch axes, and sp on the sequence), and the copies' gradients are summed there
    too: a reduce-scatter."""
    p = mesh.shape[AXIS]
    return jax.lax.with_sharding_constraint(jnp.broadcast_to(x, (p, *x.shape)),
                                            jax.NamedSharding(mesh, jax.P(AXIS, None, *rows)))


def from_stage_0(per_stage: jax.Array, mesh, rows: jax.P) -> jax.Array:
    """Each stage's (m, ...) results, zero but on stage 0 -> stage 0's, split over pp along
    m: a reduce-scatter over pp (and its gradient an all-gather)."""
    return jax.lax.with_sharding_constraint(jnp.sum(per_stage, axis=0),
                                            jax.NamedSharding(mesh, jax.P(AXIS, *rows)))


def add_statistics(stats: dict, valid, repeat, totals: dict) -> dict:
    """Add a tick's statistics (a chunk's MoE layers' on one microbatch) to `totals`
    (one entry per chunk, `repeat` the tick's), if the tick computed a real microbatch."""
    return jax.tree.map(lambda total, x: total.at[repeat].add(jnp.where(valid, x, 0)), totals, stats)


def stage_statistics(totals: dict, m: int) -> dict:
    """The stage's statistics: means over its microbatches and the map's batch shards, with
    a leading stage axis (the map's output is split over pp along it)."""
    return jax.tree.map(lambda total: jax.lax.pmean(total / m, map_batch_axes())[None], totals)


def layer_statistics(per_stage: dict) -> dict:
    """(stages, chunks, layers per chunk, ...) statistics -> (layers, ...), in the order the
    stacked layers are stored (chunk-major: `stacked_spec`), which per-layer state updated
    from them (the MoE layers' router, spmd.parallel.balance) follows."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[3:]), per_stage)


def only_stage_0(x: jax.Array, stage: jax.Array) -> jax.Array:
    return jnp.where(stage == 0, x, jnp.zeros_like(x))[None]


def counted_switch(which: list[int], branches: list):
    """A scan body (carry, (t, i)) -> branches[i](carry, t), for a scan over
    `len(which)` steps whose i-th runs branch which[i]. Each branch runs under a name
    scope saying how many of the loop's trips take it, which the compiled program keeps
    in its metadata: the planner weighs the branch's collectives and FLOPs by it."""
    def counted(branch, runs):
        def run(carry, t):
            with jax.named_scope(RUNS_SCOPE.format(runs, len(which))):
                return branch(carry, t)
        return run
    counted_branches = [counted(b, which.count(i)) for i, b in enumerate(branches)]
    return lambda carry, step: jax.lax.switch(step[1], counted_branches, carry, step[0])


def micro(side, k):
    """Microbatch k's side inputs (None: none)."""
    return jax.tree.map(lambda s: s[k], side)


def run_chunk(stage_fn, policy, chunks, repeat, x, side, fixed=None):
    """stage_fn on chunk `repeat` of the stage's layers (chunks: (v, layers, ...)), with
    that chunk's part of `fixed` (what the stages read but do not differentiate, stored
    as the chunks are).

    Autodiff of the tick loop keeps what the stage computes from its weights each tick:
    with one chunk (v = 1) the weights are the same every tick and nothing is copied; with
    several, the chunk picked each tick would be kept once per tick, so the tick runs under
    the model's remat `policy` (a picked chunk is neither a matmul output nor a named
    activation: the backward pass picks it again). Under remat "full" that runs the
    tick's forward once more in the backward pass."""
    def run(chunks, fixed, repeat, x, side):
        chunk, fixed_chunk = jax.tree.map(lambda w: w[repeat], (chunks, fixed))
        return stage_fn(chunk, x, side, fixed_chunk)

    if jax.tree.leaves(chunks)[0].shape[0] == 1:
        return run(chunks, fixed, 0, x, side)
    return jax.checkpoint(run, policy=policy)(chunks, fixed, repeat, x, side)


def no_statistics(stage_fn, chunks, x, side, fixed=None, count: int | None = None) -> dict:
    """Zeros shaped like what `stage_fn` reports for one chunk, one entry per chunk:
    `chunks` stacked (their count leading), or one chunk (and `fixed`'s) and their `count`."""
    if count is None:
        first = lambda tree: jax.tree.map(lambda w: w[0], tree)  # noqa: E731
        chunks, fixed, count = first(chunks), first(fixed), jax.tree.leaves(chunks)[0].shape[0]
    shapes = jax.eval_shape(stage_fn, chunks, x, side, fixed)[1]
    return jax.tree.map(lambda s: jnp.zeros((count, *s.shape), s.dtype), shapes)


def weighted_statistics(no_stats: dict, statistics_weights, seed: float) -> dict:
    """What each statistic of one chunk adds to what is minimized, per microbatch of the
    whole batch (zeros if nothing: `statistics_weights` None)."""
    weights = jax.tree.map(lambda total: total[0], no_stats)
    return weights if statistics_weights is None else jax.tree.map(lambda w: seed * w, statistics_weights(weights))


def head_vjp(head_fn, head_params, targets, seed: float, example: jax.Array):
    """head(y, k, here, d_head, keep) -> (metrics, d_head, dy): on the device where `here`,
    microbatch k's metrics from the last chunk's output y (`head_fn(head, y, targets) ->
    (loss to minimize, metrics)`), the sum `d_head` with the gradients of what it minimizes
    (seeded with `seed`) where `keep`, and the gradient dy; elsewhere zeros and `d_head` as
    it was. The sum is made inside the conditional: one returning the gradients alone wrote
    head-sized zeros elsewhere and kept its results beside the sum (DeepSeek-V3's 2,048-GPU
    layout: XLA:CPU's peak 107.1 -> 100.5 GiB). `targets`: the microbatches' (m, mb, ...)
    arrays, or a tree of them; `example`: an output y. Also returns the metrics' zeros, to
    sum them from."""
    def on_this_device(y, k, d_head, keep):
        _, vjp, metrics = jax.vjp(lambda h, y: head_fn(h, y, micro(targets, k)), head_params, y, has_aux=True)
        grads, dy = vjp(jnp.asarray(seed, jnp.float32))
        return metrics, jax.tree.map(lambda acc, g: acc + jnp.where(keep, g, 0), d_head, grads), dy

    shapes = jax.eval_shape(on_this_device, example, 0, head_params, True)[0]
    no_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def elsewhere(y, k, d_head, keep):
        return no_metrics, d_head, jnp.zeros_like(y)

    def head(y, k, here, d_head, keep):
        return jax.lax.cond(here, on_this_device, elsewhere, y, k, d_head, keep)
    return head, no_metrics


def add_metrics(totals: dict, metrics: dict, keep) -> dict:
    """The head's metrics summed over the microbatches it ran on (`keep`)."""
    return jax.tree.map(lambda total, x: total + jnp.where(keep, x, 0.0), totals, metrics)


def mean_metrics(totals: dict, m: int) -> dict:
    """The summed metrics (on the last stage or stages, zeros elsewhere) as means over the
    m microbatches and the map's batch shards."""
    return jax.tree.map(lambda total: jax.lax.pmean(jax.lax.psum(total, AXIS) / m, map_batch_axes()), totals)


def split_vjp(stage_fn, chunk, example: jax.Array, side_example=None, fixed=None):
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


@dataclasses.dataclass(frozen=True)
class Conveyor:
    """The rows entering the stages at one device (`entry`, 0 or p-1), held where they
    are, not copied to every stage: the microbatches stay split over pp along m (rank j
    holds [j m/p, (j+1) m/p), as `to_microbatches` lays them out) and move one rank per
    pair of ticks towards the entry, so that the i-th to enter, microbatch first + step i
    (those nearest the entry first), reaches it at pair i. Rank j holds the
    (σ + |j - entry|)-th at pair σ: its own, or what came from the rank beyond it. Their
    gradients go back the same way, the i-th leaving the entry at pair `lag` + i, each
    kept by its home rank. Each rank holds its m/p microbatches and their gradients, and
    one of each in flight."""
    p: int
    m: int
    entry: int
    first: int
    step: int  # +1 (entering at 0) or -1 (entering at p-1)
    count: int

    @property
    def per_rank(self) -> int:
        return self.m // self.p

    def microbatch(self, i):
        """The i-th microbatch to enter here."""
        return self.first + self.step * i

    @property
    def reach(self) -> int:
        """The farthest home from the entry, in ranks."""
        ends = (self.first, self.microbatch(self.count - 1))
        return max(abs(k // self.per_rank - self.entry) for k in ends)

    def _distance(self, stage):
        return jnp.abs(stage - self.entry)

    def _towards(self, sign: int) -> list[tuple[int, int]]:
        step = -sign if self.entry == 0 else sign
        return [(j, j + step) for j in range(self.p) if 0 <= j + step < self.p]

    def feed(self, queue: jax.Array, received: jax.Array, pair, stage, send: bool = True):
        """The microbatch rank `stage` holds at `pair` (the entry's to run), and what it
        receives for the next pair (nothing after the last: `send` false)."""
        k = self.microbatch(pair + self._distance(stage))
        slot = jnp.clip(k - stage * self.per_rank, 0, self.per_rank - 1)
        item = jnp.where(k // self.per_rank == stage, queue[slot], received)
        return item, jax.lax.ppermute(item, AXIS, self._towards(1)) if send else received

    def carry_back(self, kept: jax.Array, received: jax.Array, produced: jax.Array, pair, stage, lag: int,
                   send: bool = True):
        """Gradients (m/p, ...) kept by rank `stage` after `pair`, given what the entry
        produced in it, and what it receives for the next pair (`send`, as for `feed`)."""
        item = jnp.where(stage == self.entry, produced, received)
        i = pair - lag - self._distance(stage)
        k = self.microbatch(i)
        slot = jnp.clip(k - stage * self.per_rank, 0, self.per_rank - 1)
        mine = (k // self.per_rank == stage) & (i >= 0) & (i < self.count)
        kept = kept.at[slot].set(jnp.where(mine, item, kept[slot]))
        return kept, jax.lax.ppermute(item, AXIS, self._towards(-1)) if send else received
