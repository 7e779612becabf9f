"""Chat templates, compiled in the environment transformers' `apply_chat_template` uses
(a sandbox, trim_blocks and lstrip_blocks, loop controls, its helpers), rendering the
character spans of their `{% generation %}` blocks with the text."""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re

from spmd.base.errors import UserError, first_line, optional_module

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # one message field under the names templates read


class ChatTemplate:
    """A chat template compiled as transformers compiles it (a sandbox, trim_blocks and
    lstrip_blocks, loop controls, its helpers), with the character spans of its
    `{% generation %}` blocks."""

    def __init__(self, source: str, where: str):
        jinja2 = optional_module("jinja2", "a chat template")
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
