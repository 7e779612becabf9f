"""`python -m spmd.corpus --data DIR --out tokens.npy`: tokenize a text corpus once, into a
token file to train from (the library: spmd.data.corpus)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from spmd.base.cli import OneLineErrorParser, nonempty
from spmd.base.errors import EXIT_OUTPUT_FAILED, UserError, one_line_errors
from spmd.base.paths import Output, claim
from spmd.base.signals import STOPPED
from spmd.base.signals import serve as serve_signals


def corpus_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.corpus", description=main.__doc__.splitlines()[0])
    parser.add_argument("--data", type=nonempty, required=True, help="text file or folder (.txt, .jsonl, .parquet)")
    parser.add_argument("--tokenizer", type=nonempty,
                        help="SentencePiece .model or Hugging Face tokenizer.json (default: bytes)")
    parser.add_argument("--text-field", type=nonempty, default="text", help="JSONL/Parquet field holding the text")
    parser.add_argument("--out", type=nonempty, required=True,
                        help="the .npy file to write (its directory is made if needed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m spmd.corpus --data DIR --out tokens.npy`: tokenize once, train from the file."""
    serve_signals("stopped; nothing was written", STOPPED)  # first, before any thread: a signal ends in one line
    parser = corpus_parser()
    with one_line_errors():
        args = parser.parse_args(argv)
        # The library is imported once signals are served, before numpy starts its threads.
        from spmd.data.corpus import data_files, token_stream, write_npy
        from spmd.data.tokenizer import load_tokenizer

        # Before reading anything: tokenizing a large corpus to fail at the end is no use.
        out = claim([Output("--out", args.out, parents=True)],
                    {"--data": args.data, "--tokenizer": args.tokenizer})["--out"]
        if out.stream is None and not args.out.endswith(".npy"):  # a file to train from, named as one
            raise UserError("--out must name a .npy file")
        if data_files(args.data)[0] == "tokens":
            raise UserError(f"--data {args.data} holds token files already")
        tokens = token_stream(args.data, load_tokenizer(args.tokenizer), args.text_field)
    try:
        out.write(functools.partial(write_npy, tokens=tokens))
    except OSError as exc:
        print(f"error: {out.failed(exc)}", file=sys.stderr, flush=True)
        return EXIT_OUTPUT_FAILED
    # The token file may be this command's stdout (--out /dev/stdout): the line then goes to stderr.
    print(f"wrote {tokens.size:,} {tokens.dtype} tokens to {args.out}",
          file=sys.stderr if out.to_stdout else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
