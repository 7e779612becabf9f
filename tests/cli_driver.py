"""Runs many command-line cases fast: imported once, then one fork per case.

Reads a JSON list of cases ({"module": "spmd.train", "argv": [...], "cwd": DIR}, and
optionally "env": {NAME: value, or null to unset}, "limit": seconds before SIGALRM ends a
case that hangs) on stdin and writes one JSON result per case ({"code", "stdout", "stderr",
"seconds"}). Each case runs its module's `main(argv)` in a child forked before JAX starts a
backend (importing JAX starts no thread), in its own working directory, with its own stdout
and stderr files: what a user running the command there would see, at a few milliseconds a
case.
"""

import importlib
import json
import os
import signal
import sys
import tempfile
import time

MODULES = ("spmd.train", "spmd.plan", "spmd.export", "spmd.launch", "spmd.corpus", "spmd.generate", "spmd.eval")
# What the commands import on their way (the models, Orbax, the layout): loaded once here.
PRELOAD = ("models", "spmd.parallel.layout", "spmd.formats.checkpoint", "spmd.run.loop", "spmd.parallel.step",
           "spmd.data.feed", "spmd.data.corpus", "spmd.data.tokenizer", "spmd.data.records", "spmd.run.resolve",
           "spmd.run.bootstrap", "spmd.run.trainer", "spmd.run.export", "spmd.planner.plan", "spmd.planner.report",
           "spmd.inference.generation", "spmd.inference.evaluation")


def run(module, argv: list[str], cwd: str, env: dict | None = None, limit: int | None = None) -> dict:
    started = time.monotonic()
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: the command, as its own process
        try:
            os.chdir(cwd)
            for name, value in (env or {}).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if limit:
                signal.alarm(limit)  # a case that hangs ends (killed by SIGALRM), not the whole batch
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = module.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - a traceback is what the test looks for
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    return {"code": code, "stdout": texts[0], "stderr": texts[1], "seconds": time.monotonic() - started}


def main() -> None:
    modules = {name: importlib.import_module(name) for name in MODULES}
    for name in PRELOAD:
        importlib.import_module(name)
    cases = json.load(sys.stdin)
    json.dump([run(modules[c["module"]], c["argv"], c["cwd"], c.get("env"), c.get("limit")) for c in cases],
              sys.stdout)


if __name__ == "__main__":
    main()
