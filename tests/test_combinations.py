"""What combines: the README's statement, the table in spmd/parallel/checks.py, and the checks agree."""

import itertools
import pathlib
import re

import pytest

from spmd.base.errors import UserError
from spmd.config import TrainConfig, validate
from spmd.parallel.checks import FEATURES, REFUSED, check_layout
from spmd.parallel.mesh import AXES, resolve_mesh
from spmd.planner.matrix import example

README = pathlib.Path(__file__).parents[1] / "README.md"


def _readme_statement() -> tuple[list[str], dict[frozenset, str]]:
    text = README.read_text()
    section = text[text.index("<!-- combinations:"):text.index("<!-- end combinations -->")]
    names = re.findall(r"`([^`]+)`", re.search(r"^Features: (.*)$", section, re.M).group(1))
    refused = {frozenset(re.findall(r"`([^`]+)`", row[0])): row[1]
               for row in re.findall(r"^\| (`.*?) \| (.*) \|$", section, re.M)}
    assert bool(refused) != ("no combination is refused" in section)
    return names, refused


def test_readme_states_the_table_of_what_combines():
    names, refused = _readme_statement()
    assert names == list(FEATURES)
    assert refused == REFUSED


def _config(names) -> tuple:
    """A small run that uses exactly the features `names` (on 2 devices per axis)."""
    fields, devices = example(names)
    return validate(TrainConfig.of(**fields)), resolve_mesh({axis: 2 for axis in AXES if axis in names}, devices)


@pytest.mark.parametrize("pair", list(itertools.combinations(FEATURES, 2)), ids="+".join)
def test_every_pair_of_features_passes_the_checks_unless_refused(pair):
    cfg, shape = _config(pair)
    if frozenset(pair) in REFUSED:
        with pytest.raises(UserError, match=re.escape(REFUSED[frozenset(pair)])):
            check_layout(cfg.step, shape)
    else:
        check_layout(cfg.step, shape)  # raises UserError if refused


def test_a_refused_combination_is_refused_with_its_reason(monkeypatch):
    """The mechanism, on a made-up entry."""
    monkeypatch.setitem(REFUSED, frozenset({"sp", "grad-accum"}), "made up: sp with accumulation")
    cfg, shape = _config(("sp", "grad-accum"))
    with pytest.raises(UserError, match="made up: sp with accumulation"):
        check_layout(cfg.step, shape)
    check_layout(*_config(("sp",)))  # a part of it passes
