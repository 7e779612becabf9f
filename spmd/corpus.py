"""`python -m spmd.corpus --data DIR --out tokens.npy`: tokenize a text corpus once, into a
token file to train from (the library: spmd.data.corpus); or, with `--seq`, tokenize and
pack fine-tuning records once into rows to train from with the same --seq
(spmd.data.packed_file)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from spmd.base.cli import DATA_FLAGS, SEQ, OneLineErrorParser, add_flag, check_bounds, integer, nonempty
from spmd.base.errors import EXIT_OUTPUT_FAILED, UserError, one_line_errors
from spmd.base.paths import Output, claim
from spmd.base.signals import STOPPED
from spmd.base.signals import serve as serve_signals


DATA_OPTIONS = ("text_field", "loss_on", "overlong", "max_record_bytes")  # spmd.base.cli.DATA_FLAGS' it takes
ROW_TOKENS = 1 << 20  # tokens of the packed rows made at a time (9 bytes each: 9 MiB)


def corpus_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.corpus", description=main.__doc__.splitlines()[0])
    parser.add_argument("--data", type=nonempty, required=True, help="text file or folder (.txt, .jsonl, .parquet)")
    parser.add_argument("--tokenizer", type=nonempty,
                        help="SentencePiece .model, Hugging Face tokenizer.json, or a tokenizer directory (fine-tuning "
                        "records: their chat template too); default: bytes")
    parser.add_argument("--out", type=nonempty, required=True,
                        help="the .npy file to write (its directory is made if needed)")
    parser.add_argument("--seq", type=integer, help="fine-tuning records: pack them into rows of --seq + 1 tokens, "
                        "to train with the same --seq (--tokenizer: their tokenizer directory)")
    for name in DATA_OPTIONS:
        add_flag(parser, name, DATA_FLAGS[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m spmd.corpus --data DIR --out tokens.npy`: tokenize once, train from the file."""
    serve_signals("stopped; nothing was written", STOPPED)  # first, before any thread: a signal ends in one line
    parser = corpus_parser()
    with one_line_errors():
        args = parser.parse_args(argv)
        check_bounds(args, {"seq": SEQ, "max_record_bytes": DATA_FLAGS["max_record_bytes"].bounds})
        # The library is imported once signals are served, before numpy starts its threads.
        from spmd.data.corpus import data_files, token_stream, write_npy
        from spmd.data.records import fine_tuning_format, refuse_what_does_not_apply
        from spmd.data.tokenizer import load_tokenizer, tokenizer_inputs

        # Before reading anything: tokenizing a large corpus to fail at the end is no use.
        out = claim([Output("--out", args.out, parents=True)],
                    {"--data": args.data, **tokenizer_inputs(args.tokenizer, "--tokenizer")})["--out"]
        if out.stream is None and not args.out.endswith(".npy"):  # a file to train from, named as one
            raise UserError("--out must name a .npy file")
        records = fine_tuning_format(args.data, args.max_record_bytes)  # (JSONL, Parquet or a datasets folder)
        refuse_what_does_not_apply([name for name in DATA_OPTIONS if getattr(args, name) != DATA_FLAGS[name].default],
                                   records, args.data)
        if records:
            array, wrote = _packed(args)
        elif data_files(args.data)[0] == "tokens":
            raise UserError(f"--data {args.data} holds token files already")
        elif args.seq is not None:
            raise UserError(f"--seq packs fine-tuning records; --data {args.data} holds text (it becomes one token "
                            f"stream, cut into rows as training reads it)")
        else:
            array = token_stream(args.data, load_tokenizer(args.tokenizer), args.text_field)
            if not array.size:  # a token file that no run could train from
                raise UserError(f"--data {args.data} holds no text (0 tokens); nothing to write")
            wrote = f"{array.size:,} {array.dtype} tokens"
    try:
        out.write(functools.partial(write_npy, tokens=array))
    except OSError as exc:
        print(f"error: {out.failed(exc)}", file=sys.stderr, flush=True)
        return EXIT_OUTPUT_FAILED
    # The file may be this command's stdout (--out /dev/stdout): the line then goes to stderr.
    print(f"wrote {wrote} to {args.out}", file=sys.stderr if out.to_stdout else sys.stdout)
    return 0


def _packed(args):
    """The records of `args.data` packed into rows (spmd.data.packed_file.PACKED), in order."""
    # The library is imported once signals are served, as in main.
    import numpy as np

    from spmd.data.packed_file import as_packed
    from spmd.data.stream import Rows, packed_rows, record_source

    if args.seq is None:
        raise UserError(f"--data {args.data} holds fine-tuning records: give --seq to pack them into rows "
                        f"(and train with the same --seq)")
    # Rows are made a batch at a time, of at most ROW_TOKENS tokens (a row at least), whatever --seq.
    batch = max(1, ROW_TOKENS // (args.seq + 1))
    source = record_source(args.data, args.tokenizer, Rows(args.seq + 1, batch), loss_on=args.loss_on,
                           overlong=args.overlong, max_record_bytes=args.max_record_bytes)
    try:
        batches, targets = packed_rows(source)
    finally:
        source.close()
    rows = np.concatenate([as_packed(b) for b in batches])
    return rows, f"{len(rows):,} rows of {args.seq} ({targets:,} target tokens; {len(source.index):,} examples)"


if __name__ == "__main__":
    sys.exit(main())
