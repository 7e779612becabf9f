"""Fine-tuning records: JSONL, Parquet or a `datasets` folder in, tokenized examples out.

A record's keys say what it is (the first that fits, TRL's formats):

- `{"messages": [{"role", "content"}, ...]}`: a chat, rendered by the tokenizer's chat
  template as transformers' `apply_chat_template` renders it, then tokenized without
  special tokens. The loss is on the assistant's turns: the template's `{% generation %}`
  blocks where it has them; otherwise each assistant message's content, and the special
  token (an end-of-turn such as <|im_end|> or <|eot_id|>) that the template puts right
  after it, so that the model learns to end its turn.
- `{"prompt": ..., "completion": ...}`: strings as TRL's SFTTrainer (1.16) tokenizes them:
  the ids of prompt + completion (the completion followed by the end-of-text token unless
  it ends with it), special tokens added; the loss from the first id that is not the
  prompt's own (a token that spans the boundary is learned). Lists of messages: the prompt
  rendered with the generation prompt, then prompt + completion; the loss likewise.
- `{"text": ...}`: the text followed by the end-of-text token (as TRL does), loss on all.

`loss_on="all"` puts the loss on every token instead. An example is `(ids, loss)`:
`loss[i]` is True when token i is trained as the prediction from token i - 1.

Tokenizer directories and chat templates: spmd.data.chat.

Records are read and tokenized one at a time, each with where it came from (`--data FILE,
line N` or `row N`), so that any mistake names its record. A record is bounded before it
is read or tokenized (`max_record_bytes`, --max-record-bytes): a JSONL line's bytes, the
characters of the text it tokenizes (a chat's rendering: spmd.data.chat).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from spmd.base.cli import LOSS_ON, MAX_RECORD_BYTES
from spmd.base.console import human_bytes
from spmd.base.errors import UserError, first_line, optional_module
from spmd.base.paths import read_text
from spmd.base.schema import Invalid, loads, read_json
from spmd.data.corpus import UTF8_BOM, checked_text, data_files, json_kind
from spmd.data.tokenizer import BYTES_PER_TEXT_BYTE, CONFIG_LIMIT, TokenizerDirectory, check_memory, text_bytes

ROLES = ("system", "user", "assistant", "tool")
# What a record too large to tokenize in the memory free can become (spmd.data.tokenizer.check_memory).
TOO_LARGE = ("split it into smaller records, or tokenize it where more memory is free (--max-record-bytes refuses "
             "such records before they are read)")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters that mark assistant content in a second rendering


class Example(NamedTuple):
    ids: np.ndarray  # int32
    loss: np.ndarray  # bool: token i is a target, predicted from token i - 1


# ------------------------------------------------------------------ records

def record_files(path: str) -> tuple[str, list[Path]]:
    """The kind of records under `path` ('jsonl', 'parquet', 'datasets', or 'text': a
    document a file) and its files (a `datasets` folder is one)."""
    root = Path(path)
    if root.is_dir() and (root / "dataset_dict.json").is_file():
        try:
            splits = read_json(root / "dataset_dict.json", CONFIG_LIMIT).get("splits", [])
        except (Invalid, AttributeError):
            splits = []
        raise UserError(f"--data {path} holds several splits (a DatasetDict); give one split's folder: "
                        f"{', '.join(str(root / str(s)) for s in splits) or 'none found'}")
    if _is_datasets_folder(root):
        return "datasets", [root]
    kind, files = data_files(path)
    if kind == "tokens":
        raise UserError(f"--data {path}: token files hold no records to fine-tune on; give JSONL, Parquet, "
                        f"a datasets folder or text")
    return kind, files


def _is_datasets_folder(root: Path) -> bool:
    """A folder that `datasets.Dataset.save_to_disk` wrote."""
    return root.is_dir() and (root / "state.json").is_file() and (root / "dataset_info.json").is_file()


def file_records(kind: str, file: Path, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of one file; `where` names it for messages."""
    if kind == "text":
        yield f"--data {file}", {"text": read_text(file)}
    elif kind == "jsonl":
        for number, line in enumerate(_lines(file, max_record_bytes), 1):
            if not line.strip():
                continue
            where = f"--data {file}, line {number}"
            yield where, jsonl_record(line, where)
    elif kind == "parquet":
        optional_module("pyarrow", "Parquet files")
        # An optional dependency (spmd[data]): imported when a Parquet file is read.
        import pyarrow.parquet as pq

        try:  # a row group at a time: the first record is read without the rest
            batches = pq.ParquetFile(file).iter_batches()
        except Exception as exc:  # pyarrow's own error types
            raise UserError(f"--data {file}: not a readable Parquet file ({exc})") from None
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield f"--data {file}, row {row}", record
                row += 1
    else:
        datasets = optional_module("datasets", "a datasets folder")
        try:
            dataset = datasets.load_from_disk(str(file)).with_format(None)
        except Exception as exc:  # datasets' and pyarrow's own error types
            raise UserError(f"--data {file}: not a readable datasets folder ({first_line(exc)})") from None
        for row, record in enumerate(dataset):
            yield f"--data {file}, row {row}", record


def jsonl_record(line: bytes, where: str) -> dict:
    """One JSONL line's record, read strictly: a key given twice, NaN or Infinity is no record either."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8 text") from None
    try:
        record = loads(line)
    except Invalid as exc:
        raise UserError(f"{where}: {exc}") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: not a JSON object")
    return record


def _lines(file: Path, max_record_bytes: int) -> Iterator[bytes]:
    """A file's lines, read as they are needed (a first record without the rest), none
    read beyond `max_record_bytes` (a line of gigabytes is refused, not held in memory)."""
    try:
        with open(file, "rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(max_record_bytes + 1), b""), 1):
                line = line.removesuffix(b"\n")
                if number == 1:  # read past a byte-order mark (spmd.data.corpus.UTF8_BOM)
                    line = line.removeprefix(UTF8_BOM)
                if len(line) > max_record_bytes:
                    check_record_size(len(line) + _rest_of_line(f), max_record_bytes, f"--data {file}, line {number}")
                yield line
    except OSError as exc:
        raise UserError(f"--data {file} cannot be read: {exc.strerror or exc}") from None


def _rest_of_line(f) -> int:
    """The bytes left of the line a binary file is in, read and not kept."""
    size = 0
    while piece := f.readline(1 << 20):
        if piece.endswith(b"\n"):
            return size + len(piece) - 1
        size += len(piece)
    return size


def check_record_size(size: int, max_record_bytes: int, where: str, unit: str = "bytes") -> None:
    """A record (a line's bytes, a text's characters) within --max-record-bytes, before it
    is read or tokenized."""
    if size > max_record_bytes:
        raise UserError(f"{where}: {size:,} {unit}, more than --max-record-bytes {max_record_bytes:,} (a record is "
                        f"tokenized whole, in up to {BYTES_PER_TEXT_BYTE} times its size of memory: "
                        f"{human_bytes(size * BYTES_PER_TEXT_BYTE)}); give a larger bound to read it where that "
                        f"much memory is free")


def record_format(record: dict, where: str) -> str:
    """'messages', 'prompt/completion' or 'text' (the first whose fields the record has;
    a null field is no field, as in a Parquet column a row leaves empty)."""
    given = {k for k, v in record.items() if v is not None}
    if "messages" in given:
        return "messages"
    if {"prompt", "completion"} <= given:
        return "prompt/completion"
    if "text" in given:
        return "text"
    raise UserError(f"{where}: no known fields (a record holds 'messages', 'prompt' and 'completion', or 'text'; "
                    f"this one has {', '.join(sorted(given)) or 'none'})")


def fine_tuning_format(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> str | None:
    """'messages' or 'prompt/completion' when `path` holds fine-tuning records (its first
    record says), else None: text (any field, --text-field) and token files are read as a
    token stream (spmd.data.corpus). Reads one record."""
    root = Path(path)
    saved = root.is_dir() and ((root / "dataset_dict.json").is_file() or _is_datasets_folder(root))
    # (a DatasetDict is refused by record_files, in one line naming its splits' folders)
    kind, files = record_files(path) if saved else data_files(path)
    if kind not in ("jsonl", "parquet", "datasets"):
        return None
    for where, record in file_records(kind, files[0], max_record_bytes):
        given = {k for k, v in record.items() if v is not None}
        return "messages" if "messages" in given else "prompt/completion" if {"prompt", "completion"} <= given else None
    return None


# The options that apply to one kind of --data only: given for the other, they would change nothing.
RECORD_OPTIONS = ("loss_on", "overlong", "data_workers", "max_record_bytes")
TEXT_OPTIONS = ("text_field", "document_mask")


def refuse_what_does_not_apply(given: Iterable[str], records: bool, data: str) -> None:
    """Of the options `given` (another value than their default), the first that `data`'s
    kind would ignore, refused: fine-tuning records' options for text, and text's for records."""
    ignored = [name for name in given if name in (TEXT_OPTIONS if records else RECORD_OPTIONS)]
    if ignored:
        kind = "fine-tuning records (read by their format)" if records else "text (one token stream)"
        applies = "text data" if records else "fine-tuning records"
        raise UserError(f"--{ignored[0].replace('_', '-')} applies to {applies}; --data {data} holds {kind}")


def examples_of(items: Iterable[tuple[str, object, tuple[str, str]]], tokenizer, loss_on: str = "completion",
                max_record_bytes: int = MAX_RECORD_BYTES) -> list[Example]:
    """The examples of records read by spmd.data.index.RecordIndex.read: (where, record or
    JSONL line, (format, where) of its file's first record)."""
    examples = []
    for where, record, (expected, first) in items:
        try:
            record = jsonl_record(record, where) if isinstance(record, bytes) else record
            found = record_format(record, where)
            if found != expected:
                raise UserError(f"{where}: a {found} record in a file of {expected} records ({first}); "
                                f"one file holds one format")
            examples.append(example(record, where, tokenizer, loss_on, max_record_bytes))
        except MemoryError:  # the host's memory, or this process's limit: one line, not a traceback
            raise UserError(f"{where}: out of memory while tokenizing it; a smaller --max-record-bytes refuses such "
                            f"records before they are tokenized") from None
    return examples


def example(record: dict, where: str, tokenizer, loss_on: str = "completion",
            max_record_bytes: int = MAX_RECORD_BYTES) -> Example:
    """One record's tokens and loss mask (`tokenizer`: a TokenizerDirectory, or any of
    spmd.data.corpus's tokenizers for text and prompt/completion strings); a text of more
    than `max_record_bytes` characters is refused before it is tokenized."""
    if loss_on not in LOSS_ON:
        raise UserError(f"--loss-on {loss_on}: choose {' or '.join(LOSS_ON)}")
    found = record_format(record, where)
    if found == "text":
        text = checked_text(record["text"], where, "text")
        check_record_size(len(text), max_record_bytes, where, "characters of text")
        check_memory(tokenizer, text_bytes(text), where, TOO_LARGE)
        ids, loss = _text(text, tokenizer, where)
    elif found == "prompt/completion" and not isinstance(record["prompt"], list):
        prompt = checked_text(record["prompt"], where, "prompt")
        completion = checked_text(record["completion"], where, "completion")
        check_record_size(len(prompt) + len(completion), max_record_bytes, where, "characters of prompt and completion")
        check_memory(tokenizer, text_bytes(prompt) + text_bytes(completion), where, TOO_LARGE)
        ids, start = _prompt_completion(prompt, completion, tokenizer, where)
        loss = np.arange(ids.size) >= start
    else:
        ids, loss = _chat(record, where, tokenizer, found == "prompt/completion", max_record_bytes)
    return Example(ids.astype(np.int32), np.ones(ids.size, bool) if loss_on == "all" else loss)


def _eos_token(tokenizer, where: str) -> str:
    if tokenizer.eos_token is None:
        raise UserError(f"{where}: --tokenizer {tokenizer.path} names no end-of-text token (eos_token) to end it")
    return tokenizer.eos_token


def text_examples(texts: Iterable[str], tokenizer, where: str = "--data") -> Iterator[Example]:
    """Plain documents as examples: each followed by the end-of-text token, the loss on
    every token (an empty document is none)."""
    for text in texts:
        if text:
            yield Example(*_text(text, tokenizer, where))


def _text(text: str, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(tokenizer, TokenizerDirectory):  # TRL: the end-of-text token's text appended, then tokenized
        eos = _eos_token(tokenizer, where)
        ids = tokenizer.tokens(text if text.endswith(eos) else text + eos)[0]
    else:
        ids = np.append(tokenizer.encode([text])[0], tokenizer.eos)
    return ids.astype(np.int32), np.ones(ids.size, bool)


def _prompt_completion(prompt: str, completion: str, tokenizer, where: str) -> tuple[np.ndarray, int]:
    """The ids of prompt + completion and where the completion starts."""
    if isinstance(tokenizer, TokenizerDirectory):
        eos = _eos_token(tokenizer, where)
        completion = completion if completion.endswith(eos) else completion + eos
        ids = tokenizer.tokens(prompt + completion)[0]
        return ids, _common_prefix(tokenizer.tokens(prompt)[0], ids)
    ids = tokenizer.encode([prompt + completion])[0]
    ids = ids if ids.size and ids[-1] == tokenizer.eos else np.append(ids, tokenizer.eos)
    return ids, _common_prefix(tokenizer.encode([prompt])[0], ids)


def _common_prefix(prompt: np.ndarray, ids: np.ndarray) -> int:
    """How many ids begin as the prompt's own do (TRL's common_prefix_length): where a
    token spans the prompt's end, or the template renders the prompt alone otherwise,
    the completion starts where they differ."""
    n = min(prompt.size, ids.size)
    differ = np.flatnonzero(prompt[:n] != ids[:n])
    return int(differ[0]) if differ.size else n


def _messages(value, field: str, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise UserError(f"{where}: {field} is {json_kind(value)}, not a list of messages")
    if not value:
        raise UserError(f"{where}: {field} is an empty list")
    for n, message in enumerate(value):
        if not isinstance(message, dict):
            raise UserError(f"{where}: {field}[{n}] is {json_kind(message)}, not a message object")
        role = message.get("role")
        if role not in ROLES:
            raise UserError(f"{where}: {field}[{n}] has role {role!r}; roles are {', '.join(ROLES)}")
        checked_text(message.get("content"), where, f"{field}[{n}].content")
    return value


def _template_of(tokenizer, where: str, who: str = "chat records"):
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise UserError(f"{where}: {who} need a chat template, and --tokenizer "
                        f"{getattr(tokenizer, 'path', tokenizer.name)} has none (chat_template.jinja, or "
                        f"chat_template in tokenizer_config.json)")
    return template


def chat_prompt(text: str, tokenizer) -> np.ndarray:
    """The ids of a user's message as a chat model is prompted with it: rendered by the
    tokenizer's chat template with the generation prompt, as `apply_chat_template(...,
    add_generation_prompt=True)` does."""
    template = _template_of(tokenizer, "--chat", "chat prompts")
    rendered, _ = template.render([{"role": "user", "content": text}], tokenizer.special_tokens, "--chat",
                                  add_generation_prompt=True)
    return tokenizer.tokens(rendered, special=False)[0]


def _chat(record: dict, where: str, tokenizer, conversational_prompt: bool,
          max_record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    template = _template_of(tokenizer, where)
    tools = record.get("tools")
    if isinstance(tools, str):  # TRL's datasets keep tools as a JSON string
        try:
            tools = loads(tools.encode())
        except Invalid as exc:
            raise UserError(f"{where}: tools: {exc}") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"{where}: tools is {json_kind(tools)}, not a list of objects")
    options = dict(variables=tokenizer.special_tokens, where=where, tools=tools, max_chars=max_record_bytes)
    if conversational_prompt:  # TRL: the loss starts after the prompt rendered with its generation prompt
        render = functools.partial(template.render, **options)
        prompt = _messages(record["prompt"], "prompt", where)
        messages = prompt + _messages(record["completion"], "completion", where)
        text, _ = render(messages)
        check_memory(tokenizer, text_bytes(text), where, TOO_LARGE)
        ids = tokenizer.tokens(text, special=False)[0]
        prompt_ids = tokenizer.tokens(render(prompt, add_generation_prompt=True)[0], special=False)[0]
        return ids, np.arange(ids.size) >= _common_prefix(prompt_ids, ids)
    messages = _messages(record["messages"], "messages", where)
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: messages have no assistant turn to train on")
    template = template.for_training()  # as TRL's assistant-only loss swaps a published template it knows
    render = functools.partial(template.render, **options)
    text, spans = render(messages)
    check_memory(tokenizer, text_bytes(text), where, TOO_LARGE)
    ids, offsets = tokenizer.tokens(text, special=False)
    if not template.has_generation:
        spans = _ended(_content_spans(messages, text, render, where, template.where), ids, offsets,
                       tokenizer.special_ids)
    return ids, _overlapping(offsets, spans)


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """The tokens whose characters overlap a span (spans in order), as transformers'
    assistant mask: a token cut by a span's edge is in it."""
    mask, k = np.zeros(len(offsets), bool), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k][0]
    return mask


def _content_spans(messages: list[dict], text: str, render, where: str, template: str
                   ) -> list[tuple[int, int]]:
    """Where the assistant messages' contents are in `text`. Exactly, where the template
    renders them unchanged: a second rendering with each content between two markers
    must give `text` once the markers are taken out. Otherwise by search: every message's
    content (or, trimmed, as templates often do) found in order, each after the last."""
    marked = [dict(m, content=_OPEN + m["content"] + _CLOSE) if m["role"] == "assistant" else m for m in messages]
    if not any(c in text for c in (_OPEN, _CLOSE)):
        try:
            with_marks = render(marked)[0]
        except UserError:  # a template that checks the content: fall back to searching
            with_marks = ""
        marks = [(m.start(), m.group()) for m in re.finditer(f"[{_OPEN}{_CLOSE}]", with_marks)]
        pairs = [(marks[i][0] - i, marks[i + 1][0] - i - 1) for i in range(0, len(marks) - 1, 2)]
        if (re.sub(f"[{_OPEN}{_CLOSE}]", "", with_marks) == text and len(marks) == 2 * len(pairs) and
                all(marks[i][1] == _OPEN and marks[i + 1][1] == _CLOSE for i in range(0, len(marks), 2)) and
                len(pairs) == sum(m["role"] == "assistant" for m in messages)):
            return pairs
    spans, at = [], 0
    for n, message in enumerate(messages):
        content = message["content"]
        found = next(((i, c) for c in dict.fromkeys((content, content.strip())) if c
                      for i in [text.find(c, at)] if i >= 0), None)
        if found is None:
            if message["role"] == "assistant" and content.strip():
                raise UserError(f"{where}: messages[{n}]'s content is not in the rendering of the chat template "
                                f"({template}); without {{% generation %}} blocks the assistant's turns are found "
                                f"by their content")
            continue
        at = found[0] + len(found[1])
        if message["role"] == "assistant":
            spans.append((found[0], at))
    return spans


def _ended(spans: list[tuple[int, int]], ids: np.ndarray, offsets: list[tuple[int, int]],
           special: set[int]) -> list[tuple[int, int]]:
    """Each span with the special token that starts where it ends (the turn's end), if any."""
    starts = {}
    for i, (start, end) in enumerate(offsets):
        if end > start:
            starts.setdefault(start, i)
    ended = []
    for start, end in spans:
        i = starts.get(end)
        ended.append((start, offsets[i][1] if i is not None and int(ids[i]) in special else end))
    return ended
