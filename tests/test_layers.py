"""The layers of the code (pyproject.toml's import-linter contracts, docs/architecture.md):
`lint-imports` keeps them, and breaks on an upward import; the imports left inside
functions say why they are there (none may dodge a cycle)."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))  # this tree's packages, not the installed ones
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_layers_hold_and_an_upward_import_breaks_them(tmp_path):
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout
    for part in ("spmd", "models"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    skeleton = tmp_path / "spmd" / "parallel" / "skeleton.py"
    skeleton.write_text(skeleton.read_text() + "\nfrom spmd.run.config import TrainConfig  # the parallel core reaching up\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "spmd.parallel.skeleton -> spmd.run.config" in result.stdout
    assert "No cycles are allowed in spmd" in result.stdout  # the run already imports the parallel core


def test_every_import_inside_a_function_says_why():
    """An import inside a function is there for start-up (commands serve signals before
    numpy starts threads), for an optional dependency, or to import on first use; a
    comment or the docstring says which. One without a word may be dodging a cycle."""
    silent = []
    for path in sorted([*ROOT.glob("spmd/**/*.py"), *ROOT.glob("models/**/*.py")]):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    before = lines[fn.lineno - 1:node.lineno]
                    said = any("#" in line for line in before) or "import" in (ast.get_docstring(fn) or "")
                    if not said:
                        silent.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not silent, f"imports inside functions with no reason given: {silent}"


def _private_names_used_across_modules(path: Path) -> list[str]:
    """Where `path` imports a private name (`_x`) from another of the project's modules, or
    reads one off an imported module (`module._x`)."""
    tree, found, modules = ast.parse(path.read_text()), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("spmd", "models"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.lineno}: {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] in ("spmd", "models")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_ones_private_names():
    """What one module needs of another is its public surface: a private name used across
    modules is a seam that should be named (spmd.parallel.pipeline.kit is such a surface)."""
    found = {str(path.relative_to(ROOT)): names for path in sorted([*ROOT.glob("spmd/**/*.py"), *ROOT.glob("models/**/*.py")])
             if (names := _private_names_used_across_modules(path))}
    assert found == {}


def test_the_family_contract_names_every_registered_family():
    """pyproject.toml forbids spmd/ to import a family's package; the list must hold every
    family of the registry (models.FAMILIES), or a new family escapes the contract."""
    import tomllib

    from models import FAMILIES

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden = next(c for c in contracts if c["name"].startswith("Nothing under spmd/ names a model family"))
    families = {".".join(cls.__module__.split(".")[:2]) for pair in FAMILIES.items() for cls in pair}
    assert set(forbidden["forbidden_modules"]) == families


def test_the_loop_reads_its_data_through_the_source_surface_alone():
    """spmd.data.source.DataSource is what a run's data is to the trainer, the loop and
    evaluation: no probing a source for what it might have (hasattr/getattr)."""
    import re

    probes = [f"{path.relative_to(ROOT)}:{n}" for path in sorted([*ROOT.glob("spmd/run/*.py"), *ROOT.glob("spmd/inference/*.py")])
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"\b(hasattr|getattr)\((self\.|run\.)?(source|data)\b", line)]
    assert probes == []


def test_no_function_is_longer_than_80_lines():
    """A function that grows past a screen and a half gets split by what its parts do (the
    pipeline schedules' ticks and the training loop were; docs/architecture.md)."""
    long = [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for path in sorted([*ROOT.glob("spmd/**/*.py"), *ROOT.glob("models/**/*.py")])
            for fn in ast.walk(ast.parse(path.read_text()))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > 80]
    assert long == []


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The names `fn` takes (`*args` and `**kwargs` count), a method's `self` or `cls` aside."""
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def test_no_function_takes_more_than_8_parameters():
    """A long argument list is a long body moved to the call sites: what travels together
    gets a name of its own (the kernels' `Mask`, the schedules' `PipelineRun`,
    `StageProgram` and `Head`, the loss's `Auxiliary`, the loop's `RunSetup`)."""
    many = [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({len(_parameters(fn))} parameters)"
            for path in sorted([*ROOT.glob("spmd/**/*.py"), *ROOT.glob("models/**/*.py")])
            for fn in ast.walk(ast.parse(path.read_text()))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(_parameters(fn)) > 8]
    assert many == []
