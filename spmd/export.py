"""`python -m spmd.export`: write a checkpoint's parameters only, for inference or
fine-tuning elsewhere.

    python -m spmd.export --checkpoint runs/a [--step N] --out exported/ [--mesh fsdp=8]
    python -m spmd.export --checkpoint runs/a --format hf [--dtype bfloat16] --out hf/

The parameters are read straight into the layout of `--mesh` (default: the mesh that
wrote them). The default format is one Orbax PyTree, `OUT/params`, beside `OUT/model.json`
(model name, step, parameter shapes); reading them back needs no optimizer state. `--format
hf` writes a Hugging Face directory (spmd.formats.hf: config.json, safetensors files with their
index, and the tokenizer files of the run), gathering one layer of one parameter at a time.

`--out` is checked before anything is read: a new directory, or an empty one, that can
be written and is not inside the checkpoint's run. The export is written beside it under
a temporary name (`OUT.tmp-<pid>@<host>`) and renamed to `OUT` when complete, so `OUT`
is whole or absent: a failed write (disk full) removes the temporary and says so in one
line, and a temporary left by a killed export is removed by the next export to `OUT`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import shutil
import sys
from pathlib import Path

from spmd.base.cli import OneLineErrorParser, integer, nonempty
from spmd.base.errors import (EXIT_OUTPUT_FAILED, UserError, held_stderr, one_line_errors, quiet_library_threads,
                         why_io_failed)
from spmd.base.paths import Output, check_writable_dir, claim, remove_stale_temporaries, temporary_name
from spmd.formats.checkpoint import export_params
from spmd.formats.hf import write_hf
from spmd.run.export import hf_parts, restored
from spmd.run.weights import check_source_flags, checkpoint_config


def export_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=nonempty, required=True,
                        help="run directory (latest step) or one step's directory")
    parser.add_argument("--step", type=integer, help="which step of a run directory (default: the latest)")
    parser.add_argument("--out", type=nonempty, required=True, help="new or empty directory to write")
    parser.add_argument("--mesh", type=nonempty,
                        help="mesh to restore onto (default: the one that wrote the checkpoint)")
    parser.add_argument("--cpu-devices", type=integer, help="emulated CPU devices (default: what the mesh needs)")
    parser.add_argument("--format", choices=FORMATS, default="orbax",
                        help="orbax: an Orbax PyTree of the parameters; hf: a Hugging Face directory (default: orbax)")
    parser.add_argument("--dtype", choices=tuple(HF_DTYPES), default="float32",
                        help="--format hf: the tensors' dtype (default: float32, the master weights exactly)")
    parser.add_argument("--max-shard-size", type=byte_size, default=DEFAULT_SHARD,
                        help="--format hf: the most bytes per safetensors file, e.g. 500MB, 5GB, 2GiB (default: 5GB)")
    return parser


DEFAULT_SHARD = "5GB"
UNITS = {"": 1, "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def byte_size(text: str) -> str:
    match = re.fullmatch(r"([0-9]+)\s*([A-Za-z]*)", text)
    if not match or match[2] not in UNITS or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 500MB, 5GB or 2GiB")
    return text


def bytes_of(size: str) -> int:
    match = re.fullmatch(r"([0-9]+)\s*([A-Za-z]*)", size)
    return int(match[1]) * UNITS[match[2]]


FORMATS = ("orbax", "hf")
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def main(argv=None) -> int:
    parser = export_parser()
    restore = quiet_library_threads()
    try:
        with one_line_errors():
            args = parser.parse_args(argv)
            out, cfg, checkpoint = check(args)
            params, cfg = restored(cfg, checkpoint, args.mesh, args.cpu_devices)
            meta = checkpoint.meta
            if args.format == "hf":
                model_cfg, tokenizer_files = hf_parts(cfg, meta)
        if args.format == "hf":
            write(out, args.out, lambda tmp: write_hf_export(tmp, params, model_cfg, args, tokenizer_files))
        else:
            write(out, args.out, lambda tmp: export_params(tmp, params, meta))
    finally:
        restore()
    what = "a Hugging Face directory" if args.format == "hf" else "the parameters"
    print(f"exported {what} of {checkpoint.where} ({cfg.model_name}) to {out}")
    return 0


def write_hf_export(tmp: Path, params, model_cfg, args, tokenizer_files: dict) -> None:
    tmp.mkdir()
    write_hf(tmp, params, model_cfg, HF_DTYPES[args.dtype], bytes_of(args.max_shard_size), tokenizer_files)


def check(args):
    """Everything that can be checked before reading the checkpoint: the flags' ranges,
    the checkpoint (its step and its run's config), and that `--out` can be written and
    is no input. -> (out, the run's config, the checkpoint)"""
    check_source_flags(args.step, args.cpu_devices)
    if args.format != "hf" and (args.dtype != "float32" or args.max_shard_size != DEFAULT_SHARD):
        raise UserError("--dtype and --max-shard-size apply to --format hf")
    cfg, checkpoint = checkpoint_config(args.checkpoint, args.step)

    out = Path(args.out).resolve()
    config = checkpoint.meta.get("config", {})  # --format hf copies the run's tokenizer files from these
    claim([Output("--out", args.out, directory=True)], {
        "--checkpoint": checkpoint.run_dir, "the run's --init-from": config.get("init_from"),
        "the run's tokenizer": config.get("tokenizer")})
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {args.out} is not empty; give a new or empty directory")
    if out.exists():  # the export is written beside it, then renamed over it
        try:
            check_writable_dir(str(out.parent), "--out")
        except UserError:
            raise UserError(f"--out {args.out}: its directory {out.parent} cannot be written (the export is "
                            "written there under a temporary name, then renamed)") from None
    return out, cfg, checkpoint


def write(out: Path, flag_value: str, produce) -> None:
    """Write the export (`produce(directory)`) to a temporary beside `out`, then rename it to `out`. A failure
    (disk full, permission lost) removes what was written, prints one line and exits:
    Orbax's threads may still hold the failed write, and waiting for them can hang."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # to remove if we fail
    tmp = temporary_name(out)
    with held_stderr() as stderr:
        try:
            remove_stale_temporaries(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            produce(tmp)
            os.replace(tmp, out)  # over an empty directory too
        except BaseException as exc:  # noqa: BLE001 - whatever the file system or Orbax raised
            shutil.rmtree(tmp, ignore_errors=True)
            for directory in made:
                with contextlib.suppress(OSError):
                    directory.rmdir()
            if isinstance(exc, KeyboardInterrupt):
                why, code = "interrupted", 130
            elif isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # filled meanwhile
                why, code = f"--out {flag_value} is no longer empty", EXIT_OUTPUT_FAILED
            else:
                why, code = f"writing --out {flag_value} failed ({why_io_failed(exc)})", EXIT_OUTPUT_FAILED
            os.write(stderr, f"error: {why}; nothing was written\n".encode())
            os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
