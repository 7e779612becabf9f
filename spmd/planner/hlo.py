"""Read the collectives out of XLA's optimized HLO text.

`compiled.as_text()` is a list of computations. Each instruction names its result type
and its operands; a collective's device groups are in `replica_groups` (three syntaxes,
see `spmd.replica_groups`). Loops are `while` instructions whose body is another
computation and whose `known_trip_count` says how often it runs (XLA:CPU and XLA:GPU
write it; XLA:TPU does not, and the count is read from the loop's condition), so a
collective's count per step is the product of the trip counts of the loops around it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from models.annotate import RUNS_SCOPE
from spmd.parallel.pipeline.split import split_backward

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
REDUCTIONS = ("all-reduce", "reduce-scatter")
COMPUTE = ("fusion", "custom-call", "dot", "convolution")  # what a device computes while a collective runs

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PARAMETER_INDEX = re.compile(r"^(\d+)\)")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_BRANCH_SCOPE = re.compile(r"branch_\d+_fun")  # JAX's name for a `switch`'s i-th branch
_DECLARED_RUNS = re.compile(RUNS_SCOPE.format(r"(\d+)", r"(\d+)"))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    op: str
    result_type: str
    operands: tuple[str, ...]
    attributes: str  # everything after the operand list
    computation: str


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    name: str
    computation: str
    result_bytes: int
    operand_bytes: tuple[int, ...]  # one per operand (a combined collective has several)
    attributes: str
    line: str


@dataclasses.dataclass
class HloModule:
    entry: str
    calls: dict[str, set[str]]  # computation -> computations it calls
    loop_bodies: set[str]
    trip_counts: dict[str, int]  # while body -> its known trip count
    instructions: dict[str, dict[str, Instruction]]  # computation -> name -> instruction
    roots: dict[str, str]  # computation -> its ROOT instruction
    collectives: list[Collective]

    def reachable(self, roots: set[str]) -> set[str]:
        seen, todo = set(), list(roots)
        while todo:
            comp = todo.pop()
            if comp not in seen:
                seen.add(comp)
                todo.extend(self.calls.get(comp, ()))
        return seen

    def in_loops(self) -> set[str]:
        """Computations that run inside some while loop."""
        return self.reachable(self.loop_bodies)

    def collectives_where(self, ops=COLLECTIVES, inside_loops: bool | None = None) -> list[Collective]:
        looped = self.in_loops()
        return [c for c in self.collectives
                if c.op in ops and (inside_loops is None or (c.computation in looped) == inside_loops)]

    def runs_per_step(self) -> dict[str, float]:
        """How many times each computation runs in one execution of the entry computation.

        A loop whose trip count is neither written nor readable from its condition is
        counted once (the train step's scans all have one). A conditional's branches
        share its runs where that is known: as each branch says (a pipeline's pairs of
        ticks, `spmd.parallel.pipeline.kit.counted_switch`), or evenly where they move the
        same collectives (a layer that runs one of two kinds of attention, each over sp):
        one of them runs each time."""
        runs = {self.entry: 1}
        todo = [self.entry]
        while todo:
            comp = todo.pop()
            shares = self._branch_shares(comp)
            for callee in self.calls.get(comp, ()):
                times = runs[comp] * self.trip_counts.get(callee, 1) * shares.get(callee, 1)
                if runs.get(callee, 0) < times:
                    runs[callee] = times
                    todo.append(callee)
        return runs

    def _branch_shares(self, computation: str) -> dict[str, float]:
        """The branches of `computation`'s conditionals with their share of its runs: the
        share each says it has (`declared_share`; a branch beside one that says runs as
        often as the conditional), else 1 / branches for branches whose collectives are
        alike; branches that differ and say nothing run as often as the conditional, as
        any of them might."""
        shares = {}
        for instr in self.instructions.get(computation, {}).values():
            if instr.op != "conditional":
                continue
            branches = self.branches(instr)
            declared = {b: self.declared_share(b) for b in branches}
            if any(share is not None for share in declared.values()):
                shares |= {b: share for b, share in declared.items() if share is not None}
                continue
            reached = [self.reachable({b}) for b in branches]
            moved = [sorted((c.op, c.operand_bytes) for c in self.collectives if c.computation in r) for r in reached]
            if len(branches) > 1 and moved[0] and all(m == moved[0] for m in moved):
                shares |= dict.fromkeys(branches, 1 / len(branches))
        return shares

    def branches(self, conditional: Instruction) -> list[str]:
        """The computations a `conditional` instruction branches to."""
        return [c for c in self.calls.get(conditional.computation, ())
                if re.search(rf"(?<![\w.\-]){re.escape(c)}(?![\w.\-])", conditional.attributes)]

    def declared_share(self, branch: str) -> float | None:
        """The share of its conditional's runs a branch computation says it takes: the
        name scope its instructions were traced under (`RUNS_SCOPE`, runs of trips),
        which the compiler keeps in their metadata; None where none says."""
        said = set()
        for instr in self.instructions.get(branch, {}).values():
            found = _OP_NAME.search(instr.attributes)
            # The scope right inside the innermost branch: a conditional nested in a
            # counted branch has the outer scope in its names too, and says nothing itself.
            scopes = found.group(1).split("/") if found else []
            inner = max((i for i, scope in enumerate(scopes) if _BRANCH_SCOPE.fullmatch(scope)), default=None)
            if inner is not None and inner + 1 < len(scopes) and _DECLARED_RUNS.fullmatch(scopes[inner + 1]):
                said.add(_DECLARED_RUNS.fullmatch(scopes[inner + 1]).groups())
        if len(said) != 1:
            return None
        runs, trips = said.pop()
        return int(runs) / int(trips)

    def users(self, computation: str, name: str) -> list[Instruction]:
        return [i for i in self.instructions[computation].values() if name in i.operands]

    def parameter(self, computation: str, index: int) -> Instruction | None:
        for instr in self.instructions.get(computation, {}).values():
            if instr.op == "parameter" and _PARAMETER_INDEX.match(instr.attributes) \
                    and int(_PARAMETER_INDEX.match(instr.attributes).group(1)) == index:
                return instr
        return None


def dtype_bytes(type_text: str) -> int:
    """Bytes per element of a (non-tuple) type like `bf16[4,8]{1,0}`."""
    found = _SHAPE.search(type_text)
    return _DTYPE_BYTES.get(found.group(1), 4) if found else 4


def shape_bytes(type_text: str) -> int:
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _SHAPE.findall(type_text))


def _collective_result(op: str, result_type: str) -> str:
    """The type of what a collective produces: XLA:GPU's ragged-all-to-all-start returns
    ((its operands), the result), of which only the last is the exchange's."""
    if not (op == "ragged-all-to-all-start" and result_type.startswith("((")):
        return result_type
    depth = 0
    for i, char in enumerate(result_type):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 1 and char == ")":  # the operands' tuple closed
            return result_type[i + 1:].lstrip(", ").rstrip(")")
    return result_type


def _split_operands(rest: str) -> tuple[tuple[str, ...], str]:
    """`a, %b), attrs...` (the text after the op's opening parenthesis) -> operand names, attrs."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    inside = re.sub(r"/\*.*?\*/", "", rest[:end])
    names = tuple(part.strip().split()[-1].lstrip("%") for part in inside.split(",") if part.strip())
    return names, rest[end + 1:].lstrip(", ")


def parse(text: str) -> HloModule:
    entry, current = "", ""
    calls: dict[str, set[str]] = {}
    loop_bodies: set[str] = set()
    trip_counts: dict[str, int] = {}
    instructions: dict[str, dict[str, Instruction]] = {}
    roots: dict[str, str] = {}
    collectives: list[Collective] = []
    unknown: list[tuple[Instruction, set[str]]] = []  # loops without known_trip_count, and their bodies
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group(1)
            calls.setdefault(current, set())
            instructions.setdefault(current, {})
            if line.startswith("ENTRY"):
                entry = current
            continue
        match = _INSTR.match(line)
        if not match or not current:
            continue
        name, result_type, op, rest = match.groups()
        operands, attributes = _split_operands(rest) if op != "parameter" else ((), rest)
        instr = Instruction(name, op, result_type, operands, attributes, current)
        instructions[current][name] = instr
        if line.lstrip().startswith("ROOT"):
            roots[current] = name
        called = set(_CALLED.findall(attributes))
        for group in _BRANCHES.findall(attributes):
            called |= {c.strip().lstrip("%") for c in group.split(",") if c.strip()}
        calls[current] |= called
        if op == "while":
            bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", attributes))
            loop_bodies |= bodies
            trip = _TRIP_COUNT.search(attributes)
            for body in bodies:
                trip_counts[body] = int(trip.group(1)) if trip else 1
            if not trip:
                unknown.append((instr, bodies))
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base in COLLECTIVES:
            table = instructions[current]
            operand_bytes = tuple(shape_bytes(table[o].result_type) if o in table else 0 for o in operands)
            collectives.append(Collective(base, name, current, shape_bytes(_collective_result(op, result_type)),
                                          operand_bytes, attributes, line.strip()))
    for loop, bodies in unknown:
        trip = trip_from_condition(loop, instructions, roots)
        for body in bodies:
            trip_counts[body] = trip or 1
    return HloModule(entry, calls, loop_bodies, trip_counts, instructions, roots, collectives)


def overlapped(module: HloModule) -> set[str]:
    """The asynchronous collectives (`-start` ... `-done`) that have compute scheduled
    between their start and their done: those the device runs under compute. A compiled
    module is scheduled, and its text lists each computation in that order."""
    out = set()
    for table in module.instructions.values():
        position = {name: i for i, name in enumerate(table)}
        order = list(table.values())
        for instr in order:
            if instr.op.endswith("-done") and instr.operands and instr.operands[0] in position:
                between = order[position[instr.operands[0]] + 1:position[instr.name]]
                if any(b.op in COMPUTE for b in between):
                    out.add(instr.operands[0])
    return out


def fused_kernels(module: HloModule) -> dict[str, int]:
    """The fused kernels' custom calls in the program, by target: cuDNN's attention
    (`__cudnn$fmha...`) and Mosaic's (`tpu_custom_call`, splash attention's on a TPU)."""
    counts: dict[str, int] = {}
    for table in module.instructions.values():
        for instr in table.values():
            target = _CUSTOM_CALL_TARGET.search(instr.attributes) if instr.op == "custom-call" else None
            if target and (target.group(1).startswith("__cudnn$fmha") or target.group(1) == "tpu_custom_call"):
                counts[target.group(1)] = counts.get(target.group(1), 0) + 1
    return counts


def is_async(module: HloModule) -> bool:
    """Whether the compiler split its collectives into start and done (XLA:GPU does)."""
    return any(module.instructions[c.computation][c.name].op.endswith("-start") for c in module.collectives)


def trip_from_condition(loop: Instruction, instructions, roots) -> int | None:
    """The trip count of a `while` whose condition is `counter < N` (or `<=`), the counter
    a tuple element that starts at a constant and counts up by one, as in JAX's scans and
    fori_loops; None for any other loop."""
    condition = _CONDITION.search(loop.attributes)
    if not condition or condition.group(1) not in roots or not loop.operands:
        return None
    table = instructions[condition.group(1)]
    compare = table[roots[condition.group(1)]]
    direction = _DIRECTION.search(compare.attributes)
    if compare.op != "compare" or not direction or direction.group(1) not in ("LT", "LE") \
            or len(compare.operands) != 2:
        return None
    counter, bound = (_through_copies(table, o) for o in compare.operands)
    index = _TUPLE_INDEX.search(counter.attributes) if counter and counter.op == "get-tuple-element" else None
    end = _constant(bound)
    init = instructions[loop.computation].get(loop.operands[0])
    if index is None or end is None or init is None or init.op != "tuple":
        return None
    start = _constant(_through_copies(instructions[loop.computation], init.operands[int(index.group(1))]))
    if start is None:
        return None
    return max(end - start + (direction.group(1) == "LE"), 0)


def _through_copies(table: dict[str, Instruction], name: str) -> Instruction | None:
    instr = table.get(name)
    while instr is not None and instr.op in ("copy", "bitcast", "convert") and instr.operands:
        instr = table.get(instr.operands[0])
    return instr


def _constant(instr: Instruction | None) -> int | None:
    if instr is None or instr.op != "constant" or not instr.operands:
        return None
    try:
        return int(instr.operands[0])
    except ValueError:
        return None


_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def dims_of(type_text: str) -> list[int]:
    found = _SHAPE.search(type_text)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def fused_computation(instr: Instruction) -> str | None:
    """The computation a fusion calls (None for another op)."""
    found = re.search(r"\bcalls=%?([\w.\-]+)", instr.attributes) if instr.op == "fusion" else None
    return found.group(1) if found else None


def root_of(module: HloModule, computation: str, instr: Instruction) -> tuple[str, Instruction]:
    """A fusion's root, in the fused computation (XLA wraps lone ops in fusions), else the instruction."""
    if (fused := fused_computation(instr)) and fused in module.roots:
        return fused, module.instructions[fused][module.roots[fused]]
    return computation, instr


def branch_computations(module: HloModule) -> set[str]:
    """Computations that run only in some branch of a `conditional` (and what they call),
    but for branches that say how often they run (`HloModule.declared_share`)."""
    roots = set()
    for table in module.instructions.values():
        for instr in table.values():
            if instr.op == "conditional":
                roots |= {c for c in module.branches(instr) if module.declared_share(c) is None}
    return module.reachable(roots)


def dot_flops(module: HloModule, skip: set[str] = frozenset()) -> float:
    """FLOPs of the matrix products one device executes per step: every `dot`, times how
    often its computation runs (loop bodies their trip count; `compiled.cost_analysis()`
    counts a loop body once). Computations in `skip` are left out."""
    runs = module.runs_per_step()
    total = 0.0
    for comp, table in module.instructions.items():
        if comp not in runs or comp in skip:
            continue
        for instr in table.values():
            if instr.op != "dot":
                continue
            lhs = dims_of(table[instr.operands[0]].result_type)
            contracted = math.prod(lhs[int(i)] for i in _CONTRACTING.search(instr.attributes).group(1).split(",") if i)
            total += runs[comp] * 2 * math.prod(dims_of(instr.result_type)) * contracted
    return total


def loop_dot_flops(module: HloModule) -> float:
    """`dot_flops` of what runs inside loops (a train step's layer scans, pipeline ticks),
    leaving out computations that run only in some branch of a `conditional`."""
    outside = set(module.instructions) - module.in_loops()
    return dot_flops(module, skip=branch_computations(module) | outside)


def chunk_dot_flops(stage_fn, chunk, x: jax.Array) -> tuple[float, float, float]:
    """Dot FLOPs of a chunk's forward, B and W on microbatch x, each compiled alone, as a
    step's are counted (`loop_dot_flops`: computations that run only in some
    branch of a conditional, the attention kernel's causal blocks, aside): the per-chunk
    costs f, b, w of `executed_over_useful`."""
    forward, backward_input, backward_weight, _ = split_backward(stage_fn, chunk, x)
    (out, b_res, w_res) = jax.eval_shape(forward, chunk, x)  # shapes: nothing runs
    ct = out
    _, _, bw_res = jax.eval_shape(backward_input, chunk, b_res, ct)

    def flops(fn, *args):
        module = parse(jax.jit(fn).lower(*args).compile().as_text())
        return dot_flops(module, skip=branch_computations(module))
    return (flops(forward, chunk, x), flops(lambda *a: backward_input(*a)[:2], chunk, b_res, ct),
            flops(backward_weight, bw_res, w_res))
