"""What the commands' parsers share: one-line errors, and argument types that take exactly
what the text says."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Sequence

from spmd.base.errors import UserError
from spmd.base.schema import Bounds

# Choices and ranges that several commands' flags share.
DTYPES = ("float32", "bfloat16")  # compute dtypes
TOKEN_DTYPES = ("uint16", "uint32")  # of raw .bin token files
LOSS_ON = ("completion", "all")  # the tokens of fine-tuning records that the loss is on
OVERLONG = ("truncate", "split")  # what becomes of a fine-tuning example longer than a row
SEED = Bounds(at_least=0, at_most=2**32 - 1)  # JAX keeps 32 bits of a seed (2**32 would draw as 0)
# A row's tokens (--seq): 2**24, beyond every published model's context (10M tokens), and
# a row's arrays (9 bytes a token, packed) fit any host. Checked before anything is allocated.
SEQ = Bounds(at_least=1, at_most=2**24)
# The largest fine-tuning record read (a JSONL line's bytes; a text's or a chat's rendered
# characters): a record is tokenized whole, in 250 to 450 times its UTF-8 size of memory
# (spmd.data.tokenizer.BYTES_PER_TEXT_BYTE), so 8 MiB take 2 to 4 GiB; 2 million tokens or
# more, beyond the contexts trained on.
MAX_RECORD_BYTES = 1 << 23
# Tokens a step holds (--batch x --seq): 2**30, 16 times the largest published batch
# (DeepSeek-V3's 63M tokens); the rows' arrays on the host (9 bytes a token, packed) stay
# within 10 GiB.
TOKENS_PER_STEP = 2**30
# A count the commands take (a batch's sequences, batches, top-k): within int32, where JAX holds it.
COUNT = Bounds(at_least=1, at_most=2**31 - 1)
# What --max-record-bytes may be raised to: a terabyte, beyond any host's memory (a record's
# tokenizing is checked against the memory free before it starts: spmd.data.records).
RECORD_BYTES = Bounds(at_least=1, at_most=1 << 40)


def flag_of(name: str) -> str:
    """The flag of an option's field name: `grad_accum` -> `--grad-accum`."""
    return "--" + name.replace("_", "-")


def changed(options, names: Sequence[str]) -> list[str]:
    """Of the fields `names` of the dataclass `options` (a run's TrainConfig), those given
    another value than their default."""
    defaults = {f.name: f.default for f in dataclasses.fields(options)}
    return [name for name in names if getattr(options, name) != defaults[name]]


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


# The integers spmd reads are 64-bit (every count and size it hands on fits one): a longer
# number is refused by its length, before Python's int() reads it (which it does for up to
# 4,300 digits, then raises a ValueError of its own).
INT64 = Bounds(at_least=-(2**63), at_most=2**63 - 1)


def shown(value: object, most: int = 40) -> str:
    """A value as a one-line message quotes it: its repr, cut at `most` characters."""
    text = repr(value)
    if len(text) <= most:
        return text
    return text[:most - 3] + "..." + (f" ({len(value):,} characters)" if isinstance(value, str) else "")


def parse_integer(text: str, what: str, bounds: Bounds | None = None) -> int:
    """`text` as an integer, or a UserError "{what} must be ..." (`what` names it: "--steps",
    "mesh axis dp"). Exactly what the text says: plain ASCII digits with an optional minus
    (Python's int() would also take "1_000", " 4", "+4" and other scripts' digits), within
    `bounds` and 64 bits."""
    if not re.fullmatch(r"-?[0-9]+", text):
        raise UserError(f"{what} must be an integer, got {shown(text)}".lstrip())
    value = int(text) if len(text.lstrip("-").lstrip("0")) <= 19 else None  # 2**63 has 19 digits
    if value is None or not INT64.holds(value) or bounds is not None and not bounds.holds(value):
        wanted = bounds or f"a 64-bit integer ({INT64})"
        raise UserError(f"{what} must be {wanted}, got {shown(text) if value is None else value}".lstrip())
    return value


# Argument types: exactly what the text says, nothing reinterpreted; float() takes "nan" and "inf".
def integer(text: str) -> int:
    try:
        return parse_integer(text, "")
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


FLOAT32_MAX = 3.4028234663852886e38


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a finite number")
    if abs(value) > FLOAT32_MAX:  # (the step computes in float32, where it would be infinite)
        raise argparse.ArgumentTypeError(f"{shown(text)} is beyond float32's range (at most {FLOAT32_MAX:.4g})")
    return value


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the value is empty")
    return text


def check_bounds(args: argparse.Namespace, bounds: dict[str, Bounds]) -> None:
    """Each flag of `bounds` that was given holds its bounds."""
    for name, b in bounds.items():
        value = getattr(args, name)
        if value is not None and not b.holds(value):
            raise UserError(f"{flag_of(name)} must be {b}, got {value}")


@dataclasses.dataclass(frozen=True)
class Flag:
    """An option every command that reads data takes alike (spmd.train's TrainConfig field,
    spmd.corpus's and spmd.eval's flags): its default, its help, what it accepts."""

    default: object
    help: str
    bounds: Bounds = Bounds()
    choices: tuple | None = None


# How the data is read: one definition for the commands that read it.
DATA_FLAGS = {
    "text_field": Flag("text", "the field of JSONL records / column of Parquet files that holds the text"),
    "token_dtype": Flag("uint16", "dtype of raw .bin token files (.npy files say their own)", choices=TOKEN_DTYPES),
    "loss_on": Flag("completion", "fine-tuning records (prompt/completion, chat messages): the tokens the loss is on: "
                    "the completion and the assistant's turns, or all", choices=LOSS_ON),
    "overlong": Flag("truncate", "a fine-tuning example longer than --seq + 1 tokens: keep its start (truncate) or "
                     "cut it into pieces, each its own example (split)", choices=OVERLONG),
    "max_record_bytes": Flag(MAX_RECORD_BYTES, "fine-tuning records: the largest record read, in bytes of its JSONL "
                             "line and characters of the text it tokenizes (a chat: its rendering); a record is "
                             "tokenized whole, in hundreds of times its size of memory, checked against the memory "
                             "free before it is tokenized", RECORD_BYTES),
    "document_mask": Flag(False, "text and token data: documents do not see each other (attention stops at each "
                          "end-of-text token, positions restart); default: windows of the stream, as in GPT-style "
                          "pre-training"),
}


def add_flag(parser, name: str, flag: Flag, **given) -> None:
    """`--name` on `parser` as `flag` defines it, of the type its default has (`given`:
    argparse's keywords that differ, e.g. a group's)."""
    options = {"default": flag.default, "help": f"{flag.help} (default: {flag.default})", **given}
    if isinstance(flag.default, bool):
        parser.add_argument(flag_of(name), action=argparse.BooleanOptionalAction, **options)
    elif flag.choices:
        parser.add_argument(flag_of(name), choices=flag.choices, **options)
    else:
        parser.add_argument(flag_of(name), type=integer if isinstance(flag.default, int) else nonempty, **options)


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """The flags that stand a trained model up on a mesh (spmd.generate's and spmd.eval's)."""
    parser.add_argument("--checkpoint", type=nonempty, help="a run directory (latest step) or one step's directory")
    parser.add_argument("--step", type=integer, help="which step of a run directory (default: the latest)")
    parser.add_argument("--init-from", type=nonempty, help="a Hugging Face model directory instead of a checkpoint")
    parser.add_argument("--adapter", type=nonempty, help="with --init-from: a PEFT LoRA adapter directory to apply")
    parser.add_argument("--mesh", type=nonempty, default=None,
                        help="mesh axis sizes: tp splits the heads, dp/fsdp/ep the batch (default: a layout of the "
                             "devices found, said in the first line)")
    parser.add_argument("--cpu-devices", type=integer, help="emulated CPU devices (default: what the mesh needs)")
