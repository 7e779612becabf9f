"""What the commands' parsers share: one-line errors, and argument types that take exactly
what the text says."""

from __future__ import annotations

import argparse
import math
import re

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
# characters): a record is tokenized whole, in 40 to 250 times its size of memory (250 B a
# token), so 8 MiB take 0.3 to 2 GiB; 2 million tokens or more, beyond the contexts trained on.
MAX_RECORD_BYTES = 1 << 23


def flag_of(name: str) -> str:
    """The flag of an option's field name: `grad_accum` -> `--grad-accum`."""
    return "--" + name.replace("_", "-")


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UserError(message)


# Argument types: exactly what the text says, nothing reinterpreted. Python's int() would
# also take "1_000", " 4" and other scripts' digits; float() takes "nan" and "inf".
def integer(text: str) -> int:
    if not re.fullmatch(r"-?[0-9]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    return int(text)


FLOAT32_MAX = 3.4028234663852886e38


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if abs(value) > FLOAT32_MAX:  # (the step computes in float32, where it would be infinite)
        raise argparse.ArgumentTypeError(f"{text!r} is beyond float32's range (at most {FLOAT32_MAX:.4g})")
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
