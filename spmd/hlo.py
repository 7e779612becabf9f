"""Read the collectives out of XLA's optimized HLO text.

`compiled.as_text()` is a list of computations; collectives are instructions whose result
type names their shapes. Loops are `while` instructions whose body is another computation,
so "inside a loop" means reachable from some while body through calls.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
REDUCTIONS = ("all-reduce", "reduce-scatter")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    name: str
    computation: str
    result_bytes: int
    line: str


@dataclasses.dataclass
class HloModule:
    entry: str
    calls: dict[str, set[str]]  # computation -> computations it calls
    loop_bodies: set[str]
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


def shape_bytes(type_text: str) -> int:
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _SHAPE.findall(type_text))


def parse(text: str) -> HloModule:
    entry, current = "", ""
    calls: dict[str, set[str]] = {}
    loop_bodies: set[str] = set()
    collectives: list[Collective] = []
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group(1)
            calls.setdefault(current, set())
            if line.startswith("ENTRY"):
                entry = current
            continue
        instr = _INSTR.match(line)
        if not instr or not current:
            continue
        name, result_type, op, rest = instr.groups()
        called = set(_CALLED.findall(rest))
        for group in _BRANCHES.findall(rest):
            called |= {c.strip().lstrip("%") for c in group.split(",") if c.strip()}
        calls[current] |= called
        if op == "while":
            loop_bodies |= set(re.findall(r"\bbody=%?([\w.\-]+)", rest))
        base = op[: -len("-start")] if op.endswith("-start") else op
        if base in COLLECTIVES:
            collectives.append(Collective(base, name, current, shape_bytes(result_type), line.strip()))
    return HloModule(entry, calls, loop_bodies, collectives)
