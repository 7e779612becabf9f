"""`python -m spmd.export`: write a checkpoint's parameters only, for inference or
fine-tuning elsewhere.

    python -m spmd.export --checkpoint runs/a [--step N] --out exported/ [--mesh fsdp=8]
    python -m spmd.export --checkpoint runs/a --format hf [--dtype bfloat16] --out hf/
    python -m spmd.export --checkpoint runs/lora --format peft --out adapter/
    python -m spmd.export --init-from Llama-3.2-1B --adapter adapter/ --format hf --out merged/

The parameters are read straight into the layout of `--mesh` (default: the devices found,
laid out as spmd.generate lays them: spmd.parallel.defaults). The default format is one
Orbax PyTree, `OUT/params`, beside `OUT/model.json` (model name, step, parameter shapes);
reading them back needs no optimizer state. `--format hf` writes a Hugging Face directory
(spmd.formats.hf: config.json, safetensors files with their index, and the tokenizer files
of the run), gathering one layer of one parameter at a time; of a LoRA run, the model with
its adapters merged into the weights (PEFT's merge_and_unload), which `--init-from BASE
--adapter DIR` also makes of a PEFT adapter. `--format peft` writes a LoRA run's adapters as
a PEFT adapter directory (spmd.formats.peft).

`--out` is checked before anything is read: a new directory, or an empty one, that can
be written and is not inside the checkpoint's run. The export is written beside it under
a temporary name (`OUT.tmp-<pid>@<host>`) and renamed to `OUT` when complete, so `OUT`
is whole or absent: a failed write (disk full) removes the temporary and says so in one
line, and a temporary left by a killed export is removed by the next export to `OUT`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from spmd.base.cli import OneLineErrorParser, integer, nonempty
from spmd.base.errors import UserError, one_line_errors, quiet_library_threads
from spmd.base.signals import STOPPED
from spmd.base.signals import serve as serve_signals


def export_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=nonempty, help="run directory (latest step) or one step's directory")
    parser.add_argument("--init-from", type=nonempty,
                        help="instead of --checkpoint: a Hugging Face model directory, with --adapter (--format hf)")
    parser.add_argument("--adapter", type=nonempty, help="with --init-from: a PEFT adapter directory to merge")
    parser.add_argument("--step", type=integer, help="which step of a run directory (default: the latest)")
    parser.add_argument("--out", type=nonempty, required=True, help="new or empty directory to write")
    parser.add_argument("--mesh", type=nonempty,
                        help="mesh to restore onto (default: the devices found, laid out as spmd.generate lays them)")
    parser.add_argument("--cpu-devices", type=integer, help="emulated CPU devices (default: what the mesh needs)")
    parser.add_argument("--format", choices=FORMATS, default="orbax",
                        help="orbax: an Orbax PyTree of the parameters; hf: a Hugging Face directory (a LoRA run's "
                        "adapters merged); peft: a LoRA run's adapters as a PEFT adapter directory (default: orbax)")
    parser.add_argument("--dtype", choices=tuple(HF_DTYPES), default="float32",
                        help="--format hf and peft: the tensors' dtype (default: float32, the master weights exactly)")
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


FORMATS = ("orbax", "hf", "peft")
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def main(argv=None) -> int:
    serve_signals("stopped; nothing was written", STOPPED)  # first, before any thread: a signal ends in one line
    parser = export_parser()
    restore = quiet_library_threads()
    try:
        with one_line_errors():
            args = parser.parse_args(argv)
            # The library is imported once signals are served, before numpy starts its threads.
            from spmd.formats.checkpoint import export_params
            from spmd.formats.hf import write_hf
            from spmd.run.export import checked, hf_parts, merged, restored, write, write_adapter

            if args.format == "orbax" and args.dtype != "float32":
                raise UserError("--dtype applies to --format hf and peft")
            if args.format != "hf" and args.max_shard_size != DEFAULT_SHARD:
                raise UserError("--max-shard-size applies to --format hf")
            out, cfg, checkpoint = checked(args)
            meta = checkpoint.meta if checkpoint else {"config": {"init_from": args.init_from}}
            if args.format == "hf":  # its files checked before the checkpoint is read
                model_cfg, tokenizer_files = hf_parts(cfg, meta)
            params, cfg = restored(cfg, checkpoint, args.mesh, args.cpu_devices)
        if args.format == "hf":
            def produce(tmp: Path) -> None:
                tmp.mkdir()
                write_hf(tmp, merged(params, cfg), model_cfg, HF_DTYPES[args.dtype], bytes_of(args.max_shard_size),
                         tokenizer_files)
        elif args.format == "peft":
            def produce(tmp: Path) -> None:
                tmp.mkdir()
                write_adapter(tmp, params, cfg, meta["config"].get("init_from"), HF_DTYPES[args.dtype])
        else:
            def produce(tmp: Path) -> None:
                export_params(tmp, params, meta)
        write(out, args.out, produce)
    finally:
        restore()
    what = {"hf": "a Hugging Face directory", "peft": "a PEFT adapter directory"}.get(args.format, "the parameters")
    source = checkpoint.where if checkpoint else f"{args.init_from} with the adapter {args.adapter}"
    print(f"exported {what} of {source} ({cfg.model.name}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
