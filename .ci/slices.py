"""The slice of the slow tier that each CI run takes, in turn (docs/contributing.md).

`.ci/slow-slices` holds one line per submission: the slice of the slow tier (0 to SLICES - 1)
that the submission's CI run takes. A submission's last commit appends the next slice,
(the previous line + 1) mod SLICES, so consecutive CI runs take consecutive slices and each
slow test runs within any SLICES consecutive CI runs, however many commits a submission adds.
CI keeps nothing between runs, so the rotation is kept in the history, and checked there:

    python .ci/slices.py            the slice HEAD's CI run takes, as K/N (.ci/run), once HEAD
                                    is seen to append it; else one `error:` line, and exit 1
    python .ci/slices.py --advance  append the next slice and commit it: a submission's last
                                    commit (run it again after dropping it, if commits follow)

What the history cannot show is refused where it can be seen: HEAD must append exactly one
line, the next slice, and the commit that appended the line before it must have changed the
ledger last (no other commit since). Two ledger commits in one submission look like two
submissions in the history: the workflow (drop the earlier one, `--advance` refuses to append
on top of a ledger commit) keeps them out. Standard library only: .ci/run checks before it
makes a virtualenv.
"""

import argparse
import subprocess
import sys
from pathlib import Path

SLICES = 3
LEDGER = ".ci/slow-slices"
ROOT = Path(__file__).resolve().parents[1]
ADVANCE = "python .ci/slices.py --advance"


class Refused(Exception):
    """What the ledger's rule refuses, said in one line with what to do."""


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if done.returncode:
        raise Refused(f"git {' '.join(args)}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
    return done.stdout


def has(root: Path, rev: str) -> bool:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"],
                          capture_output=True).returncode == 0


def ledger(root: Path, rev: str) -> list[int] | None:
    """The slices listed at commit `rev`, or None where the ledger is missing."""
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{rev}:{LEDGER}"], capture_output=True).returncode:
        return None
    return parse(git(root, "show", f"{rev}:{LEDGER}"), f"{LEDGER} at {rev}")


def parse(text: str, where: str) -> list[int]:
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if line not in {str(k) for k in range(SLICES)}:
            shown = repr(line if len(line) <= 20 else line[:20] + "...")
            raise Refused(f"{where}, line {i}: {shown} is not a slice (0 to {SLICES - 1})")
    return [int(line) for line in lines]


def commit_name(root: Path, rev: str) -> str:
    name, _, subject = git(root, "log", "-1", "--format=%h %s", rev).strip().partition(" ")
    return f"{name} ({subject if len(subject) <= 50 else subject[:50] + '...'})"


def appends(root: Path, rev: str) -> bool:
    """Whether commit `rev` appends exactly one line to the ledger (to its first parent's)."""
    now, before = ledger(root, rev), ledger(root, f"{rev}^") if has(root, f"{rev}^") else None
    return bool(now) and before is not None and now[:-1] == before


def check_previous(root: Path, base: str) -> list[int]:
    """The ledger at `base`, once its last line is seen to be the last change to it: the commit
    that last changed it (in base's history) appended that line, or made the ledger with it."""
    lines = ledger(root, base)
    if not lines:
        raise Refused(f"{base} has no {LEDGER} (or an empty one) to take the next slice from")
    touched = git(root, "log", "--format=%H", base, "--", LEDGER).split()
    last = touched[0]
    made = len(touched) == 1 and len(lines) == 1  # the first line: where the rotation starts
    if not (made or (appends(root, last) and ledger(root, last) == lines)):
        raise Refused(f"commit {commit_name(root, last)} changes {LEDGER} other than by appending one line, after "
                      f"the line before this submission's: drop that change from the history (git rebase -i), then "
                      f"{ADVANCE}")
    return lines


def check(root: Path = ROOT) -> int:
    """The slice HEAD's CI run takes: the line HEAD's commit appends, the next after the
    previous submission's; Refused otherwise."""
    if git(root, "rev-parse", "--is-shallow-repository").strip() == "true":
        raise Refused("a shallow clone: the check of the slow tier's slice reads the history (git fetch --unshallow)")
    now = ledger(root, "HEAD")
    if now is None:
        raise Refused(f"HEAD has no {LEDGER}: it lists the slow tier's slice of each submission's CI run")
    before = ledger(root, "HEAD^") if has(root, "HEAD^") else None
    if not before:
        raise Refused(f"HEAD's commit makes {LEDGER}: a submission's last commit appends to it ({ADVANCE})")
    if now == before:
        last = git(root, "log", "-1", "--format=%h", "HEAD", "--", LEDGER).strip()
        raise Refused(f"HEAD's commit does not append the slow tier's next slice to {LEDGER} (its last line, "
                      f"slice {before[-1]}, came with {commit_name(root, last)}): a submission's last commit "
                      f"appends it: {ADVANCE} (if {last} is this submission's, drop it first: docs/contributing.md)")
    if now[:-1] != before:
        raise Refused(f"HEAD's commit changes {LEDGER} other than by appending one line: restore it "
                      f"(git checkout HEAD^ -- {LEDGER}), then append the next slice ({ADVANCE})")
    check_previous(root, "HEAD^")
    want = (before[-1] + 1) % SLICES
    if now[-1] != want:
        what = "repeats" if now[-1] == before[-1] else "skips to"
        raise Refused(f"HEAD's commit {what} slice {now[-1]} in {LEDGER}: after slice {before[-1]} comes {want} "
                      f"(of {SLICES}); drop that commit and {ADVANCE}")
    return now[-1]


def advance(root: Path = ROOT, again: bool = False) -> int:
    """Append the next slice to the ledger and commit it alone, as a submission's last commit."""
    lines = check_previous(root, "HEAD")
    path = root / LEDGER
    if not path.is_file() or parse(path.read_text(), LEDGER) != lines:
        raise Refused(f"{LEDGER} has changes not committed: restore it (git checkout HEAD -- {LEDGER}), then {ADVANCE}")
    if appends(root, "HEAD") and not again:
        raise Refused(f"HEAD already appends slice {lines[-1]} to {LEDGER}: this submission's ledger commit is made. "
                      f"If HEAD is the previous submission's last commit (this one has no other), add --again")
    k = (lines[-1] + 1) % SLICES
    path.write_text("".join(f"{x}\n" for x in [*lines, k]))
    git(root, "commit", "-q", "-m", f"ci: slow slice {k} of {SLICES} for this submission's CI run ({LEDGER})",
        "--", LEDGER)
    return k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--advance", action="store_true", help="append the next slice and commit it (a submission's "
                                                               "last commit)")
    parser.add_argument("--again", action="store_true", help="with --advance: also when HEAD appends to the ledger "
                                                             "(the previous submission's last commit)")
    args = parser.parse_args(argv)
    try:
        if args.advance:
            k = advance(ROOT, args.again)
            print(f"appended and committed slice {k} of {SLICES}: this submission's CI run takes it, while this "
                  f"commit is the last (after another commit, drop this one and advance again: docs/contributing.md)")
        else:
            print(f"{check(ROOT)}/{SLICES}")
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
