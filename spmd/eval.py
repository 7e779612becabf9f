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

from spmd.base.cli import (COUNT, LOSS_ON, MAX_RECORD_BYTES, OVERLONG, RECORD_BYTES, SEQ, TOKEN_DTYPES, TOKENS_PER_STEP,
                           OneLineErrorParser, add_model_source, check_bounds, integer, nonempty)
from spmd.base.errors import one_line_errors, quiet_library_threads
from spmd.base.schema import Bounds
from spmd.base.signals import STOPPED
from spmd.base.signals import serve as serve_signals

BOUNDS = {"batch": Bounds(at_least=1, at_most=TOKENS_PER_STEP), "seq": SEQ, "batches": COUNT,
          "max_record_bytes": RECORD_BYTES}


def eval_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.eval", description=__doc__.splitlines()[0])
    add_model_source(parser)
    parser.add_argument("--data", type=nonempty, required=True,
                        help="a text file or folder (.txt/.md, .jsonl, .parquet) or token files (.npy, .bin)")
    parser.add_argument("--tokenizer", type=nonempty, help="tokenizer of text data (default: the run's)")
    parser.add_argument("--text-field", type=nonempty, default="text", help="JSONL field / Parquet column of the text")
    parser.add_argument("--token-dtype", choices=TOKEN_DTYPES, default="uint16", help="dtype of raw .bin token files")
    parser.add_argument("--loss-on", choices=LOSS_ON, default="completion",
                        help="fine-tuning records: the tokens the loss is on (the completion and assistant turns, "
                        "or all)")
    parser.add_argument("--overlong", choices=OVERLONG, default="truncate",
                        help="fine-tuning records: an example longer than --seq + 1 tokens is truncated or split")
    parser.add_argument("--max-record-bytes", type=integer, default=MAX_RECORD_BYTES,
                        help="fine-tuning records: the largest record read, in bytes of its JSONL line and characters "
                        f"of the text it tokenizes (a chat: its rendering) (default: {MAX_RECORD_BYTES})")
    parser.add_argument("--document-mask", action="store_true",
                        help="text and token data: documents do not see each other")
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
            cfg = on_mesh(cfg, args, data=args.data, tokenizer=args.tokenizer or tokenizer, text_field=args.text_field,
                          token_dtype=args.token_dtype, loss_on=args.loss_on, overlong=args.overlong,
                          max_record_bytes=args.max_record_bytes,
                          document_mask=args.document_mask, batch=args.batch or (cfg.batch if checkpoint else 8),
                          seq=args.seq or (cfg.seq if checkpoint else 512), eval_every=0, grad_accum=1)
            cfg, layout_line = start_devices_and_mesh(cfg)
            loss, tokens, batches = evaluate(cfg, checkpoint, args.batches)
    finally:
        restore()
    if layout_line:
        print(layout_line)
    print(f"{cfg.data}: loss {loss:.4f} nats/token, perplexity {math.exp(loss):.4f} "
          f"({batches} batches of {cfg.batch} x {cfg.seq}: {tokens:,} target tokens; model {cfg.model_name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
