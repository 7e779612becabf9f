"""README.md and the pages of docs/ point at what exists, and show commands that parse.

- Every relative Markdown link resolves to a file or folder of the repository, and its
  `#anchor`, if any, to a heading of the target page (GitHub's slug of it).
- Every path of the repository named in a code span (`spmd/parallel/mesh.py`) exists.
- Every command shown in a code block (fenced as bash, sh, shell or console, or with no
  language; or indented) that runs `python -m spmd.<cmd>` or a console script
  (`spmd-train`, …), also behind `srun`, environment assignments, `&&`, inside a quoted
  command (`gcloud … --command "…"`) or after `spmd.launch … --`, is parsed by that
  command's own argument parser, which refuses an unknown flag or a malformed value. Nothing
  runs: tests/test_readme.py runs the `python -m spmd.` commands.
- README.md stays a front door.

Fast: it reads text and builds parsers; nothing is compiled.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import tomllib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

from models import PRESETS

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
# Placeholders for shell variables a command may show ($NODES, ${SLURM_PROCID}).
SHELL_VALUES = {"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "NODE_RANK": "0", "RANK": "0",
                "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------- Markdown

@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the block's first line of content
    info: str  # a fence's language ("" for none); "indented" for an indented block
    lines: list[str]


def split_markdown(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """The page's prose lines (numbered, code blocks left out) and its code blocks."""
    prose, blocks = [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)", line)
        if fence:
            marker, info = fence.group(1), fence.group(2).lower()
            body, i = [], i + 1
            while i < len(lines) and not re.match(rf"^ {{0,3}}{marker[0]}{{{len(marker)},}}\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            blocks.append(Block(Path(), i - len(body) + 1, info, body))
            i += 1
            continue
        # An indented code block starts after a blank line (not inside a list item's text).
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            start, body = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            if not _in_list_item(lines, start):
                blocks.append(Block(Path(), start + 1, "indented", body))
                continue
            prose.extend((start + 1 + k, "    " + b) for k, b in enumerate(body))
            continue
        prose.append((i + 1, line))
        i += 1
    return prose, blocks


def _in_list_item(lines: list[str], start: int) -> bool:
    """Whether an indented run of lines continues a list item (then it is prose)."""
    for j in range(start - 1, -1, -1):
        if not lines[j].strip():
            continue
        return bool(re.match(r"^\s*([-*+]|\d+[.)])\s", lines[j])) or lines[j].startswith("  ")
    return False


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text as rendered (links, images and code marks
    dropped), lowercased, every character but letters, digits, `-`, `_` and spaces removed,
    spaces turned into `-`."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = split_markdown(page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)(\s+#+\s*)?$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    found |= {m for _, line in prose for m in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line)}
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline and reference link of the page's prose."""
    prose, _ = split_markdown(page.read_text())
    found = []
    for number, line in prose:
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        found += [(number, t) for t in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)]
        found += [(number, t) for t in re.findall(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", line)]
    return found


def test_the_pages_are_found():
    names = {_rel(p) for p in PAGES}
    assert {"README.md", "docs/architecture.md"} <= names, names
    assert len(names) > 10, names


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_resolves_to_a_file_and_heading(page):
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, …
            continue
        path, _, anchor = target.partition("#")
        path = urllib.parse.unquote(path)
        where = f"{_rel(page)}:{number}: {target}"
        dest = (page.parent / path).resolve() if path else page
        if path.startswith("/") or not dest.is_relative_to(ROOT.resolve()):
            broken.append(f"{where} (outside the repository)")
            continue
        if not dest.exists():
            broken.append(f"{where} (no file {_rel(dest)})")
            continue
        if anchor:
            if dest.suffix != ".md":
                broken.append(f"{where} (an anchor into a file that is not Markdown)")
            elif urllib.parse.unquote(anchor) not in anchors(dest):
                broken.append(f"{where} (no heading #{anchor} in {_rel(dest)}; it has: "
                              f"{', '.join(sorted(anchors(dest)))})")
    assert not broken, "\n".join(broken)


REPO_PATH = re.compile(r"^(?:spmd|models|benchmarks|tests|examples|mesh_configs|docs|\.ci)/[\w./-]*$")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_path_named_in_code_exists(page):
    """A file the text names in a code span (`spmd/base/hardware.toml`) is where it says:
    the text moves with the code."""
    prose, _ = split_markdown(page.read_text())
    missing = [f"{_rel(page)}:{number}: {span}" for number, line in prose
               for span in re.findall(r"`([^`]+)`", line)
               if REPO_PATH.match(span) and not (ROOT / span).exists()]
    assert not missing, "\n".join(missing)


PYTHON_NAME = re.compile(r"^((?:spmd|models)(?:\.\w+)+)(?:\(.*\))?$")


def resolves(name: str) -> bool:
    """Whether a dotted name is a module, or an attribute of one, as `import` finds it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_python_name_in_code_exists():
    """A name of the Python API the text shows (`spmd.layout.make_layout(cfg, devices)`,
    `models.FAMILIES`) imports: the text moves with the code."""
    missing = []
    for page in PAGES:
        prose, _ = split_markdown(page.read_text())
        for number, line in prose:
            for span in re.findall(r"`([^`]+)`", line):
                m = PYTHON_NAME.match(span)
                if m and not resolves(m.group(1)):
                    missing.append(f"{_rel(page)}:{number}: {span}")
    assert not missing, "\n".join(missing)


# ----------------------------------------------------------------------------- commands

def command_blocks() -> list[Block]:
    found = []
    for page in PAGES:
        _, blocks = split_markdown(page.read_text())
        for block in blocks:
            if block.info in SHELL_BLOCKS or block.info == "indented":
                block.page = page
                found.append(block)
    return found


def command_lines(block: Block) -> list[tuple[int, str]]:
    """(line, text) of each command of a block: continuation lines joined; in a console
    block, only the lines after a `$ ` prompt."""
    out, current, start = [], None, 0
    for k, raw in enumerate(block.lines):
        text = raw.strip()
        if current is None:
            if block.info == "console":
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            current, start = "", block.line + k
        current += " " + text.rstrip("\\").strip() if current else text.rstrip("\\").strip()
        if not text.endswith("\\"):
            out.append((start, current))
            current = None
    if current is not None:
        out.append((start, current))
    return out


def scripts() -> dict[str, str]:
    """Console script -> the module whose `main` it runs (pyproject's [project.scripts])."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in table.items()}


def invocations(text: str) -> list[tuple[str, list[str]]]:
    """(module, argv) of every spmd command a shell line runs, however it is wrapped."""
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_VALUES.get(m.group(1), "1"), text)
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as exc:
        raise AssertionError(f"not a shell command ({exc}): {text}") from None
    found = []
    by_script = scripts()
    segment: list[str] = []
    for token in [*tokens, "&&"]:
        if token in ("&&", "||", ";", "|", "&"):
            found += _in_segment(segment, by_script)
            segment = []
        else:
            segment.append(token)
    return found


def _in_segment(tokens: list[str], by_script: dict[str, str]) -> list[tuple[str, list[str]]]:
    for i, token in enumerate(tokens):
        name = token.removeprefix("!")
        if (re.fullmatch(r"(.*/)?python[0-9.]*", name) and tokens[i + 1:i + 2] == ["-m"]
                and tokens[i + 2:i + 3] and tokens[i + 2].startswith("spmd.")):
            return [(tokens[i + 2], tokens[i + 3:])]
        if name in by_script:
            return [(by_script[name], tokens[i + 1:])]
        if " " in token and re.search(r"python[0-9.]* -m spmd\.|(^|[\s;&|])spmd-[a-z]+\b", token):
            return invocations(token)  # a quoted command: gcloud … --command "cd spmd && python -m spmd.train …"
    return []


def parsers() -> dict:
    """Each command module -> (parse, parser): `parse(argv)` reads argv the way the command
    does, raising (SystemExit or spmd's UserError) on an unknown flag or a malformed value;
    `parser()` builds the command's argparse parser, for its flags' full names."""
    from spmd.run.config import parse, train_parser  # parse: argparse, with --config's keys as flags

    plan_flags = importlib.import_module("spmd.plan").plan_flags

    def plan_parser():
        parser = train_parser()
        plan_flags(parser)
        return parser

    def plain(module: str):  # the command module's own `<cmd>_parser()`
        make = getattr(importlib.import_module(module), module.split(".")[-1] + "_parser")
        return (lambda argv: make().parse_args(argv)), make

    return {"spmd.train": ((lambda argv: parse(argv)), train_parser),
            "spmd.plan": ((lambda argv: parse(argv, add_extras=plan_flags)), plan_parser),
            **{m: plain(m) for m in ("spmd.export", "spmd.generate", "spmd.eval", "spmd.corpus", "spmd.launch")}}


def variants(text: str) -> list[str]:
    """The command as shown, with its [optional] parts and without them."""
    return list(dict.fromkeys([re.sub(r"\[([^]]*)\]", r"\1", text), re.sub(r"\s*\[[^]]*\]", "", text)]))


def all_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) of every spmd command in every code block; spmd.launch's
    launched command counted on its own."""
    out = []
    for block in command_blocks():
        for number, text in command_lines(block):
            where = f"{_rel(block.page)}:{number}: {text}"
            for variant in variants(text):
                pending = invocations(variant)
                while pending:
                    module, argv = pending.pop(0)
                    if module == "spmd.launch" and "--" in argv:
                        split = argv.index("--")
                        pending += invocations(shlex.join(argv[split + 1:]))
                        argv = argv[:split]
                    out.append((where, module, argv))
    return out


def test_the_pages_show_every_command():
    modules = {module for _, module, _ in all_commands()}
    assert modules >= {"spmd.train", "spmd.plan", "spmd.export", "spmd.generate", "spmd.eval", "spmd.corpus",
                       "spmd.launch"}, modules


def test_every_command_module_exists():
    """`python -m spmd.<cmd>` and each console script name a module that is there."""
    named = {module for _, module, _ in all_commands()} | set(scripts().values())
    missing = sorted(m for m in named if importlib.util.find_spec(m) is None)
    assert not missing, f"shown or installed, but no such module: {missing}"


def test_every_command_parses_with_its_parser():
    from spmd.base.errors import UserError

    parse = parsers()
    refused = []
    for where, module, argv in all_commands():
        if module not in parse:
            refused.append(f"{where}\n  {module}: no parser known to this test")
            continue
        read, parser = parse[module]
        # argparse takes a prefix of a flag (`--microbatch` for `--microbatches`): the text
        # shows each flag's full name, so a flag renamed to a longer one is caught too.
        known = parser()._option_string_actions
        partial = [arg.split("=")[0] for arg in argv if arg.startswith("--") and arg != "--"
                   and arg.split("=")[0] not in known]
        if partial:
            refused.append(f"{where}\n  {module}: not the full name of a flag: {partial}")
        try:
            read(argv)
        except SystemExit as exc:  # argparse: exit 2 on an unknown flag (exit 0 for --help)
            if exc.code not in (0, None):
                refused.append(f"{where}\n  {module} {shlex.join(argv)}: exit {exc.code}")
        except UserError as exc:  # spmd's parsers say what is wrong in one line
            refused.append(f"{where}\n  {module} {shlex.join(argv)}: {exc}")
    assert not refused, "\n".join(refused)


def test_every_config_file_shown_exists():
    missing = [f"{where}: {argv[argv.index('--config') + 1]}" for where, _, argv in all_commands()
               if "--config" in argv and not (ROOT / argv[argv.index("--config") + 1]).is_file()]
    assert not missing, "\n".join(missing)


def test_a_stale_flag_is_refused():
    """The check itself: a flag no parser knows fails it."""
    parse = {module: read for module, (read, _) in parsers().items()}
    for module, argv in [("spmd.train", ["--mesh", "dp=2", "--no-such-flag"]), ("spmd.plan", ["--nope", "1"]),
                         ("spmd.generate", ["--checkpoint", "runs/a", "--prompt", "x", "--max-tokens", "3"]),
                         ("spmd.launch", ["--nprocs", "2"])]:
        with pytest.raises((SystemExit, importlib.import_module("spmd.base.errors").UserError)):
            parse[module](argv)


# ----------------------------------------------------------------------------- the front door

def test_the_readme_is_a_front_door():
    # README.md is what spmd is, the two set-up commands, the capabilities (each linked to
    # its page), the mesh and one example per axis: a page read in a minute. Everything
    # else has a page in docs/; a README that grows past this is growing a manual again.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; move the detail into a page of docs/"
    text = "\n".join(lines)
    assert "    pip install -e . && python -m spmd.train\n" in text + "\n"
    assert '    pip install -e ".[test]" && pytest\n' in text + "\n"


def test_the_architecture_pages_package_table_lists_every_module():
    """docs/architecture.md's table of packages names each package's modules (a package
    inside it counts as one) and counts them; a module added or removed breaks it."""
    table = re.findall(r"^\| `((?:spmd|models)/[\w/]*)` \| (.*) \| (\d+)(?: \+ families)? \|$",
                       (ROOT / "docs" / "architecture.md").read_text(), re.M)
    assert len(table) >= 12
    for package, text, count in table:
        folder = ROOT / package
        modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        modules |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()} if package != "models" else set()
        named = set(re.findall(r"`([\w.]+)`", text))
        assert modules <= named, (package, modules - named)
        assert int(count) == len(modules), (package, sorted(modules))


def test_the_model_option_names_every_preset():
    """docs/training.md's `--model` row lists what `--model` takes: a new preset (a new
    family's, as the recipe of docs/architecture.md says) is named there."""
    row = next(line for line in (ROOT / "docs" / "training.md").read_text().splitlines() if line.startswith("| `--model`"))
    named = set(re.findall(r"`([a-z0-9.-]+)`", row))
    assert set(PRESETS) - named == set() and named - set(PRESETS) - {"--model", "--resume"} == set()
