"""One schema for the files spmd reads (config.json, safetensors headers, index and tokenizer
files): each file's fields declared once as data (name, kind, bounds or choices, default),
checked before anything is allocated or looped over, refused with the field and its value.

    FIELDS = (Field("vocab_size", INTEGER, Bounds(above=0)),                # required
              Field("rms_norm_eps", NUMBER, Bounds(above=0), default=1e-6))  # optional
    values = check(read_json(path, limit), FIELDS)  # -> {name: value}, defaults filled in

JSON is read strictly: a key given twice (which Python's json would let the last win) and
a number that is not finite (NaN, Infinity, 1e999: Python's json reads them) are refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from spmd.base.errors import file_kind


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The values an option accepts: at least / above a low end, at most / below a high end."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None

    def holds(self, v: float) -> bool:  # written so that NaN fails every bound
        return all((
            self.at_least is None or v >= self.at_least, self.above is None or v > self.above,
            self.at_most is None or v <= self.at_most, self.below is None or v < self.below))

    def __str__(self) -> str:
        low = (f"at least {_written(self.at_least)}" if self.at_least is not None else
               "positive" if self.above == 0 else f"above {_written(self.above)}" if self.above is not None else "")
        high = (f"at most {_written(self.at_most)}" if self.at_most is not None else
                f"below {_written(self.below)}" if self.below is not None else "")
        return " and ".join(part for part in (low, high) if part)


def _written(v: float) -> str:
    """A bound as written: whole numbers whole (2**32 - 1 is 4294967295, not 4.29497e+09)."""
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


REQUIRED = object()  # a Field's default when the file must give it


class Invalid(ValueError):
    """A value a file may not hold: `field` (dotted for nested ones, empty for the whole
    file) and why. The caller names the file."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}" if field else why)
        self.field = field


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return (_integer(v) or isinstance(v, float)) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class Kind:
    """A JSON value's type: `test`, and how a message says it ("an integer")."""

    name: str
    test: Callable[[object], bool]


INTEGER = Kind("an integer", _integer)
NUMBER = Kind("a finite number", _number)
BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool))
STRING = Kind("a string", lambda v: isinstance(v, str))
MAPPING = Kind("a mapping", lambda v: isinstance(v, dict))
LIST = Kind("a list", lambda v: isinstance(v, list))
ANY = Kind("any value", lambda v: True)  # read past: changes nothing spmd computes
NATURAL = Kind("a non-negative integer", lambda v: _integer(v) and v >= 0)


def list_of(item: Kind, plural: str, length: int | None = None) -> Kind:
    """A list of `item`s (`length` of them if given), said "a list of 2 <plural>"."""
    return Kind(f"a list of {f'{length} ' if length is not None else ''}{plural}",
                lambda v: isinstance(v, list) and (length is None or len(v) == length) and all(map(item.test, v)))


def mapping_of(item: Kind, plural: str) -> Kind:
    return Kind(f"a mapping of names to {plural}", lambda v: isinstance(v, dict) and all(map(item.test, v.values())))


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a file: its kind(s), the bounds (numbers) or choices its value must
    meet, and its default (REQUIRED: the file must give it; None with `nullable`)."""

    name: str
    kind: Kind
    bounds: Bounds = Bounds()
    default: object = REQUIRED
    choices: tuple = ()
    nullable: bool = False  # null also allowed (and kept as None)

    def check(self, value, prefix: str = ""):
        where = prefix + self.name
        if value is None and self.nullable:
            return None
        if self.choices:
            if any(_same(value, c) for c in self.choices):
                return value
            if len(self.choices) == 1:
                raise Invalid(where, f"only {self.choices[0]!r} is supported (got {_short(value)})")
            raise Invalid(where, f"{_short(value)} is not supported ({' or '.join(map(str, self.choices))})")
        if not self.kind.test(value) or (self.kind in (INTEGER, NUMBER) and not self.bounds.holds(value)):
            raise Invalid(where, f"must be {self.wanted()} (got {_short(value)})")
        return value

    def wanted(self) -> str:
        limits = str(self.bounds) if self.kind in (INTEGER, NUMBER) else ""
        noun = self.kind.name.removeprefix("an ").removeprefix("a ")
        text = (f"a positive {noun}" if limits == "positive" else
                f"{self.kind.name}, {limits}" if limits else self.kind.name)
        return text + (" or null" if self.nullable else "")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A cross-check between a file's fields: `holds(values)`, else `field` is refused with
    `why` formatted with the values."""

    field: str
    holds: Callable[[dict], bool]
    why: str


def enforce(values: dict, rules: Sequence[Rule], prefix: str = "") -> None:
    for rule in rules:
        if not rule.holds(values):
            raise Invalid(prefix + rule.field, rule.why.format(**values))


def check(record, fields: Sequence[Field], prefix: str = "", others: str | None = "is not a field of this file"
          ) -> dict:
    """`record` (a mapping) checked against `fields`: {name: value}, defaults filled in.
    A key no field declares is refused with `others` (None: read past)."""
    if not isinstance(record, dict):
        raise Invalid(prefix.rstrip(". "), f"must be a mapping (got {_short(record)})")
    if others is not None:
        known = {f.name for f in fields}
        unknown = sorted(k for k in record if k not in known)
        if unknown:
            raise Invalid(prefix + unknown[0], others)
    values = {}
    for f in fields:
        if f.name in record:
            values[f.name] = f.check(record[f.name], prefix)
        elif f.default is REQUIRED:
            raise Invalid(prefix + f.name, "is missing")
        else:
            values[f.name] = f.default
    return values


def _same(value, choice) -> bool:
    """Equal and of one kind: 0 and 0.0 are one number; False is not 0."""
    kinds = {type(value), type(choice)}
    return value == choice and (len(kinds) == 1 or kinds <= {int, float})


def _short(value) -> str:
    """A value for a one-line message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ files

REGULAR = "a regular file"  # spmd.base.errors.file_kind's word for one


def not_a_file(kind: str, wanted: str = "a file") -> str:
    """How a message says that a path of `kind` (spmd.base.errors.file_kind's answer) cannot be
    read as `wanted`."""
    if kind == "missing":
        return "is missing"
    if kind.startswith("unreadable"):
        return f"cannot be read {kind.removeprefix('unreadable ')}"
    return f"is {kind}, not {wanted}"


def read_bytes(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (refused: anything else, named)."""
    kind = file_kind(path)
    if kind != REGULAR:
        raise Invalid("", not_a_file(kind))
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise Invalid("", f"cannot be read ({exc.strerror})") from None
    if len(data) > limit:
        raise Invalid("", f"is larger than {limit} bytes, more than such a file holds")
    return data


def _strict_pairs(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise Invalid(key, "is given twice (JSON keys must be unique)")
        if isinstance(value, float) and not math.isfinite(value) or \
                isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
            raise Invalid(key, f"must be finite (got {value!r})")
        out[key] = value
    return out


def loads(data: bytes):
    """JSON with unique keys and finite numbers only."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_strict_pairs)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise Invalid("", "is not valid JSON") from None
    except ValueError as exc:  # Python's own limits, e.g. an integer of more than 4300 digits
        if isinstance(exc, Invalid):
            raise
        raise Invalid("", f"is not valid JSON ({exc})") from None


def read_json(path: Path, limit: int):
    """A JSON file's value, read as `read_bytes` and `loads` do."""
    return loads(read_bytes(Path(path), limit))
