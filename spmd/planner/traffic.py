"""What one compiled step sends over the wire, per collective kind and mesh axis.

Bytes are what one device moves with the usual ring algorithms (DESIGN.md section 8):
all-reduce 2(N-1)/N of the buffer, all-gather, reduce-scatter and all-to-all (N-1)/N of
the full buffer, a collective-permute its buffer once. Each collective counts as often as
it runs in a step (loop trip counts included).

XLA's GPU and TPU compilers turn an all-reduce whose every use keeps only this device's
1/N slice into a reduce-scatter; XLA:CPU has no such pass and leaves the all-reduce plus
a dynamic-slice. Plans are made on emulated CPU devices for the accelerators they target,
so that pattern is reported as the reduce-scatter those compilers emit (and marked). Like
XLA's pass, it is recognised by shape: every use of the result is a dynamic slice of 1/k
of it, k the size of the innermost axes of the group. XLA:CPU also runs bf16 collectives
in float32 (converting up just before); those count at their bf16 size.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Mapping

import numpy as np

from spmd.parallel.mesh import AXES
from spmd.parallel.rules import TABLE, ZERO_AXES, ZERO_SHARDED_DIM, axes_of
from spmd.planner import hlo, offsets

_ELEMENTS = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Traffic:
    op: str
    axes: str  # mesh axes the groups run over, "+"-joined outer to inner; "?" if irregular
    count: int  # executions per step
    bytes_per_device: float  # per step
    from_all_reduce: bool = False  # split out of an all-reduce + slice (see the module doc)
    overlapped: float = 0.0  # of bytes_per_device, those of asynchronous collectives with compute under them


# ----------------------------------------------------------------------------- groups

def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def device_groups(attributes: str, num_devices: int) -> list[list[int]] | None:
    """The device groups of a collective, from any of XLA's replica-group syntaxes."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    if pairs:
        return [_ints(p) for p in re.findall(r"\{([\d,]+)\}", pairs.group(1) + "}")]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                     r"\s*\{([^}]*)\}", attributes)
    if mesh:
        names = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        sizes = [int(n) for _, n in names]
        ids = (_iota(_ints(mesh.group(2)), _ints(mesh.group(3)) if mesh.group(3) else None)
               if mesh.group(2) else np.arange(math.prod(sizes))).reshape(sizes)
        # Grouped axes: whole ('tp'), or a sub-axis ('tp':(4)2: the 2 after the first 4 of
        # tp's devices, major to minor), as newer XLA writes a part of an axis.
        grouped_axes = {name: (int(pre), int(size)) if size else None
                        for name, pre, size in re.findall(r"'(\w+)'(?::\((\d+)\)(\d+))?", mesh.group(4))}
        dims, grouped = [], []
        for name, n in zip((name for name, _ in names), sizes):
            if name in grouped_axes and grouped_axes[name]:
                pre, size = grouped_axes[name]
                grouped.append(len(dims) + 1)
                dims += [pre, size, n // (pre * size)]
            else:
                if name in grouped_axes:
                    grouped.append(len(dims))
                dims.append(n)
        return _groups_along(ids.reshape(dims), grouped)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota:
        ids = _iota(_ints(iota.group(3)), _ints(iota.group(4)) if iota.group(4) else None)
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if explicit:
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
        return groups or [list(range(num_devices))]
    return None


def _groups_along(ids: np.ndarray, axes: list[int]) -> list[list[int]]:
    """Groups of device ids that differ only along `axes` of the array `ids`."""
    rest = [i for i in range(ids.ndim) if i not in axes]
    moved = ids.transpose(rest + axes)
    return moved.reshape(-1, math.prod(ids.shape[i] for i in axes)).tolist()


@functools.lru_cache(maxsize=64)
def _partitions(shape: tuple[tuple[str, int], ...]) -> dict[frozenset, str]:
    """Every way to group the mesh's devices by a set of its axes -> that set's name."""
    names = [a for a, _ in shape]
    ids = np.arange(math.prod(n for _, n in shape)).reshape([n for _, n in shape])
    live = [i for i, (_, n) in enumerate(shape) if n > 1]
    out = {}
    for r in range(1, len(live) + 1):
        for axes in itertools.combinations(live, r):
            groups = _groups_along(ids, list(axes))
            out[frozenset(frozenset(g) for g in groups)] = "+".join(names[i] for i in axes)
    # Part of one axis: its devices cut into blocks of f neighbours ("tp:inner2", e.g. the
    # tp devices that share a key/value head) or every f-th of them ("tp:outer4").
    for i in live:
        n = shape[i][1]
        for f in (f for f in range(2, n) if n % f == 0):
            split = ids.reshape(*ids.shape[:i], n // f, f, *ids.shape[i + 1:])
            for axis, size, where in ((i + 1, f, "inner"), (i, n // f, "outer")):
                groups = _groups_along(split, [axis])
                out.setdefault(frozenset(frozenset(g) for g in groups), f"{names[i]}:{where}{size}")
    return out


def groups_along(label: str, mesh_shape: Mapping[str, int]) -> list[list[int]] | None:
    """The device groups of a collective over whole mesh axes `label` ("dp+fsdp"); None
    for a label of part of an axis or of irregular groups."""
    if not label or "?" in label or ":" in label:
        return None
    names = list(mesh_shape)
    ids = np.arange(math.prod(mesh_shape.values())).reshape(list(mesh_shape.values()))
    return [list(g) for g in _groups_along(ids, [names.index(a) for a in label.split("+")])]


def group_size(label: str, mesh_shape: Mapping[str, int]) -> int:
    """Devices in each group of a collective over `label` ("dp+tp", "tp:inner2")."""
    return math.prod(int(part.split(":")[1].lstrip("inerout")) if ":" in part else mesh_shape[part]
                     for part in label.split("+"))


def mesh_axes(label: str) -> list[str]:
    """The mesh axes a label's groups run along (all of an axis, or part of it)."""
    return [part.split(":")[0] for part in label.split("+")]


def axes_of_groups(groups: list[list[int]], mesh_shape: Mapping[str, int], permute: bool = False) -> str:
    """Name the mesh axes that a collective's groups (or a permute's pairs) run over."""
    table = _partitions(tuple(mesh_shape.items()))
    if permute:
        # A permute along an axis sends between devices of that axis's groups.
        for partition, name in table.items():
            owner = {d: g for g in partition for d in g}
            if all(owner.get(s) is not None and owner.get(s) == owner.get(t) for s, t in groups) \
                    and "+" not in name:
                return name
        return "?"
    return table.get(frozenset(frozenset(g) for g in groups), "?")


# ----------------------------------------------------------------------------- bytes

def _elements(type_text: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) for dims in _ELEMENTS.findall(type_text))


def _slice_fraction(module: hlo.HloModule, computation: str, name: str, elements: int, depth: int = 0,
                    groups: list[list[int]] | None = None, frames: tuple[offsets.Frame, ...] = ()) -> int:
    """k if every use of value `name` keeps only a 1/k dynamic slice of its `elements`,
    else 1. With the collective's `groups`: only if the devices of each group keep k
    different slices (as far as their offsets can be evaluated)."""
    users = module.users(computation, name)
    fractions = set()
    for user in users if depth <= 3 else ():
        if user.op == "dynamic-slice":
            fractions.add(_kept_part(module, user, elements, frames, groups))
        elif _is_copy(module, user) or user.op.endswith("-done"):  # (an asynchronous collective's result)
            fractions.add(_slice_fraction(module, computation, user.name, elements, depth + 1, groups, frames))
        elif fused := hlo.fused_computation(user):
            for index, operand in enumerate(user.operands):
                if operand == name:
                    param = module.parameter(fused, index)
                    fractions.add(_slice_fraction(module, fused, param.name, elements, depth + 1, groups,
                                                  (*frames, (user, computation))) if param else 1)
        else:
            fractions.add(1)
    return fractions.pop() if len(fractions) == 1 else 1


def _kept_part(module: hlo.HloModule, ds: hlo.Instruction, elements: int, frames,
               groups: list[list[int]] | None) -> int:
    """k if the dynamic slice `ds` keeps a 1/k part of a value of `elements`, the devices
    of every group keeping k different parts, else 1. The part is cut along the dimensions
    whose offset differs from device to device: a device may read its part in pieces (a
    fused projection's gradient, sliced once per projection). Where the offsets are not
    modelled, the shape is all there is to go on."""
    kept = _elements(ds.result_type)
    by_shape = elements // kept if kept and elements % kept == 0 else 1
    starts = offsets.slice_starts(module, ds, frames, 1 + max(d for g in groups for d in g)) if groups else None
    if starts is None:
        return by_shape
    varying = [dim for dim, s in starts.items() if len(set(s.tolist())) > 1]
    full, part = hlo.dims_of(offsets.operand_type(module, ds, 0)), hlo.dims_of(ds.result_type)
    if not varying or any(full[d] % part[d] for d in varying):
        return 1
    k = math.prod(full[d] // part[d] for d in varying)
    parts_per_group = {len({tuple(int(starts[d][device]) for d in varying) for device in g}) for g in groups}
    return k if parts_per_group == {k} else 1


_SLICE_SPAN = re.compile(r"slice=\{\[(\d+):(\d+)\]\}")
_PASS_THROUGH = ("bitcast", "copy", "convert", "parameter")


def _elementwise_copy(module: hlo.HloModule, computation: str) -> bool:
    """A fused computation that only converts, copies or bitcasts its one parameter."""
    instrs = module.instructions.get(computation, {})
    return bool(instrs) and all(i.op in _PASS_THROUGH for i in instrs.values()) \
        and sum(i.op == "parameter" for i in instrs.values()) == 1


def _is_copy(module: hlo.HloModule, instr: hlo.Instruction) -> bool:
    """Moves or converts one value without computing (a convert, bitcast or copy, alone or fused)."""
    if instr.op in ("bitcast", "copy", "convert"):
        return True
    return (fused := hlo.fused_computation(instr)) is not None and _elementwise_copy(module, fused)


def _source_width(module: hlo.HloModule, computation: str, name: str) -> float:
    """Fraction of its bytes that a collective operand really carries: XLA:CPU runs bf16
    collectives in float32, converting up just before (and back after); XLA on GPU/TPU
    moves the bf16 values themselves."""
    instr = module.instructions[computation].get(name)
    while instr is not None:
        if (root := hlo.root_of(module, computation, instr))[1] is not instr:
            computation, instr = root
        elif instr.op in ("bitcast", "copy", "transpose"):  # the same values, moved
            instr = module.instructions[computation].get(instr.operands[0])
        elif instr.op == "convert":
            source = module.instructions[computation].get(instr.operands[0])
            if source is None:
                return 1.0
            return min(1.0, hlo.dtype_bytes(source.result_type) / hlo.dtype_bytes(instr.result_type))
        else:
            return 1.0
    return 1.0


def _operand_slice_fractions(module: hlo.HloModule, c: hlo.Collective, groups: list[list[list[int]] | None]
                             ) -> list[list[tuple[float, int]]]:
    """For an all-reduce: per operand, its pieces as (share of its bytes, k): k if only a
    1/k slice of the piece's sum is ever used, a different one on each device of the
    groups that operand is summed over. An operand is one piece, unless XLA's all-reduce
    combiner concatenated several values into it (and slices them out of the sum)."""
    instr = result = module.instructions[c.computation][c.name]
    if instr.op.endswith("-start"):  # asynchronous (XLA:GPU): its -done holds the result
        done = [u for u in module.users(c.computation, c.name) if u.op.endswith("-done")]
        result = done[0] if len(done) == 1 else instr
    if len(instr.operands) == 1:
        pieces = _concatenated(module, c.computation, instr.operands[0])
        ks = _piece_fractions(module, c.computation, result.name, pieces, groups[0]) if pieces else None
        if ks:
            return [[(size / sum(pieces), k) for size, k in zip(pieces, ks)]]
        return [[(1.0, _slice_fraction(module, c.computation, result.name, _elements(result.result_type),
                                       groups=groups[0]))]]
    out = [[(1.0, 1)] for _ in instr.operands]
    for user in module.users(c.computation, result.name):
        index = re.search(r"\bindex=(\d+)", user.attributes)
        if user.op == "get-tuple-element" and index:
            i = int(index.group(1))
            out[i] = [(1.0, _slice_fraction(module, c.computation, user.name, _elements(user.result_type),
                                            groups=groups[i]))]
    return out


def _concatenated(module: hlo.HloModule, computation: str, name: str) -> list[int] | None:
    """The element counts of the flat pieces XLA's all-reduce combiner concatenated into
    operand `name`, if it did."""
    instr = module.instructions[computation].get(name)
    if instr is None or len(hlo.dims_of(instr.result_type)) != 1:
        return None
    inner, root = hlo.root_of(module, computation, instr)
    if root.op != "concatenate":
        return None
    table = module.instructions[inner]
    pieces = [hlo.dims_of(table[o].result_type) if o in table else [] for o in root.operands]
    return [p[0] for p in pieces] if all(len(p) == 1 for p in pieces) else None


def _piece_fractions(module: hlo.HloModule, computation: str, name: str, pieces: list[int],
                     groups: list[list[int]] | None) -> list[int] | None:
    """Per piece of the combined sum `name`, the k of `_slice_fraction` for what is done
    with the slice that takes it out; None unless every use is such a slice."""
    spans = {(sum(pieces[:i]), sum(pieces[:i + 1])): i for i in range(len(pieces))}
    found: dict[int, set[int]] = {}
    for user in module.users(computation, name):
        _, root = hlo.root_of(module, computation, user)
        span = _SLICE_SPAN.search(root.attributes) if root.op == "slice" else None
        i = spans.get((int(span.group(1)), int(span.group(2)))) if span else None
        if i is None:
            return None
        found.setdefault(i, set()).add(_slice_fraction(module, computation, user.name, pieces[i], groups=groups))
    return [ks.pop() if len(ks) == 1 else 1 for ks in (found.get(i, {1}) for i in range(len(pieces)))]


# How gradients are stored split (spmd.parallel.rules: `embed` at rest, then dp under ZeRO), outer first.
STORAGE_AXES = (*axes_of(TABLE[ZERO_SHARDED_DIM][0]), *ZERO_AXES)


def _split_all_reduce(axes: str, k: int, mesh_shape: Mapping[str, int]) -> tuple[str, str] | None:
    """An all-reduce over `axes` of which each device keeps 1/k: a reduce-scatter over the
    axes whose sizes multiply to k, then an all-reduce over the others (XLA's GPU compiler
    splits it so; for k = n it is a plain reduce-scatter). The scattered axes are the ones
    gradients are stored split over if they fit, else the innermost."""
    names = axes.split("+")
    candidates = [tuple(a for a in STORAGE_AXES[:i] if a in names) for i in range(1, len(STORAGE_AXES) + 1)]
    candidates += [("dp",)] if "dp" in names else []
    candidates += [tuple(names[cut:]) for cut in range(len(names))]
    for scatter in candidates:
        if math.prod(mesh_shape[a] for a in scatter) == k:
            rest = [a for a in names if a not in scatter]
            return _joined(*scatter), "+".join(rest)
    return None


def _ring_bytes(op: str, operand_bytes: float, n: int) -> float:
    if op == "all-reduce":
        return 2 * (n - 1) / n * operand_bytes
    if op == "all-gather":
        return (n - 1) * operand_bytes  # the result is n operands
    if op == "collective-permute":
        return operand_bytes
    return (n - 1) / n * operand_bytes  # reduce-scatter, all-to-all: of the full buffer


def _copied_from(module: hlo.HloModule, computation: str, name: str) -> str:
    """The value `name` is a copy of, seen through converts, bitcasts and copies."""
    table = module.instructions[computation]
    while (instr := table.get(name)) is not None and _is_copy(module, instr) and len(instr.operands) == 1:
        name = instr.operands[0]
    return name


def _only_feeds(module: hlo.HloModule, computation: str, name: str, target: str) -> bool:
    """Whether every use of `name`, through tuple elements and copies, ends in `target`."""
    users = module.users(computation, name)
    return bool(users) and all(
        u.name == target or ((u.op == "get-tuple-element" or _is_copy(module, u))
                             and _only_feeds(module, computation, u.name, target))
        for u in users)


def _folded_all_reduces(module: hlo.HloModule) -> dict[tuple[str, int], tuple[str, int]]:
    """All-reduce results that feed only one operand of the next all-reduce: XLA on
    GPU/TPU folds such a pair into one all-reduce over both groups (XLA:CPU keeps two,
    with the bf16 rounding of the first's result in between). Both may be tuples of
    several combined all-reduces. -> {(first, its operand): (second, its operand)}"""
    folded = {}
    for c in module.collectives:
        if c.op != "all-reduce":
            continue
        table = module.instructions[c.computation]
        for j, operand in enumerate(table[c.name].operands):
            source = table.get(_copied_from(module, c.computation, operand))
            if source is None:
                continue
            first, i = source, 0
            if source.op == "get-tuple-element":
                first = table.get(source.operands[0])
                i = int(re.search(r"\bindex=(\d+)", source.attributes).group(1))
            if first is not None and first.op == "all-reduce" and \
                    _only_feeds(module, c.computation, source.name, c.name):
                folded[(first.name, i)] = (c.name, j)
    return folded


def _joined(*labels: str) -> str:
    names = {a for label in labels for a in label.split("+")}
    return "+".join(a for a in AXES if a in names) if "?" not in names else "?"


def _reduction_parts(on: str, n: int, size: float, pieces: list[tuple[float, int]],
                     mesh_shape: Mapping[str, int]) -> list[tuple[str, str, int, float, bool]]:
    """The rows an all-reduce operand of `size` bytes summed over `on` amounts to: where
    only a 1/k slice of a piece is used, a reduce-scatter (and an all-reduce of the slice
    over the rest of `on`)."""
    group = group_size(on, mesh_shape) if on != "?" else n
    parts = []
    for share, k in pieces:
        split = _split_all_reduce(on, k, mesh_shape) if k > 1 and on != "?" and ":" not in on else None
        if split is None:
            parts.append(("all-reduce", on, group, share * size, False))
            continue
        scatter_axes, rest = split
        parts.append(("reduce-scatter", scatter_axes, k, share * size, True))
        if rest:
            parts.append(("all-reduce", rest, group // k, share * size / k, True))
    return parts


def step_traffic(module: hlo.HloModule, mesh_shape: Mapping[str, int]) -> list[Traffic]:
    """Every collective of the step, as (op, axes) rows with counts and bytes per device."""
    num_devices = math.prod(mesh_shape.values())
    runs = module.runs_per_step()
    axes_of: dict[str, tuple[str, int]] = {}  # collective -> (mesh axes, group size)
    groups_of: dict[str, list[list[int]] | None] = {}
    for c in module.collectives:
        groups = groups_of[c.name] = device_groups(c.attributes, num_devices)
        permute = c.op == "collective-permute"
        n = 2 if permute else (len(groups[0]) if groups else num_devices)
        if n > 1 and not (groups and max(len(g) for g in groups) <= 1):
            axes_of[c.name] = (axes_of_groups(groups, mesh_shape, permute) if groups else "?", n)
    # (A pair over part of an axis, such as the devices sharing a kv head, is left apart:
    # its union names no mesh axes, and XLA:TPU compiles OLMo 2's key norm's gradient so,
    # summed over fsdp, then over tp:inner2.)
    folded = {first: second for first, second in _folded_all_reduces(module).items()
              if not any(":" in axes_of.get(name, ("",))[0] for name in (first[0], second[0]))}
    feeders = {second: first for first, second in folded.items()}

    def reduced_over(name: str, operand: int) -> str:
        """The axes an all-reduce operand sums over, with those of the all-reduces folded into it."""
        axes = axes_of[name][0] if name in axes_of else ""
        first = feeders.get((name, operand))
        return _joined(*filter(None, (axes, reduced_over(*first)))) if first else axes

    under_compute = hlo.overlapped(module)
    totals: dict[tuple[str, str, bool], list[float]] = {}
    for c in module.collectives:
        if c.name not in axes_of:
            continue
        axes, n = axes_of[c.name]
        times = runs.get(c.computation, 1)
        instr = module.instructions[c.computation][c.name]
        sizes = [size * _source_width(module, c.computation, operand)
                 for size, operand in zip(c.operand_bytes, instr.operands)]
        if c.op == "ragged-all-to-all":
            # Operands: the rows, the receiving buffer, then offsets and sizes. What leaves
            # is known at run time only; at most the smaller buffer (the dropless exchange's
            # rows, spmd.parallel.experts), (n - 1) / n of it under balanced routing.
            sizes = [min(sizes[0], c.result_bytes)]
        # (op, axes, group size, operand bytes, converted from all-reduce + slice)
        parts = [(c.op, axes, n, sum(sizes), False)]
        if c.op == "all-reduce" and axes != "?":
            parts = []
            # (Each operand's slices are told apart over all it is summed over, folds included.)
            summed_over = [groups_along(reduced_over(c.name, j), mesh_shape) or groups_of[c.name]
                           for j in range(len(sizes))]
            for j, (size, pieces) in enumerate(zip(sizes, _operand_slice_fractions(module, c, summed_over))):
                if (c.name, j) in folded:  # counted with the all-reduce it feeds
                    continue
                on = reduced_over(c.name, j)
                parts += _reduction_parts(on, n, size, pieces, mesh_shape)
        for key in {(op, on_axes, converted) for op, on_axes, _, _, converted in parts}:
            totals.setdefault(key, [0, 0.0, 0.0])[0] += times  # one collective, however many pieces
        for op, on_axes, group, operand_bytes, converted in parts:
            row = totals[(op, on_axes, converted)]
            row[1] += times * _ring_bytes(op, operand_bytes, group)
            row[2] += times * _ring_bytes(op, operand_bytes, group) * (c.name in under_compute)
    return [Traffic(op, axes, int(count), total, converted, overlapped)
            for (op, axes, converted), (count, total, overlapped) in sorted(totals.items())]
