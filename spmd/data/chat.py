"""Chat templates, compiled in the environment transformers' `apply_chat_template` uses
(a sandbox, trim_blocks and lstrip_blocks, loop controls, its helpers), rendering the
character spans of their `{% generation %}` blocks with the text.

A template comes from a model hub, so its work is bounded as well as sandboxed: jinja2's
sandbox bounds one `range` (100,000 items), but not a loop inside a loop, nor a macro that
calls itself twice. A rendering may take at most MAX_STEPS steps, counted as it goes: a
loop's item is a step, an attribute or item read READ_STEPS, a call CALL_STEPS (about their
times in the sandbox), and a value read or made a step per CHARS_PER_STEP characters (or
items). Every loop's items are counted (the template's loops are wrapped as it is
compiled), and no value, nor the text rendered, may exceed the rendering's characters
(`max_chars`). The count is the same on every host: a record is refused everywhere or
nowhere.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import hashlib
import json
import re
from pathlib import Path

from spmd.base.errors import UserError, first_line, optional_module

MAX_STEPS = 5_000_000  # a rendering's: 1.5 s of empty loops; real templates take a few hundred a message
READ_STEPS, CALL_STEPS = 10, 30  # the steps of an attribute or item read, of a call (a loop's item: 0.3 µs)
CHARS_PER_STEP = 1000  # characters (or items) of a value read or made that count as one step
MAX_CHARS = 1 << 24  # characters a rendering may make when no record's bound is given (a --chat prompt's)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # one message field under the names templates read
# Published templates with no generation blocks that TRL's SFTTrainer trains through a variant
# of its own (matched, as TRL matches them, by their exact text): the sha256 of the published
# text, and spmd's variant of it in chat_templates/ (the same rendering, with generation blocks).
TRAINING_VARIANTS = {
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": ("Qwen2.5", "qwen2_5.jinja"),
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": ("Qwen3", "qwen3.jinja"),
}


class ChatTemplate:
    """A chat template compiled as transformers compiles it (a sandbox, trim_blocks and
    lstrip_blocks, loop controls, its helpers), with the character spans of its
    `{% generation %}` blocks."""

    def __init__(self, source: str, where: str):
        jinja2 = optional_module("jinja2", "a chat template")
        self.where, self.has_generation = where, bool(_GENERATION.search(source))
        self.digest = hashlib.sha256(source.encode()).hexdigest()
        env = _environment()
        try:
            self._template = env.from_string(_counting_loops(env.parse(source)))
        except jinja2.TemplateError as exc:
            raise UserError(f"{where}: the chat template does not compile ({first_line(exc)})") from None
        except (RecursionError, MemoryError):
            raise UserError(f"{where}: the chat template does not compile (nested deeper than the compiler "
                            "goes)") from None

    def for_training(self) -> ChatTemplate:
        """The template chat records train through: spmd's training variant of a published
        template that TRL swaps for its own (TRAINING_VARIANTS), else this one."""
        known = None if self.has_generation else TRAINING_VARIANTS.get(self.digest)
        return _training_variant(*known) if known else self

    def render(self, messages: list, variables: dict, where: str, tools=None, add_generation_prompt: bool = False,
               max_chars: int | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and its generation blocks' spans (`where`: the record, for errors;
        `max_chars`: the most characters it may make, --max-record-bytes; None: MAX_CHARS)."""
        messages = [_aliased({k: v for k, v in m.items() if v is not None}) for m in messages]
        rendering = _Rendering(MAX_CHARS if max_chars is None else max_chars,
                               "" if max_chars is None else " (--max-record-bytes)")
        pieces = []
        token = _RENDERING.set(rendering)
        try:
            for piece in self._template.generate(**variables, messages=messages, tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt):
                pieces.append(piece)
                rendering.wrote(piece)
        except _OverBound as exc:
            raise UserError(f"{where}: the chat template ({self.where}) {exc}") from None
        except Exception as exc:  # the template's own raise_exception, an undefined call, a type error
            raise UserError(f"{where}: the chat template ({self.where}) fails: {first_line(exc)}") from None
        finally:
            _RENDERING.reset(token)
        return "".join(pieces), rendering.spans


@functools.cache
def _training_variant(family: str, name: str) -> ChatTemplate:
    file = Path(__file__).parent / "chat_templates" / name
    return ChatTemplate(file.read_text(encoding="utf-8"), f"spmd's training variant of {family}'s chat template")


def _aliased(message: dict) -> dict:
    """A message's reasoning under every name templates read (as transformers does)."""
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _OverBound(Exception):
    """A rendering that went past its bounds; the message says which, for `render`'s line."""


class _Rendering:
    """A rendering under way: the characters written so far, its generation blocks' spans,
    and the steps and characters it may still take."""

    def __init__(self, max_chars: int, flag: str):
        self.written, self.spans = 0, []
        self.steps_left, self.max_chars, self.flag = MAX_STEPS, max_chars, flag

    def step(self, count: int = 1) -> None:
        self.steps_left -= count
        if self.steps_left < 0:
            raise _OverBound(f"takes more than {MAX_STEPS:,} steps (loop items, reads, calls) in one rendering; "
                             f"a template's work is bounded")

    def holds(self, size: int) -> None:
        """A value or text of `size` characters (or items) may be made."""
        if size > self.max_chars:
            raise _OverBound(f"reaches a value of {size:,} characters (or items), more than the "
                             f"{self.max_chars:,} a rendering may hold{self.flag}")

    def wrote(self, piece: str) -> None:
        self.written += len(piece)
        if self.written > self.max_chars:
            raise _OverBound(f"renders more than {self.max_chars:,} characters{self.flag}")


# The rendering under way (None at compile time, when nothing is counted).
_RENDERING: contextvars.ContextVar[_Rendering | None] = contextvars.ContextVar("chat_rendering", default=None)


def _step(count: int = 1) -> None:
    if (rendering := _RENDERING.get()) is not None:
        rendering.step(count)


def _charged(value, steps: int = 0):
    """`value`, read or made by the template in `steps`, counted with its size (a string, list or mapping's)."""
    if (rendering := _RENDERING.get()) is not None:
        if isinstance(value, (str, list, tuple, dict)) and len(value) >= CHARS_PER_STEP:
            rendering.holds(len(value))
            steps += len(value) // CHARS_PER_STEP
        rendering.step(steps)
    return value


def _counted(items):
    """A loop's items, each a step."""
    for item in items:
        _step()
        yield item


def _counting_loops(ast):
    """The template's loops, each iterating over `environment.counted(items)`."""
    # jinja2 is an optional dependency (spmd[data]), imported with the environment.
    import jinja2.nodes

    for loop in list(ast.find_all(jinja2.nodes.For)):
        loop.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None)
    return ast


MAX_POWER_BITS = 1 << 16  # of an integer power: templates count; they do not compute
_WIDTHS = re.compile(r"[0-9]+")  # a printf or format specification's widths and precisions (and any number)


def _filter_counted(name: str, func):
    """A filter (jinja2's, run as plain Python) counted as the sandbox counts a call: its
    arguments' characters and items read, what it would make refused before it is made
    (`_made_by`), and an iterator it returns counted item by item as a loop's."""
    passed = getattr(func, "jinja_pass_arg", None) is not None  # (its first argument the context or environment)

    @functools.wraps(func)  # (keeps that mark)
    def counted(*args, **kwargs):
        if (rendering := _RENDERING.get()) is None:
            # Compiling: jinja2 computes a filter of literals there, where nothing counts
            # (its output nodes' constants); refused, it is computed while rendering.
            raise _OverBound("computed while rendering")
        rendering.step(CALL_STEPS + sum(map(_reading_steps, (*args, *kwargs.values()))))
        made = _made_by(name, list(args[passed:]), kwargs)
        if name == "wordwrap":  # (Python's textwrap takes about as many steps a character as the width is short)
            rendering.step(50 * made)
        else:
            rendering.holds(made)
        value = func(*args, **kwargs)
        if not isinstance(value, (str, list, tuple, dict)) and hasattr(value, "__next__"):
            return _counted(value)  # (map, select, reject: made as they are read)
        return _charged(value)
    return counted


def _reading_steps(value) -> int:
    """A filter's steps to read `value`: a step per CHARS_PER_STEP characters, an item a step."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_STEP
    return len(value) if isinstance(value, (list, tuple, dict, range, set, frozenset)) else 0


def _made_by(name: str, args: list, kwargs: dict) -> int:
    """At least how many characters (or items) filter `name` makes of `args` (its value
    first): the filters whose output can outgrow their input by an argument."""
    def arg(i, key, default=None):
        return args[i] if len(args) > i else kwargs.get(key, default)

    value = arg(0, "value")
    size = len(value) if isinstance(value, (str, list, tuple, dict, range)) else 0
    number = lambda x: x if isinstance(x, int) else len(x) if isinstance(x, str) else 0  # noqa: E731
    if name == "join":
        return size * number(arg(1, "d", ""))
    if name == "center":
        return number(arg(1, "width", 80))
    if name == "indent" and isinstance(value, str):
        return number(arg(1, "width", 4)) * (value.count("\n") + 1)
    if name in ("batch", "slice"):
        return number(arg(1, "linecount" if name == "batch" else "slices", 0))
    if name == "replace" and isinstance(value, str):
        return _replaced_size(value, arg(1, "old", ""), arg(2, "new", ""))
    if name == "format" and isinstance(value, str):
        return max(map(int, _WIDTHS.findall(value)), default=0)
    if name == "wordwrap":
        return size // max(number(arg(1, "width", 79)), 1)
    if name == "tojson":
        return number(arg(2, "indent", None) or 0) * size
    return 0


def _replaced_size(text: str, old, new) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return 0
    return len(text) + (len(text) + 1 if old == "" else text.count(old)) * len(new)


def _made_by_method(obj, args: tuple) -> int:
    """At least how many characters a string method called by the template makes."""
    text, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(text, str):
        return 0
    if name == "replace" and len(args) >= 2:
        return _replaced_size(text, args[0], args[1])
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return args[0]
    if name == "join" and args and isinstance(args[0], (list, tuple, range, str)):
        return len(text) * len(args[0])
    if name == "expandtabs":
        return text.count("\t") * (args[0] if args and isinstance(args[0], int) else 8)
    if name in ("format", "format_map"):
        return max(map(int, _WIDTHS.findall(text)), default=0)
    return 0


def _bounded_binop(operator: str, left, right) -> None:
    """A repetition, a printf-style format or a power whose result would exceed the
    rendering's bounds is refused before it is made (`'x' * 10**9`, `'%999999999s' % x`,
    `2 ** 2 ** 40`: one operation, any time or memory). (The environment folds no constant
    when it compiles: every operation and filter is computed, and counted, while rendering.)"""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and (rendering := _RENDERING.get()):
                rendering.holds(len(seq) * times)
    elif operator == "%":  # printf-style formatting: its widths and precisions
        if isinstance(left, str) and (rendering := _RENDERING.get()):
            rendering.holds(max(map(int, _WIDTHS.findall(left)), default=0))
    elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
            right * abs(left).bit_length() > MAX_POWER_BITS:
        raise _OverBound(f"computes a power of more than {MAX_POWER_BITS:,} bits ({left} ** {right})")


@functools.cache
def _environment():
    """transformers' chat-template environment, rebuilt: templates come from model hubs,
    so they run sandboxed; `tojson` keeps non-ASCII text; `namespace` refuses private names."""
    # jinja2 is an optional dependency (spmd[data]): imported when a chat template is compiled.
    import jinja2
    import jinja2.ext

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    # Not optimized: jinja2's optimizer computes constant expressions as it compiles (a
    # filter of literals), where nothing is counted; here they are computed while rendering.
    env = _bounded_sandbox()(trim_blocks=True, lstrip_blocks=True, optimized=False,
                             extensions=[_generation_blocks(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters.update({name: _filter_counted(name, f) for name, f in env.filters.items()})
    env.globals.update(raise_exception=raise_exception, dict=Dict(), namespace=_namespace(),
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


def _generation_blocks():
    """The `{% generation %}` tag: renders its body and records where it lies in the text."""
    import jinja2.ext  # optional (spmd[data]), as in _environment
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if (rendering := _RENDERING.get()) is not None:
                start = rendering.written  # the block is yielded after this call: its start is what was written
                rendering.spans.append((start, start + len(text)))
            return text

    return Generation


def _namespace():
    """jinja2's `namespace`, refusing names that start with an underscore."""
    import jinja2.utils  # optional (spmd[data]), as in _environment

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

    return Namespace


def _bounded_sandbox():
    """jinja2's immutable sandbox, counting a rendering's steps (the module's docstring)."""
    import jinja2.runtime  # optional (spmd[data]), as in _environment
    import jinja2.sandbox

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        @staticmethod
        def counted(items):
            return _counted(items)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - the sandbox's names, free for kwargs
            _step(CALL_STEPS)  # before the call: a macro that calls itself is counted on its way down
            if (rendering := _RENDERING.get()) is not None:
                rendering.holds(_made_by_method(__obj, args))
            if isinstance(__obj, jinja2.runtime.LoopContext) and args:  # a recursive loop's next level
                args = (_counted(args[0]), *args[1:])
            return _charged(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            return _charged(super().getattr(obj, attribute), READ_STEPS)

        def getitem(self, obj, argument):
            return _charged(super().getitem(obj, argument), READ_STEPS)

        def call_binop(self, context, operator, left, right):
            _bounded_binop(operator, left, right)
            return _charged(super().call_binop(context, operator, left, right))

    return Bounded
