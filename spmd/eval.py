"""`python -m spmd.eval`: the loss and perplexity of a run's checkpoint, or of a Hugging Face
model, on a dataset, on any mesh.

    python -m spmd.eval --checkpoint runs/a --data held_out.jsonl [--batches 50] [--mesh fsdp=8]

The data go through training's pipeline (spmd.data: the same files, tokenizer, packing into
rows of --seq + 1 tokens) and the loss is training's, compiled for the mesh
(spmd.parallel.step's evaluation): the mean over every target token. Fine-tuning records are
each read once, in order; a token stream's samples once, in the data's shuffled order (the
run's seed); `--batches` reads fewer.
"""

from __future__ import annotations

import math
import sys

from spmd.base.cli import (COUNT, DATA_FLAGS, SEQ, TOKENS_PER_STEP, OneLineErrorParser, add_flag, add_model_source,
                           check_bounds, integer, nonempty)
from spmd.base.errors import one_line_errors, quiet_library_threads
from spmd.base.schema import Bounds
from spmd.base.signals import STOPPED
from spmd.base.signals import serve as serve_signals

BOUNDS = {"batch": Bounds(at_least=1, at_most=TOKENS_PER_STEP), "seq": SEQ, "batches": COUNT,
          "max_record_bytes": DATA_FLAGS["max_record_bytes"].bounds}


def eval_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.eval", description=__doc__.splitlines()[0])
    add_model_source(parser)
    parser.add_argument("--data", type=nonempty, required=True,
                        help="a text file or folder (.txt/.md, .jsonl, .parquet) or token files (.npy, .bin)")
    parser.add_argument("--tokenizer", type=nonempty, help="tokenizer of text data (default: the run's)")
    for name in DATA_FLAGS:  # how the data is read, as spmd.train reads it
        add_flag(parser, name, DATA_FLAGS[name])
    parser.add_argument("--batch", type=integer, help="sequences per batch (default: the run's, or 8)")
    parser.add_argument("--seq", type=integer, help="tokens per sequence (default: the run's, or 512)")
    parser.add_argument("--batches", type=integer, help="batches to read (default: every sample once)")
    return parser


def main(argv=None) -> int:
    serve_signals("stopped; nothing was written", STOPPED)  # first, before any thread: Ctrl-C ends in one line
    parser = eval_parser()
    restore = quiet_library_threads()
    try:
        with one_line_errors():
            args = parser.parse_args(argv)
            check_bounds(args, BOUNDS)
            # The library is imported once signals are served, before numpy starts its threads.
            from spmd.inference.evaluation import evaluate
            from spmd.inference.generation import model_source, on_mesh
            from spmd.run.bootstrap import start_devices_and_mesh

            cfg, checkpoint, tokenizer = model_source(args)
            cfg = on_mesh(cfg, args, data=args.data, tokenizer=args.tokenizer or tokenizer,
                          **{name: getattr(args, name) for name in DATA_FLAGS},
                          batch=args.batch or (cfg.training.batch if checkpoint else 8),
                          seq=args.seq or (cfg.training.seq if checkpoint else 512), eval_every=0, grad_accum=1)
            cfg, layout_line = start_devices_and_mesh(cfg)
            loss, tokens, batches = evaluate(cfg, checkpoint, args.batches)
    finally:
        restore()
    if layout_line:
        print(layout_line)
    print(f"{cfg.data.path}: loss {loss:.4f} nats/token, perplexity {math.exp(loss):.4f} "
          f"({batches} batches of {cfg.training.batch} x {cfg.training.seq}: {tokens:,} target tokens; "
          f"model {cfg.model.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
