"""The notebooks in examples/ run top to bottom (a failing cell or assertion fails the
test), are stored without outputs, and the README's Colab badges point at them."""

import os
import pathlib
import re
import tomllib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).parents[1]
NOTEBOOKS = sorted(ROOT.joinpath("examples").glob("*.ipynb"))
# The quick start trains 80 steps, where XLA's optimized code wins back its longer compile
# (measured: 25 s against 35 s unoptimized); the others compile many layouts for a few steps.
OPTIMIZED = {"quickstart"}


def test_notebooks_are_stored_clean_and_linked_from_the_readme():
    assert {p.stem for p in NOTEBOOKS} == {"quickstart", "sharding_tour", "resume_elsewhere"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name} has outputs"
    repository = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    owner_and_name = repository.removeprefix("https://github.com/")
    badges = re.findall(r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/main/([\w/.-]+\.ipynb)",
                        (ROOT / "README.md").read_text())
    assert sorted(path for _, path in badges) == sorted(f"examples/{p.name}" for p in NOTEBOOKS)
    assert {repo for repo, _ in badges} == {owner_and_name}
    for path in NOTEBOOKS:  # each notebook's own badge and its Colab install cell name the repository
        text = path.read_text()
        assert f"github/{owner_and_name}/blob/main/examples/{path.name}" in text
        assert repository in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
@pytest.mark.slow  # the notebooks, each a kernel's run of the docs' examples
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports the checked-out code
    if path.stem in OPTIMIZED:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != "--xla_backend_optimization_level=0"]
        if flags:
            monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
        else:  # an empty or blank XLA_FLAGS makes XLA abort: it reads it as a file name
            monkeypatch.delenv("XLA_FLAGS", raising=False)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
