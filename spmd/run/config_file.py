"""Reading a --config file: YAML read safely (`yaml.SafeLoader`: no Python objects), with
what PyYAML lets through refused in one line naming the file: a key given twice in one
mapping, collections nested deeper than any options file needs, bytes that are not UTF-8,
a file that is not a regular one. What its keys mean is spmd.run.config's.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from spmd.base.errors import UserError, file_kind


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping (`line`: the second's)."""

    def __init__(self, key, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


class _TooDeep(yaml.YAMLError):
    """Collections nested deeper than MAX_YAML_DEPTH (`line`: where the deepest starts)."""

    def __init__(self, line: int):
        super().__init__(line)
        self.line = line


MAX_BYTES = 1 << 20  # a config file's size: every option with a long value is some 10 kB
# How deep a config file's collections may nest: options under sections, a mesh under its
# section, hold three levels. PyYAML composes a level by a call within the last, so a file
# of a thousand brackets would end in Python's RecursionError.
MAX_YAML_DEPTH = 16


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader, refusing a mapping that gives a key twice (PyYAML lets the last
    win: `steps: 10` then `steps: 1000` would train 1000 steps without a word), and
    collections nested deeper than MAX_YAML_DEPTH. A merge (`<<: *defaults`) may still be
    overridden: its keys are not the mapping's own."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node):
        # Each mapping is checked once, before its merges are spliced into it (an anchored
        # mapping is flattened again wherever it is merged or aliased).
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._check_unique(node)
        super().flatten_mapping(node)

    def _check_unique(self, node) -> None:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                twice = key in seen
            except TypeError:  # unhashable: the base class refuses it in its own words
                continue
            if twice:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)


def read_config_file(path: str):
    """A --config file's YAML, read safely (no Python objects), each mapping's keys unique,
    nested at most MAX_YAML_DEPTH deep; anything else one UserError naming the file."""
    file = Path(path)
    if not file.is_file():
        kind = file_kind(file)
        raise UserError(f"config file not found: {path}" if kind == "missing" else f"config file {path} is {kind}, "
                        "not a regular file")
    if file.stat().st_size > MAX_BYTES:
        raise UserError(f"config file {path} is {file.stat().st_size:,} bytes; an options file holds a few kilobytes "
                        f"(at most {MAX_BYTES:,} bytes are read)")
    try:
        return yaml.load(file.read_bytes().decode("utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    except _TooDeep as exc:
        raise UserError(f"config file {path}: collections nested more than {MAX_YAML_DEPTH} deep (line {exc.line}); "
                        "options are given under their sections, two levels") from None
    except _DuplicateKey as exc:
        raise UserError(f"config file {path}: {exc.key} is given twice (again on line {exc.line}); give it once") \
            from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where else ""
        raise UserError(f"config file {path} is not valid YAML{at}") from None
    except OSError as exc:
        raise UserError(f"config file {path} cannot be read: {exc.strerror}") from None
