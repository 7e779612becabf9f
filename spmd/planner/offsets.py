"""Where each device's dynamic slice starts: the offsets a compiled SPMD program computes
from the device's id (`partition-id`) and tables of constants, evaluated for every device.

An all-reduce whose result each device slices is a reduce-scatter only if the devices of
each group keep different parts of it: XLA's passes that form one (reduce-scatter creator,
all-reduce splitter) check the slice's offset against the device's place in its group.
The shape alone does not tell: a ZeRO shard taken over other axes than the all-reduce's
keeps 1/k of it on every device with the same offsets on several devices of a group.
"""

from __future__ import annotations

import re

import numpy as np

from spmd.planner import hlo

_PARAMETER_INDEX = re.compile(r"\(?(\d+)")
_SLICE_SIZES = re.compile(r"dynamic_slice_sizes=\{([\d,]*)\}")
_MOST_CONSTANT = 4096  # larger constants are data, not offset tables
_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
           "minimum": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or,
           "divide": lambda a, b: np.floor_divide(a, np.where(b == 0, 1, b)),
           "remainder": lambda a, b: np.remainder(a, np.where(b == 0, 1, b)),
           "shift-left": np.left_shift, "shift-right-logical": np.right_shift,
           "shift-right-arithmetic": np.right_shift}
_COMPARE = {"LT": np.less, "LE": np.less_equal, "GT": np.greater, "GE": np.greater_equal,
            "EQ": np.equal, "NE": np.not_equal}
_DIRECTION = re.compile(r"direction=(\w+)")
_SAME_VALUES = ("convert", "bitcast", "copy", "reshape")


class _Unknown(Exception):
    """An instruction the evaluator does not model."""


# A caller frame: the fusion instruction and the computation it sits in, to read a fused
# computation's parameters from.
Frame = tuple[hlo.Instruction, str]


def slice_starts(module: hlo.HloModule, ds: hlo.Instruction, frames: tuple[Frame, ...],
                 devices: int) -> dict[int, np.ndarray] | None:
    """Per dimension that the dynamic slice `ds` cuts, where each device starts it
    (clamped as XLA clamps it); None if an offset is not modelled."""
    full, kept = hlo.dims_of(operand_type(module, ds, 0)), _SLICE_SIZES.search(ds.attributes)
    sizes = [int(s) for s in kept.group(1).split(",") if s] if kept else []
    if len(sizes) != len(full) or len(ds.operands) != 1 + len(full):
        return None
    starts = {}
    for dim, (f, k) in enumerate(zip(full, sizes)):
        if f == k:
            continue
        try:
            start = _value(module, ds.computation, ds.operands[1 + dim], frames, devices)
        except _Unknown:
            return None
        starts[dim] = np.clip(start.reshape(devices), 0, f - k)
    return starts


def operand_type(module: hlo.HloModule, instr: hlo.Instruction, index: int) -> str:
    source = module.instructions[instr.computation].get(instr.operands[index].split("#")[0])
    return source.result_type if source else ""


def _value(module: hlo.HloModule, computation: str, name: str, frames: tuple[Frame, ...],
           devices: int) -> np.ndarray:
    """The integer value `name` holds on every device: shape (devices, *its dims)."""
    instr = module.instructions[computation].get(name)
    if instr is None:
        raise _Unknown(name)
    dims = hlo.dims_of(instr.result_type)

    def operand(i: int) -> np.ndarray:
        return _value(module, computation, instr.operands[i], frames, devices)

    if instr.op == "parameter":
        if not frames:
            raise _Unknown(name)
        (caller, outer), index = frames[-1], int(_PARAMETER_INDEX.match(instr.attributes).group(1))
        return _value(module, outer, caller.operands[index], frames[:-1], devices)
    if instr.op == "partition-id":
        return np.arange(devices, dtype=np.int64)
    if instr.op == "replica-id":
        return np.zeros(devices, dtype=np.int64)
    if instr.op == "constant":
        numbers = [int(x) for x in re.findall(r"-?\d+", ",".join(instr.operands))]
        if not numbers or len(numbers) > _MOST_CONSTANT or len(numbers) != max(1, int(np.prod(dims))):
            raise _Unknown(name)
        return np.broadcast_to(np.array(numbers, dtype=np.int64).reshape(dims), (devices, *dims))
    if instr.op in _SAME_VALUES:
        return operand(0).reshape(devices, *dims)
    if instr.op in _BINARY:
        return _BINARY[instr.op](operand(0), operand(1))
    if instr.op == "compare" and (direction := _DIRECTION.search(instr.attributes)):
        return _COMPARE[direction.group(1)](operand(0), operand(1)).astype(np.int64)
    if instr.op == "select":
        return np.where(operand(0) != 0, operand(1), operand(2))
    if instr.op == "clamp":
        return np.clip(operand(1), operand(0), operand(2))
    if instr.op == "dynamic-slice" and len(dims) == 1 and len(instr.operands) == 2:
        table, start = operand(0), operand(1).reshape(devices)
        start = np.clip(start, 0, table.shape[1] - dims[0])
        return np.stack([table[d, s:s + dims[0]] for d, s in enumerate(start)])
    raise _Unknown(name)
