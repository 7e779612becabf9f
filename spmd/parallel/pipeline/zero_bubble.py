"""The zb-v pipeline schedule (zero bubble, V-shaped placement, after ZB-V and DualPipeV)
and DualPipe (`Route`: the same machine with two directions), both with each chunk's
backward pass split into its input-gradient (B) and weight-gradient (W) parts
(spmd.parallel.pipeline.split).

Placement: the stacked layers are cut into 2p chunks (virtual stages c = 0 .. 2p-1);
device d runs chunk d going down and chunk 2p-1-d coming back up, so device 0 holds the
first chunk (the embedded rows enter there) and the last (the head and loss run there).
They are stored as circular's (2, layers/2) stack, where device d holds chunks d and
p+d: the second chunk is exchanged once per step as the map begins (device d gets chunk
2p-1-d from device p-1-d), and its gradient goes back as it ends. That keeps checkpoints,
restacking and export as circular's, for one permute of half the stage's weights (and of
their gradients) per step.

Ticks (lockstep, as 1f1b): microbatch k's forward at virtual stage c runs in tick
2k + c, so a device runs its two chunks on alternate ticks, one forward per tick; its
backward for the input (B) at tick (2p-1) + 2k + (2p-1-c), so the last chunk's B runs in
the tick of its forward, with the head's gradient at hand. A chunk's output goes down
(d -> d+1) for chunk 0 and up (d -> d-1) for chunk 1, and stays on device p-1 at the
turn: two fixed pairings of neighbours that alternate with the tick's parity, so ticks
run in pairs (static parity, one ppermute each way per tick). The weight gradients (W)
are deferred: each device runs its 2m W's, in the order of its B's, in the last 2m ticks
of the step, where every device has one pending. Executed per device: 2m + 2p - 2 chunk
forwards and as many B's (GPipe's (m + p - 1)/m of the useful ones) and exactly 2m W's:
with per-chunk costs f, b, w, executed/useful = 1 + (p-1)(f+b)/(m(f+b+w)), against
1F1B's 1 + (p-1)/m.

Under a remat policy (full, dots) the backward pass recomputes the matmuls' inputs from
what the forward kept, so B would need them itself and W would be empty. There each
chunk's whole backward runs in its B tick (`Schedule.defers_weights` false): the V
placement and timetable stay, the rings hold only what the policy keeps (a layer's
input, under full), and the bubble is 1F1B's (executed/useful 1 + (p-1)/m). For a
model whose activations do not fit otherwise (DeepSeek-V3 on 16 stages: 701 GiB per
device under "none"), that is the trade.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.annotate import RUNS_SCOPE
from spmd.parallel.pipeline.kit import (Conveyor, add_metrics, add_statistics, counted_switch, head_vjp,
                                        layer_statistics, mean_metrics, micro, no_statistics, stage_statistics,
                                        weighted_statistics)
from spmd.parallel.pipeline.schedule import (AXIS, Head, PipelineRun, Schedule, StageProgram, batch_axes, manual_axes,
                                             map_batch_axes, stage_view, summed_over_shards)
from spmd.parallel.pipeline.split import split_backward, whole_backward

# ------------------------------------------------------------------------- the schedule

def _pairs(p: int, parity: int, down: bool) -> list[tuple[int, int]]:
    """Who sends to whom in a tick of `parity`. Forwards (`down`): device d runs chunk 0
    when d + parity is even and sends down (d -> d+1), else chunk 1 and sends up. B's
    (not `down`): chunk 1's B runs on the other parity and sends down, chunk 0's up.
    Sends past the ends stay put: the turn at p-1, the head and dx at device 0."""
    out = []
    for d in range(p):
        goes_down = ((d + parity) % 2 == 0) == down
        to = d + 1 if goes_down else d - 1
        if 0 <= to < p:
            out.append((d, to))
    return out


def _send(x: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
    # (with p = 2 every other tick sends nothing: no collective for it)
    return jax.lax.ppermute(x, AXIS, pairs) if pairs else jnp.zeros_like(x)


def sends(p: int, m: int, dual: bool = False) -> int:
    """Activations (forward outputs and input gradients) a step sends between stages:
    one collective-permute per tick and kind of work whose pairing is not empty."""
    table = timetable(p, m, dual=dual)
    forward = sum(1 for t in range(table["f_end"]) if _pairs(p, t % 2, True))
    backward = sum(1 for t in range(table["first_b"], table["ticks"]) if _pairs(p, t % 2, False))
    return forward + backward


def conveyed(p: int, m: int, dual: bool = False) -> tuple[int, int]:
    """Microbatches a rank sends moving rows to where they enter, and their gradients back
    (one collective-permute per pair and Conveyor, in the pairs the timetable gives)."""
    table, ends = timetable(p, m, dual=dual), len(Route(p, m, dual).conveyors())
    first, last = table["returns"]
    return ends * (table["feeds"] - 1), ends * (last - first)  # (none after the last pair of each)


def timetable(p: int, m: int, defers_weights: bool = True, dual: bool = False):
    """The static plan of a step: where forwards, B's and W's run (forwards in [0, f_end),
    B's from first_b, W's from w_start, to `ticks`), each device's W's in order (a numpy
    table: chunk, microbatch, its forward's tick, its B's tick), and the rings' sizes
    (longest lifetimes + 1). Each tick's forward and B follow from the tick's parity
    (`zb_v`). Checks that every W comes after its B and every B after its forward.
    Without `defers_weights` there are no W's (B's run the whole backward). `dual`:
    DualPipe's two directions (`Route`), microbatch k of a chunk being its k-th."""
    route = Route(p, m, dual)
    first_b, n = route.first_b, route.per_chunk
    ticks = 2 * route.span + 2 * n - 3
    # Pairs of ticks that move rows to where they enter, and their gradients back (Conveyor).
    moves = dict(feeds=n, returns=(first_b, first_b + n - 1 + max(c.reach for c in route.conveyors())))
    f_at, b_at = {}, {}  # (device, chunk, k) -> tick
    for d in range(p):
        for k in range(n):
            f_at[d, 0, k], f_at[d, 1, k] = 2 * k + route.offset(d, 0), 2 * k + route.offset(d, 1)
            b_at[d, 1, k], b_at[d, 0, k] = first_b + 2 * k + route.offset(d, 0), first_b + 2 * k + route.offset(d, 1)
    f_end = max(f_at.values()) + 1
    if not defers_weights:
        b_life = max(b_at[key] - f_at[key] for key in f_at)
        return dict(ticks=ticks, f_end=f_end, first_b=first_b, w_start=ticks, w_order=np.zeros((p, 0, 4), np.int32),
                    slots=(b_life + 1, 0, 0), **moves)
    w_start = ticks - 2 * n
    # Each device's B's in tick order; its i-th W runs in tick w_start + i.
    w_order = np.zeros((p, 2 * n, 4), np.int32)  # chunk, microbatch, forward tick, B tick
    b_life = w_life = bw_life = 0
    for d in range(p):
        order = sorted(((b_at[d, c, k], c, k) for c in (0, 1) for k in range(n)))
        for i, (tb, c, k) in enumerate(order):
            tf, tw = f_at[d, c, k], w_start + i
            assert tf <= tb <= tw, (d, c, k, tf, tb, tw)
            w_order[d, i] = (c, k, tf, tb)
            b_life, w_life, bw_life = max(b_life, tb - tf), max(w_life, tw - tf), max(bw_life, tw - tb)
    return dict(ticks=ticks, f_end=f_end, first_b=first_b, w_start=w_start, w_order=w_order,
                slots=(b_life + 1, w_life + 1, bw_life + 1), **moves)


def executed_over_useful(p: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, dual: bool = False) -> float:
    """Executed stage compute over the useful, for per-chunk costs f, b, w: forwards and
    B's in 2n + span - 2 ticks each, W's in 2n (`timetable`). zb-v (n = m, span = 2p, a
    chunk half a stage): 1 + (p-1)(f+b)/(m(f+b+w)); DualPipe (n = m/2, span = p, a chunk
    a whole stage): 1 + (p-2)(f+b)/(m(f+b+w))."""
    route = Route(p, m, dual)
    n = route.per_chunk
    return ((2 * n + route.span - 2) * (f + b) + 2 * n * w) / (2 * n * (f + b + w))


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a microbatch goes. zb-v (the V): each of the m goes down device 0 .. p-1
    through chunk 0 and back up through chunk 1, 2p virtual stages (`span`), its loss on
    device 0. DualPipe (`dual`): device d holds stage d as chunk 0 and stage p-1-d as
    chunk 1; m/2 microbatches go down through chunk 0 (loss on device p-1), the other m/2
    up through chunk 1 (loss on device 0), p virtual stages each. In both, chunk c's k-th
    microbatch reaches device d in tick 2k + offset(d, c), and its B runs in tick
    first_b + 2k + offset(d, 1 - c): the same parities, so the same pairings of sends."""
    p: int
    m: int
    dual: bool = False

    @property
    def span(self) -> int:
        return self.p if self.dual else 2 * self.p

    @property
    def per_chunk(self) -> int:
        """Microbatches through each of a device's two chunks."""
        return self.m // 2 if self.dual else self.m

    @property
    def first_b(self) -> int:
        return self.span - 1

    def offset(self, d, c):
        """d for chunk 0, span - 1 - d for chunk 1 (numbers or traced values)."""
        return d + c * (self.span - 1 - 2 * d)

    def microbatch(self, k, c):
        """The step's microbatch that is chunk c's k-th (DualPipe's second direction
        takes the last first: those held nearest device p-1, where they enter)."""
        return k + c * (self.m - 1 - 2 * k) if self.dual else k

    def enters(self, d, c):
        """Whether chunk c on device d reads the embedded rows (else what a neighbour sent)."""
        return (d == 0) & (c == 0) | (self.dual & (d == self.p - 1) & (c == 1))

    def leaves(self, d, c):
        """Whether chunk c on device d is a microbatch's last: the head and loss follow."""
        return (d == 0) & (c == 1) | (self.dual & (d == self.p - 1) & (c == 0))

    def conveyors(self) -> list[Conveyor]:
        """Where the rows enter: device 0 (microbatch k in the even tick 2k) and, DualPipe,
        device p-1 for the second half; the gradients leave there first_b pairs later."""
        n = self.per_chunk
        ends = [Conveyor(self.p, self.m, 0, 0, 1, n)]
        return ends + [Conveyor(self.p, self.m, self.p - 1, self.m - 1, -1, n)] if self.dual else ends


def zb_v(run: PipelineRun, stages: StageProgram, head: Head, x: jax.Array, targets):
    """Loss and gradients with the zb-v or the DualPipe schedule; arguments and results as
    `spmd.parallel.pipeline.one_f_one_b`'s (zb-v's blocks stored as circular's with 2
    chunks, DualPipe's as 1f1b's)."""
    mesh, schedule, rows, specs = run
    p, m, dual = schedule.stages, schedule.microbatches, schedule.name == "dualpipe"
    table = timetable(p, m, schedule.defers_weights, dual)
    mirror = [(s, p - 1 - s) for s in range(p)]  # zb-v: chunk p+s is chunk 2p-1-(p-1-s); DualPipe: stage p-1-s

    def chunks_of(tree) -> list:
        # The device's two chunks: its own, and the second from device p-1-d, zb-v's
        # stored second chunk (chunk 2p-1-d), DualPipe's whole stage (stage p-1-d). Kept
        # apart, as they are (`_VStage.on_slot`): in one stack, or two arrays in the order
        # the ticks run them, XLA:GPU held copies of whole stages (docs/deepseek.md).
        view = lambda w: stage_view(w, 1 if dual else 2)  # noqa: E731
        return [jax.tree.map(lambda w: view(w)[0], tree),
                jax.tree.map(lambda w: jax.lax.ppermute(view(w)[1 - dual], AXIS, mirror), tree)]

    def stored(own, other):
        # Chunk 2p-1-d's gradient back to where it is stored; DualPipe's added to the stage's own.
        back = jax.lax.ppermute(other, AXIS, mirror)
        return (own + back)[None] if dual else jnp.stack([own, back])

    def on_device(blocks, head_params, x, targets, side, fixed):
        odd = jax.lax.axis_index(AXIS) % 2 == 1
        chunks, fixed_chunks = chunks_of(blocks), chunks_of(fixed)
        stage = _VStage.of(schedule, table, stages._replace(blocks=chunks, side=side, fixed=fixed_chunks),
                           head._replace(params=head_params), x, targets)
        carry = stage.start(head_params)
        # One loop over every pair, each doing its kinds of work (a switch): with a scan per
        # run (one-pair runs unrolled), XLA:GPU's program sent 1.06 to 1.18 times the pp
        # bytes the timetable makes (docs/deepseek.md).
        kinds, which = _kinds_of_pairs(table)
        branches = [functools.partial(stage.pair, first_kinds=f, second_kinds=s, feeds=fe, returns=r)
                    for f, s, fe, r in kinds]
        carry, _ = jax.lax.scan(counted_switch(which, branches), carry,
                                (2 * jnp.arange(len(which)), jnp.asarray(which, jnp.int32)))
        # The last gradients on their way home, after the last tick.
        after, last = (table["ticks"] + 1) // 2, table["returns"][1]
        if last > after:
            carry, _ = jax.lax.scan(lambda c, q: (stage.carry_back(c, q), None), carry, jnp.arange(after, last))
        if last >= after:
            carry = stage.carry_back(carry, last, send=False)
        d_chunks = [stored(jnp.where(odd, g[1], g[0]), jnp.where(odd, g[0], g[1])) for g in carry.d_chunks]  # by slot
        d_blocks = jax.tree.map(lambda g, w: g.reshape(w.shape), jax.tree.unflatten(jax.tree.structure(blocks), d_chunks),
                                blocks)
        stats = stage_statistics(carry.totals, m)
        if dual:  # the mirror stage's added to the stage's own, as its gradients are
            stats = jax.tree.map(lambda s: stored(s[0, 0], s[0, 1])[None], stats)
        return (mean_metrics(carry.metrics, m), summed_over_shards(d_blocks, specs.blocks),
                summed_over_shards(carry.d_head, specs.head, also=(AXIS,)), carry.dx, stats)

    # The rows stay split over pp along m (each rank its own microbatches and their
    # gradients: Conveyor), the targets are every stage's.
    manual = manual_axes(mesh.shape)
    queue, per_microbatch = jax.P(AXIS, batch_axes(manual)), jax.P(None, batch_axes(manual))
    split = jax.NamedSharding(mesh, jax.P(AXIS, *rows))
    metrics, d_blocks, d_head, dx, stats = jax.shard_map(
        on_device, mesh=mesh, in_specs=(specs.blocks, specs.head, queue, per_microbatch, per_microbatch, specs.fixed),
        out_specs=(jax.P(), specs.blocks, specs.head, queue, jax.P(AXIS)), axis_names=frozenset(manual),
        check_vma=False,
    )(stages.blocks, head.params, jax.lax.with_sharding_constraint(x, split), targets, stages.side, stages.fixed or {})
    # zb-v: device d's second chunk is stored on device p-1-d, and its statistics go there.
    if not dual:
        stats = jax.tree.map(lambda x: jnp.stack([x[:, 0], x[::-1, 1]], axis=1), stats)
    return metrics, d_blocks, d_head, jax.lax.with_sharding_constraint(dx, split), layer_statistics(stats)


def _kinds_of_pairs(table: dict) -> tuple[list, list[int]]:
    """The distinct kinds of pair (`_runs_of_pairs`' keys), and each pair's index into them."""
    kinds, which = [], []
    for key, _, n in _runs_of_pairs(table):
        if key not in kinds:
            kinds.append(key)
        which += [kinds.index(key)] * n
    return kinds, which


def _runs_of_pairs(table: dict) -> list:
    """The ticks in pairs (even, odd), and runs of pairs that do the same kinds of work
    (forwards, B, W; moving rows in, gradients out) as [(kinds of the even tick, of the odd
    one, feeds, returns), first tick, pairs]. Moving: 0 no, 1 yes, 2 the last time
    (nothing sent on)."""
    def kinds(t):
        return (t < table["f_end"], table["first_b"] <= t, table["w_start"] <= t)

    runs = []
    for t in range(0, table["ticks"] + table["ticks"] % 2, 2):
        first, last, pair = *table["returns"], t // 2
        feeds = 0 if pair >= table["feeds"] else 2 if pair == table["feeds"] - 1 else 1
        returns = 0 if not first <= pair <= last else 2 if pair == last else 1
        key = (kinds(t), kinds(t + 1) if t + 1 < table["ticks"] else (False, False, False), feeds, returns)
        if runs and runs[-1][0] == key:
            runs[-1][2] += 1
        else:
            runs.append([key, t, 1])
    return runs


class _VCarry(NamedTuple):
    """What a zb-v stage's ticks carry."""
    f_in: jax.Array  # the activation a neighbour sent forward
    f_own: jax.Array  # this device's last forward output (the V's turn: the last device feeds itself)
    b_in: jax.Array  # the gradient a neighbour sent back
    b_own: jax.Array
    b_ring: list  # what B reads of each forward, W's of each forward, W's of each B
    w_ring: list
    bw_ring: list
    d_chunks: list  # the gradients of the device's two chunks (flat leaves), by slot (`_VStage.slot`)
    d_head: dict
    metrics: dict  # the head's, summed
    totals: dict
    fed: list  # per Conveyor: the microbatch received for the next pair
    entering: jax.Array  # this pair's microbatch entering on this device
    back: list  # per Conveyor: the gradient received for the next pair
    d_entry: jax.Array  # the gradient of the rows that entered, produced this pair
    dx: jax.Array  # the gradients of this rank's microbatches (m/p, ...)


@dataclasses.dataclass(frozen=True)
class _VStage:
    """One device of the V inside the map (chunks d and 2p-1-d): its F, B and W passes
    (split_backward, or one backward pass when weights are not deferred), the timetable's
    ring sizes and W order, the head's loss and gradient."""
    route: Route
    table: dict
    stage: jax.Array
    x: jax.Array  # this rank's microbatches (m/p, ...)
    side: object
    chunks: list  # [the device's own chunk, the other one]
    fixed_chunks: list
    passes: tuple  # forward, backward_input, backward_weight
    shapes: tuple  # of the three rings' entries
    no_stats: dict
    stats_weights: dict
    head: object
    no_metrics: dict

    @classmethod
    def of(cls, schedule: Schedule, table: dict, stages: StageProgram, head: Head, x, targets) -> _VStage:
        """The device inside the map: `stages` with its two chunks as the blocks and the
        fixed part (`zb_v`'s chunks_of), and its own microbatches and view of the `head`."""
        stage_fn, chunks, side, fixed_chunks = stages
        m = schedule.microbatches
        seed = 1.0 / (m * jax.lax.psum(1, map_batch_axes()))
        *passes, shapes = (split_backward if schedule.defers_weights else whole_backward)(
            stage_fn, chunks[0], x[0], micro(side, 0), fixed_chunks[0])
        no_stats = no_statistics(stage_fn, chunks[0], x[0], micro(side, 0), fixed_chunks[0], count=2)
        route = Route(schedule.stages, m, schedule.name == "dualpipe")
        return cls(route, table, jax.lax.axis_index(AXIS), x, side, chunks, fixed_chunks, tuple(passes),
                   shapes, no_stats, weighted_statistics(no_stats, head.statistics_weights, seed),
                   *head_vjp(head.fn, head.params, targets, seed, x[0]))

    def on_slot(self, at: int, fn):
        """fn(weights, fixed) on the chunk in slot `at` (`slot`): the device's own on even
        devices and the other on odd ones for slot 0, the reverse for slot 1. A
        conditional picks it, so that no stage is copied to be picked (the pass is
        compiled once per branch). Each branch says it runs on half the devices, which
        the planner reads (`RUNS_SCOPE`): the pass counted once."""
        def on(i):
            def run():
                with jax.named_scope(RUNS_SCOPE.format(1, 2)):
                    return fn(self.chunks[i], self.fixed_chunks[i])
            return run
        return jax.lax.cond(self.stage % 2 == 1, on(1 - at), on(at))

    def slot(self, c):
        """Chunk c's slot: the parity of the ticks whose forwards run it (chunk (t - d) % 2
        on device d), static in each tick where the chunk is not."""
        return (c + self.stage) % 2

    def start(self, head_params) -> _VCarry:
        ring = lambda shapes, n: [jnp.zeros((n, *s.shape), s.dtype) for s in shapes]  # noqa: E731
        zero = jnp.zeros_like(self.x[0])
        rings = [ring(shapes, n) for shapes, n in zip(self.shapes, self.table["slots"])]
        ends = len(self.route.conveyors())
        return _VCarry(zero, zero, zero, zero, *rings, [jnp.zeros((2, *w.shape), w.dtype)
                                                         for w in jax.tree.leaves(self.chunks[0])],
                       jax.tree.map(jnp.zeros_like, head_params), self.no_metrics, self.no_stats, [zero] * ends, zero,
                       [zero] * ends, zero, jnp.zeros_like(self.x))

    def pair(self, carry: _VCarry, t, *, first_kinds, second_kinds, feeds, returns):
        """Ticks t (even) and t + 1 (odd), each doing its kinds of work (forwards, B, W),
        with the rows entering in the even one moved there first (`feeds`) and the
        gradients leaving in it moved on after (`returns`)."""
        if feeds:
            carry = self.feed(carry, t // 2, send=feeds == 1)
        for parity, kinds in enumerate((first_kinds, second_kinds)):
            carry = self.tick(carry, t + parity, parity, *kinds)
        if returns:
            carry = self.carry_back(carry, t // 2, send=returns == 1)
        return carry, None

    def feed(self, s: _VCarry, pair, send: bool = True) -> _VCarry:
        """The microbatch entering on this device in `pair` (if any enters here)."""
        ends = self.route.conveyors()
        items, fed = zip(*(end.feed(self.x, r, pair, self.stage, send) for end, r in zip(ends, s.fed)))
        entering = items[0]
        for end, item in zip(ends[1:], items[1:]):
            entering = jnp.where(self.stage == end.entry, item, entering)
        return s._replace(fed=list(fed), entering=entering)

    def carry_back(self, s: _VCarry, pair, send: bool = True) -> _VCarry:
        """The gradients of the entering rows one rank further home after `pair`."""
        dx, back = s.dx, []
        for end, received in zip(self.route.conveyors(), s.back):
            dx, sent = end.carry_back(dx, received, s.d_entry, pair, self.stage, self.table["first_b"], send)
            back.append(sent)
        return s._replace(dx=dx, back=back)

    def tick(self, c: _VCarry, t, parity: int, forwards: bool, backwards: bool, weights: bool) -> _VCarry:
        dy = None
        if forwards:
            c, dy = self._forward(c, t, parity)
        if backwards:
            c = self._backward_input(c, t, parity, dy)
        if weights:
            c = self._backward_weight(c, t)
        return c

    def _microbatch(self, since_first, c):
        """Chunk c's k-th microbatch, `since_first` = 2k ticks after its first: k (clipped),
        the step's microbatch it is, and whether it is real."""
        n, k = self.route.per_chunk, since_first // 2
        k, valid = jnp.clip(k, 0, n - 1), (k >= 0) & (k < n)
        return k, self.route.microbatch(k, c), valid

    def _forward(self, s: _VCarry, t, parity: int) -> tuple[_VCarry, jax.Array]:
        p, slots = self.route.p, self.table["slots"]
        c = (t - self.stage) % 2  # chunk 0 on ticks of the device's parity
        _, k, valid = self._microbatch(t - self.route.offset(self.stage, c), c)
        # Otherwise what a neighbour sent, or at the V's turn (device p-1) its own output.
        inp = jnp.where(self.route.enters(self.stage, c), s.entering,
                        jnp.where((c == 1) & (self.stage == p - 1), s.f_own, s.f_in))
        (y, stats), b_res, w_res = self.on_slot(parity, lambda w, f: self.passes[0](w, inp, micro(self.side, k), f))
        final = self.route.leaves(self.stage, c)
        keep = valid & final
        head_metrics, d_head, dy = self.head(y, k, final, s.d_head, keep)
        return s._replace(
            f_in=_send(y, _pairs(p, parity, True)), f_own=y,
            b_ring=_write(s.b_ring, t % slots[0], b_res), w_ring=_write(s.w_ring, t % slots[1], w_res),
            d_head=d_head,
            metrics=add_metrics(s.metrics, head_metrics, keep), totals=add_statistics(stats, valid, c, s.totals)), dy

    def _backward_input(self, s: _VCarry, t, parity: int, dy) -> _VCarry:
        p, slots = self.route.p, self.table["slots"]
        t_b = t - self.table["first_b"]
        c = 1 - (t_b - self.stage) % 2  # chunk 1's B on the device's parity
        j, _, valid = self._microbatch(t_b - self.route.offset(self.stage, 1 - c), c)
        f_tick = 2 * j + self.route.offset(self.stage, c)
        # A microbatch's last chunk gets the head's gradient (computed in this tick's
        # forward), at the V's turn its own B's output, elsewhere what a neighbour sent.
        ct = jnp.where(self.route.leaves(self.stage, c), dy if dy is not None else s.b_in,
                       jnp.where((c == 0) & (self.stage == p - 1), s.b_own, s.b_in))
        at = (1 + parity + self.table["first_b"]) % 2  # chunk c's slot (`slot`), static
        b_ring, residuals = _read(s.b_ring, f_tick % slots[0])
        grads, d_inp, bw_res = self.on_slot(at, lambda w, f: self.passes[1](w, residuals, (ct, self.stats_weights), f))
        # B's output goes the other way from the forward's: chunk 1's down.
        return s._replace(
            b_in=_send(d_inp, _pairs(p, parity, False)), b_own=d_inp, b_ring=b_ring,
            bw_ring=_write(s.bw_ring, t % slots[2], bw_res),
            d_chunks=_accumulate(s.d_chunks, grads, at, valid),
            d_entry=jnp.where(valid & self.route.enters(self.stage, c), d_inp, s.d_entry))

    def _backward_weight(self, s: _VCarry, t) -> _VCarry:
        """W of the forward and B the timetable orders at tick t."""
        slots = self.table["slots"]
        c, _, f_tick, b_tick = (jnp.asarray(self.table["w_order"])[self.stage][t - self.table["w_start"], j]
                                for j in range(4))
        bw_ring, of_b = _read(s.bw_ring, b_tick % slots[2])
        w_ring, of_forward = _read(s.w_ring, f_tick % slots[1])
        grads = self.passes[2](of_b, of_forward)
        return s._replace(bw_ring=bw_ring, w_ring=w_ring, d_chunks=_accumulate(s.d_chunks, grads, self.slot(c), True))


def _read(ring: list, index) -> tuple[list, list]:
    """Entry `index` of each of a ring's buffers, and the ring to write to next, behind the
    read. Two ticks run in one loop trip, so the next write to a ring is in the same
    trip as this read: unordered, XLA copied the whole ring before it (two rings of 31
    forwards' residuals alive, 13.6 GiB each on DeepSeek-V3's layout)."""
    return jax.lax.optimization_barrier((ring, [buf[index] for buf in ring]))


def _write(ring: list, index, entries: list) -> list:
    """The ring with `entries` at `index`, behind a barrier: a read of the written ring in
    the same trip (W's, after the pair's second forward) was otherwise rewritten by XLA
    into a read of the ring before the write (a slice of an update is the update or the
    old entry), leaving the write and that read unordered on one buffer: XLA:GPU copied
    the ring to write it (W's two rings, 31 GiB on llama3-70b-128xh100-3d under zb-v)."""
    return jax.lax.optimization_barrier([buf.at[index].set(r) for buf, r in zip(ring, entries)])


def _accumulate(d_chunks: list, grads: list, at, valid) -> list:
    """Add a pass's gradients of the chunk in slot `at` (None where it computes none) where `valid`."""
    return [acc if g is None else acc.at[at].add(jnp.where(valid, g, 0)) for acc, g in zip(d_chunks, grads)]
