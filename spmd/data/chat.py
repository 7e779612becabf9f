"""Hugging Face tokenizer directories and their chat templates, read as transformers 5
reads them for the generic fast tokenizer.

A directory holds tokenizer.json, tokenizer_config.json, and maybe special_tokens_map.json
and chat_template.jinja. The special tokens the config names are added when tokenizer.json
lacks them; the legacy special_tokens_map.json counts only when the config has no
added_tokens_decoder; `add_bos_token`/`add_eos_token` are ignored (tokenizer.json's
post-processor decides); chat_template.jinja wins over the config's template. Tokenizer
classes with their own pipeline (transformers 5 rebuilds e.g. Qwen2Tokenizer's from
vocabulary and merges) are read through their tokenizer.json alone.

A chat template is compiled in the environment transformers' `apply_chat_template` uses
(a sandbox, trim_blocks and lstrip_blocks, loop controls, its helpers), and renders the
character spans of its `{% generation %}` blocks with the text.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
from pathlib import Path

import numpy as np

from spmd.base.errors import UserError, first_line
from spmd.base.schema import Invalid, read_json
from spmd.data.corpus import EOS_NAMES, HuggingFaceTokenizer, _optional, _read_text

CONFIG_LIMIT = 1 << 26  # bytes: a config may list a few hundred thousand added tokens
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # one message field under the names templates read


# ------------------------------------------------------------------ tokenizer directories

class TokenizerDirectory(HuggingFaceTokenizer):
    """A Hugging Face tokenizer directory: the tokenizer, its special tokens (the chat
    template's variables) and its chat template. Its `encode` and `decode` are a
    tokenizer.json's (no special tokens added); `eos` is the config's end-of-text token
    (where the config names none, the first of corpus.EOS_NAMES the tokenizer has)."""

    def __init__(self, path: Path):  # not HuggingFaceTokenizer's: the end-of-text token is the config's
        tokenizers = _optional("tokenizers", "a tokenizer directory")
        self.path, self.name = path, path.name
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"--tokenizer {path}: no tokenizer.json in the directory")
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
        if file.is_file():
            return ChatTemplate(_read_text(file, "--tokenizer"), f"--tokenizer {file}")
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


def _token(value):
    """A special token as a config writes it (a string, or an object with "content"), as a
    tokenizers.AddedToken; None for anything else (`add_bos_token: true` also ends in _token)."""
    tokenizers = _optional("tokenizers", "a tokenizer directory")
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        return tokenizers.AddedToken(value["content"], **{"normalized": False, "special": True, **flags})
    return None


def load_tokenizer_directory(path: str) -> TokenizerDirectory:
    if not Path(path).is_dir():
        raise UserError(f"--tokenizer {path} is not a directory (chat and prompt/completion records need a "
                        f"Hugging Face tokenizer directory)")
    return TokenizerDirectory(Path(path))


# ------------------------------------------------------------------ chat templates

class ChatTemplate:
    """A chat template compiled as transformers compiles it (a sandbox, trim_blocks and
    lstrip_blocks, loop controls, its helpers), with the character spans of its
    `{% generation %}` blocks."""

    def __init__(self, source: str, where: str):
        jinja2 = _optional("jinja2", "a chat template")
        self.where, self.has_generation = where, bool(_GENERATION.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise UserError(f"{where}: the chat template does not compile ({first_line(exc)})") from None

    def render(self, messages: list, variables: dict, where: str, tools=None,
               add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and its generation blocks' spans (`where`: the record, for errors)."""
        messages = [_aliased({k: v for k, v in m.items() if v is not None}) for m in messages]
        written, spans = [0], []
        pieces = []
        token = _TRACKING.set((written, spans))
        try:
            for piece in self._template.generate(**variables, messages=messages, tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt):
                pieces.append(piece)
                written[0] += len(piece)
        except Exception as exc:  # the template's own raise_exception, an undefined call, a type error
            raise UserError(f"{where}: the chat template ({self.where}) fails: {first_line(exc)}") from None
        finally:
            _TRACKING.reset(token)
        return "".join(pieces), spans


def _aliased(message: dict) -> dict:
    """A message's reasoning under every name templates read (as transformers does)."""
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


# The generation blocks' spans of the rendering under way: (characters written so far, spans).
_TRACKING: contextvars.ContextVar = contextvars.ContextVar("generation_spans", default=None)


@functools.cache
def _environment():
    """transformers' chat-template environment, rebuilt: templates come from model hubs,
    so they run sandboxed; `tojson` keeps non-ASCII text; `namespace` refuses private names."""
    # jinja2 is an optional dependency (spmd[data]): imported when a chat template is compiled.
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if (tracking := _TRACKING.get()) is not None:
                start = tracking[0][0]  # the block is yielded after this call: its start is what was written
                tracking[1].append((start, start + len(text)))
            return text

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, values = args[0], dict(*args[1:], **kwargs)
            for name in values:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace may not hold {name!r}")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=Dict(), namespace=Namespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env
