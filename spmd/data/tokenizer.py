"""Tokenizers (`--tokenizer`): UTF-8 bytes (none given), a SentencePiece model, a Hugging
Face tokenizer.json, or a Hugging Face tokenizer directory, which adds the special tokens
its config names and its chat template (spmd.data.chat).

A directory (tokenizer.json, tokenizer_config.json, maybe special_tokens_map.json and
chat_template.jinja) is read as transformers 5 reads it for the generic fast tokenizer:
the special tokens the config names are added when tokenizer.json lacks them; the legacy
special_tokens_map.json counts only when the config has no added_tokens_decoder;
`add_bos_token`/`add_eos_token` are ignored (tokenizer.json's post-processor decides);
chat_template.jinja wins over the config's template. Tokenizer classes with their own
pipeline (transformers 5 rebuilds e.g. Qwen2Tokenizer's from vocabulary and merges) are
read through their tokenizer.json alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spmd.base.console import human_bytes
from spmd.base.errors import UserError, optional_module
from spmd.base.hardware import free_memory_bytes
from spmd.base.paths import regular_file
from spmd.base.schema import Invalid, read_bytes, read_json
from spmd.data.chat import ChatTemplate

CONFIG_LIMIT = 1 << 26  # bytes: a config may list a few hundred thousand added tokens
# End-of-text tokens that Hugging Face tokenizers commonly define, in order of preference.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


# The memory tokenizing a text whole takes, per byte of its UTF-8: a Hugging Face tokenizer's
# encoding (ids, offsets, token strings, masks), then the ids and offsets as Python objects.
# Measured here from 260 (ASCII words) to 420 (byte-level BPE of many scripts' characters);
# the bound keeps a margin. A tokenizer that runs out of memory aborts the process without a
# word, so a text is checked against the memory free before it is tokenized (check_memory).
BYTES_PER_TEXT_BYTE = 512
_CHECKED_FROM = 1 << 20  # texts of fewer bytes are not checked (they take at most 512 MiB)


def text_bytes(text: str) -> int:
    """The size of `text` in UTF-8, without encoding it where it is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_memory(tokenizer, size: int, where: str, advice: str) -> None:
    """Tokenizing a text of `size` UTF-8 bytes whole with `tokenizer` must fit the memory
    this process has free; otherwise a UserError naming `where`, the memory, and what to do."""
    need = size * getattr(tokenizer, "memory_per_byte", BYTES_PER_TEXT_BYTE)
    if size < _CHECKED_FROM or need <= (free := free_memory_bytes()):
        return
    raise UserError(f"{where}: tokenizing its {size:,} bytes of text takes up to {human_bytes(need)} of memory, and "
                    f"this process has {human_bytes(free)} free; {advice}")


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256). NUL, which text files do not hold, is
    dropped from the text and separates documents."""

    vocab_size = 256
    eos = 0
    name = "bytes"
    memory_per_byte = 16  # the bytes, then their ids as int64 and int32

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode().replace(b"\0", b""), np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; an id that is no byte, or bytes that are no UTF-8, become U+FFFD."""
        parts, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            parts.append(run.decode(errors="replace") + "\ufffd")
            run = bytearray()
        return "".join(parts) + run.decode(errors="replace")


class SentencePieceTokenizer:
    def __init__(self, path: Path):
        spm = optional_module("sentencepiece", "a SentencePiece tokenizer")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise UserError(f"--tokenizer {path}: not a SentencePiece model ({exc})") from None
        self.vocab_size, self.eos, self.name = self._sp.get_piece_size(), self._sp.eos_id(), path.name
        if self.eos < 0:
            raise UserError(f"--tokenizer {path} defines no end-of-text token to separate documents")

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int64) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return _decode_known(ids, self.vocab_size, lambda known: self._sp.decode(known))


class HuggingFaceTokenizer:
    def __init__(self, path: Path):
        tokenizers = optional_module("tokenizers", "a tokenizer.json")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception types
            raise UserError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({exc})") from None
        # A document is tokenized whole and unpadded, whatever tokenizer.json's own settings say.
        self._tok.no_truncation()
        self._tok.no_padding()
        # Its ids, not their count, must be the model's tokens: a tokenizer.json may number
        # its tokens with gaps (an added token at 1000 in a vocabulary of 11).
        largest = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), largest + 1)
        self.name = path.name
        found = [self._tok.token_to_id(name) for name in EOS_NAMES]
        found = [i for i in found if i is not None]
        if not found:
            raise UserError(f"--tokenizer {path} has none of the end-of-text tokens {', '.join(EOS_NAMES)}")
        self.eos = found[0]

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int64) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return _decode_known(ids, self.vocab_size, lambda known: self._tok.decode(known, skip_special_tokens=False))


def _decode_known(ids: Sequence[int], vocab_size: int, decode) -> str:
    """`decode` of the runs of ids the tokenizer has; each other id (a model's vocabulary
    may be larger than its tokenizer's) becomes U+FFFD."""
    parts, run = [], []
    for i in map(int, ids):
        if 0 <= i < vocab_size:
            run.append(i)
            continue
        parts.append((decode(run) if run else "") + "\ufffd")
        run = []
    return "".join(parts) + (decode(run) if run else "")


def load_tokenizer(path: str | None):
    if path is None:
        return ByteTokenizer()
    if Path(path).is_dir():
        return TokenizerDirectory(Path(path))
    file = regular_file(path, "--tokenizer")
    if file.suffix == ".json":
        return HuggingFaceTokenizer(file)
    if file.suffix == ".model":
        return SentencePieceTokenizer(file)
    raise UserError(f"--tokenizer {path}: give a SentencePiece .model or a Hugging Face tokenizer.json")


# The files of a tokenizer directory read beside its tokenizer.json (TokenizerDirectory):
# its config, its legacy special tokens and its chat template.
DIRECTORY_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tokenizer_inputs(path: str | Path | None, name: str) -> dict[str, str]:
    """What the tokenizer `path` is read from, for spmd.base.paths.claim's inputs: the file
    or directory itself and, for a tokenizer.json, the files of its directory that are
    read with it (chat records and --chat read the directory: load_tokenizer_directory).
    `name`: how a refusal names the tokenizer ("--tokenizer", "the run's tokenizer")."""
    if not path:
        return {}
    inputs = {name: str(path)}
    if Path(path).name == "tokenizer.json":
        beside = (Path(path).parent / file for file in DIRECTORY_FILES)
        inputs |= {f"the {file.name} beside {name}": str(file) for file in beside if file.exists()}
    return inputs


def check_vocab(tokenizer, vocab: int, what: str = "--tokenizer") -> None:
    """A tokenizer's every id must be one of the model's tokens (`what`: how the message names the tokenizer)."""
    if tokenizer.vocab_size > vocab:
        raise UserError(f"{what} {tokenizer.name} has token ids up to {tokenizer.vocab_size - 1:,}, beyond the "
                        f"model's vocabulary of {vocab:,} (ids 0 to {vocab - 1:,})")


class TokenizerDirectory(HuggingFaceTokenizer):
    """A Hugging Face tokenizer directory: the tokenizer, its special tokens (the chat
    template's variables) and its chat template. Its `encode` and `decode` are a
    tokenizer.json's (no special tokens added); `eos` is the config's end-of-text token
    (where the config names none, the first of EOS_NAMES the tokenizer has)."""

    def __init__(self, path: Path):  # not HuggingFaceTokenizer's: the end-of-text token is the config's
        tokenizers = optional_module("tokenizers", "a tokenizer directory")
        self.path, self.name = path, path.name
        if not os.path.lexists(path / "tokenizer.json"):
            raise UserError(f"--tokenizer {path}: no tokenizer.json in the directory")
        regular_file(str(path / "tokenizer.json"), "--tokenizer")  # (a directory, a FIFO, a broken link: said)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises its own exception types
            raise UserError(f"--tokenizer {path}/tokenizer.json: not a Hugging Face tokenizer ({exc})") from None
        # transformers encodes whole texts unpadded whatever tokenizer.json's own settings say.
        self._tok.no_truncation()
        self._tok.no_padding()
        config = self._json("tokenizer_config.json") or {}
        if not isinstance(config, dict):
            raise UserError(f"--tokenizer {path}/tokenizer_config.json: not a JSON object")
        if "added_tokens_decoder" not in config:  # transformers reads the legacy file only then
            config = {**config, **(self._json("special_tokens_map.json") or {})}
        # Every "*_token" string (or token object) is a named special token and a template variable.
        named = {k: token for k, v in config.items() if k.endswith("_token") and (token := _token(v)) is not None}
        self.special_tokens = {k: v.content for k, v in named.items()}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else extra if isinstance(extra, list) else []
        declared = config.get("added_tokens_decoder")
        declared = declared if isinstance(declared, dict) else {}
        declared = [_token(declared[k]) for k in sorted(declared, key=lambda k: int(k) if k.isdigit() else -1)]
        self._add_missing(declared + list(named.values()) + [_token(t) for t in extra])
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}
        largest = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), largest + 1)
        self.eos_token = self.special_tokens.get("eos_token") or next(
            (t for t in EOS_NAMES if self._tok.token_to_id(t) is not None), None)
        self.eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if self.eos_token and self.eos is None:
            raise UserError(f"--tokenizer {path}: the end-of-text token {self.eos_token!r} is no token of it")
        self.chat_template = self._template(config)

    def _json(self, name: str):
        file = self.path / name
        if not file.exists():
            return None
        try:
            return read_json(file, CONFIG_LIMIT)
        except Invalid as exc:
            raise UserError(f"--tokenizer {file}: {exc}") from None

    def _add_missing(self, tokens: list) -> None:
        """Add the tokens tokenizer.json does not have, as transformers does on loading
        (a token of the vocabulary keeps its id; a new one gets the next)."""
        have = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = []
        for token in tokens:
            if token is not None and token.content not in have:
                missing.append(token)
                have.add(token.content)
        if missing:
            self._tok.add_tokens(missing)

    def _template(self, config: dict) -> ChatTemplate | None:
        file = self.path / "chat_template.jinja"
        if os.path.lexists(file):  # a directory, a FIFO or a broken link is refused, not skipped
            return ChatTemplate(_template_text(file), f"--tokenizer {file}")
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
            if source is None:
                raise UserError(f"--tokenizer {self.path}/tokenizer_config.json: several chat templates, "
                                f"none named 'default'")
        if source is not None and not isinstance(source, str):
            raise UserError(f"--tokenizer {self.path}/tokenizer_config.json: chat_template is not a string")
        return ChatTemplate(source, f"--tokenizer {self.path}/tokenizer_config.json") if source else None

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def tokens(self, text: str, special: bool = True) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The ids of `text` (with the post-processor's special tokens when `special`, as
        transformers' `tokenizer(text)`), and each token's character span."""
        encoding = self._tok.encode(text, add_special_tokens=special)
        return np.asarray(encoding.ids, np.int32), encoding.offsets


def _template_text(file: Path) -> str:
    """A chat_template.jinja's text: a regular file of UTF-8, no larger than a config that
    could hold it (read_bytes: a FIFO would block, a device never end)."""
    try:
        data = read_bytes(file, CONFIG_LIMIT)
    except Invalid as exc:
        raise UserError(f"--tokenizer {file} {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--tokenizer {file}: not UTF-8 text (byte {exc.start})") from None


def _token(value):
    """A special token as a config writes it (a string, or an object with "content"), as a
    tokenizers.AddedToken; None for anything else (`add_bos_token: true` also ends in _token)."""
    tokenizers = optional_module("tokenizers", "a tokenizer directory")
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        return tokenizers.AddedToken(value["content"], **{"normalized": False, "special": True, **flags})
    return None


def load_tokenizer_directory(path: str | None, who: str = "fine-tuning records (prompt/completion, chat messages)"
                             ) -> TokenizerDirectory:
    """The Hugging Face tokenizer directory `path`, or the one of the tokenizer.json it
    names (--init-from's, spmd.run.resolve); `who` needs it (for the message if there is none)."""
    if path is None:
        raise UserError(f"{who} need a Hugging Face tokenizer directory: give --tokenizer DIR, or --init-from a "
                        f"model directory that has one")
    given = Path(path)
    if given.is_file() and given.name == "tokenizer.json":
        given = given.parent
    if not given.is_dir():
        raise UserError(f"--tokenizer {path} is not a directory ({who} need a Hugging Face tokenizer directory)")
    return TokenizerDirectory(given)
