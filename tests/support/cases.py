"""The tier of each case of a parametrized test, said beside the test (docs/contributing.md).

A literal list marks its slow cases itself (`pytest.param(..., marks=pytest.mark.slow)`);
a list built or shared elsewhere (the parity layouts, the README's commands, the presets)
goes through `tiered`, which names the cases kept in the gate, or those marked slow or floor.
"""

import pytest


def tiered(values, ids, *, gate=None, slow=(), floor=()) -> list:
    """`values` as `pytest.param`s with their `ids` (a list, or a function of a value): marked
    `slow` but those whose id is in `gate` (given), or those whose id is in `slow`; marked
    `floor` when their id is in `floor`. A name that is no case's id is refused, so a renamed
    case cannot leave its tier unnoticed."""
    values = list(values)
    names = [ids(v) for v in values] if callable(ids) else list(ids)
    assert len(names) == len(values), (len(names), len(values))
    stale = {*(gate or ()), *slow, *floor} - set(names)
    if stale:
        raise ValueError(f"no case has these ids: {sorted(stale)}")
    out = []
    for value, name in zip(values, names):
        marks = []
        if (name not in gate) if gate is not None else (name in slow):
            marks.append(pytest.mark.slow)
        if name in floor:
            marks.append(pytest.mark.floor)
        out.append(pytest.param(*(value if isinstance(value, tuple) else (value,)), id=name, marks=marks))
    return out
