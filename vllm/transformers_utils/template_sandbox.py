"""The Jinja sandbox chat templates render in: bounded output, bounded values, and (for templates a request sent)
a bounded amount of work.

Jinja's ImmutableSandboxedEnvironment keeps a template away from Python's internals and from mutating its inputs,
and caps `range()` at 100000 items, but it lets a template build a string of any size in one expression
(`"a" * 10**10`, `"x"|center(10**10)`, a macro that doubles a string 40 times) and loop for as long as it likes
(`range(100000)` nested in `range(100000)`). Here:

- Every value a template builds with `+`, `*`, `**`, `~`, `%`, a filter, a method call or a macro is at most
  `max_chars` long (strings and sequences; MAX_TEMPLATE_CHARS unless the caller gives its own, the server the
  characters its context can hold), checked before the value is built where its size is known up front (`*`,
  `**`, `~`, width and count arguments, format widths, `replace`), after it otherwise; the rendered text too.
  Over it: TemplateError. The bound is per render (thread-local), so a cached template serves any caller.
- `render_bounded(..., max_steps=N)` counts the template's Python line events (sys.settrace, in the rendering
  thread only) and stops it with a TemplateError after N of them or after `timeout_s`: nested loops end, whatever
  they iterate. Only request-supplied templates pay for the tracing (several times slower); the server's own
  template runs untraced, its work bounded by its input (the request body limit).

A template that breaks a bound fails like one that calls raise_exception(): the server answers 400.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any

import jinja2
import jinja2.sandbox

# Longest string or sequence a template may build, and its longest output (characters).
MAX_TEMPLATE_CHARS = 4 * 1024 * 1024
# Python line events a request-supplied template may run (~1-2 s traced on a slow core; a chat template renders
# a conversation in a few thousand).
MAX_TEMPLATE_STEPS = 2_000_000
_DEADLINE_CHECK_EVERY = 4096
_bound = threading.local()  # .max_chars: the bound of the render running in this thread


def _max_chars() -> int:
    return getattr(_bound, "max_chars", MAX_TEMPLATE_CHARS)

# A width or precision in a %-format or a str.format spec: "%0999999999d", "{:>999999999}".
_PRINTF_SPEC = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_FIELD = re.compile(r"\{[^{}]*\}")
_NUMBER = re.compile(r"\d+")


class TemplateBoundError(jinja2.exceptions.TemplateError):
    """A chat template went past one of the sandbox's bounds."""


def _too_big(what: str, size: int) -> TemplateBoundError:
    return TemplateBoundError(f"The chat template built {what} of {size} characters or items, more than the "
                              f"limit of {_max_chars()}.")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, Sized) and not isinstance(value, jinja2.Undefined) else 0


def _check_size(value: Any, what: str = "a value") -> Any:
    size = _size(value)
    if size > _max_chars():
        raise _too_big(what, size)
    return value


def _check_int_args(args: Iterable[Any]) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > _max_chars():
            raise TemplateBoundError(f"The chat template passed {arg} where a width or count is read; the limit is "
                                     f"{_max_chars()}.")


def _check_format_widths(fmt: str, printf: bool) -> None:
    if printf:
        for match in _PRINTF_SPEC.finditer(fmt):
            for group in match.groups():
                if group == "*" or (group is not None and int(group) > _max_chars()):
                    raise TemplateBoundError("The chat template's %-format has a width or precision over the limit "
                                             f"of {_max_chars()} (or a '*' width).")
        return
    for field in _FORMAT_FIELD.findall(fmt):
        if any(len(n) > 7 and int(n) > _max_chars() for n in _NUMBER.findall(field)):
            raise TemplateBoundError(f"The chat template's format spec {field!r} is over the limit of "
                                     f"{_max_chars()}.")


def _bounded_join(parts: Iterable[Any], markup: bool) -> Any:
    items = [p if isinstance(p, str) else str(p) for p in parts]
    total = sum(map(len, items))
    if total > _max_chars():
        raise _too_big("a string", total)
    return jinja2.runtime.markup_join(items) if markup else "".join(items)


def _bounded_str_join(seq: Iterable[Any]) -> str:
    return _bounded_join(seq, markup=False)


def _bounded_markup_join(seq: Iterable[Any]) -> str:
    return _bounded_join(seq, markup=True)


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_int_args((*args[1:], *kwargs.values()))
        if name == "format" and args and isinstance(args[0], str):
            _check_format_widths(args[0], printf=True)
        if name == "replace":
            values = args if args and isinstance(args[0], str) else args[1:]  # after the eval context, if passed
            if len(values) >= 3 and isinstance(values[0], str):
                _check_replace(values[0], values[1], values[2])
        return _check_size(func(*args, **kwargs), f"a value (filter {name})")

    # NOTE: Jinja passes the context / environment to filters marked for it; the marks are copied.
    bounded.__dict__.update(getattr(func, "__dict__", {}))
    bounded.__name__ = getattr(func, "__name__", name)
    return bounded


def _check_replace(text: str, old: Any, new: Any) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        grown = len(text) + text.count(old) * (len(new) - len(old))
        if grown > _max_chars():
            raise _too_big("a string (replace)", grown)


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose operators, filters, calls and joins cannot build a value over
    the render's max_chars (module docstring)."""

    # NOTE: an intercepted operator is also never folded at compile time (`{{ 10**10**10 }}` would run there).
    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.concat = _bounded_str_join  # macro and call-block output

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        self.filters[name] = _bounded_filter(name, func)

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                if _size(seq) and isinstance(times, int) and _size(seq) * max(times, 0) > _max_chars():
                    raise _too_big("a repeated value", _size(seq) * times)
        elif op == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
                    right > 4096 or right * abs(left).bit_length() > 65536):
                raise TemplateBoundError(f"The chat template computed {left} ** {right}, past the sandbox's bound.")
        elif op == "+":
            if _size(left) and _size(right) and _size(left) + _size(right) > _max_chars():
                raise _too_big("a concatenation", _size(left) + _size(right))
        elif op == "%" and isinstance(left, str):
            _check_format_widths(left, printf=True)
        return _check_size(self.binop_table[op](left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        _check_int_args((*args, *kwargs.values()))
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            name = getattr(target, "__name__", "")
            if name in ("format", "format_map"):
                _check_format_widths(owner, printf=False)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
            elif name == "join" and args:
                return _check_size(_bounded_join_with(owner, args[0]), "a string (join)")
        return _check_size(super().call(__context, __obj, *args, **kwargs), "a value (call)")

    def from_string(self, source: Any, globals: Any = None, template_class: Any = None) -> jinja2.Template:
        template = super().from_string(source, globals, template_class)
        # NOTE: `a ~ b` compiles to the module's str_join / markup_join; the bounded ones replace them there.
        namespace = template.root_render_func.__globals__
        namespace["str_join"] = _bounded_str_join
        namespace["markup_join"] = _bounded_markup_join
        return template


def _bounded_join_with(sep: str, parts: Any) -> str:
    items = [p if isinstance(p, str) else str(p) for p in parts]
    total = sum(map(len, items)) + len(sep) * max(len(items) - 1, 0)
    if total > _max_chars():
        raise _too_big("a string (join)", total)
    return sep.join(items)


class _StepBudget:
    """A sys.settrace function that stops the traced thread after `max_steps` line events or at `deadline`."""

    def __init__(self, max_steps: int, deadline: float | None) -> None:
        self.max_steps = max_steps
        self.remaining = max_steps
        self.deadline = deadline
        self.until_clock = _DEADLINE_CHECK_EVERY

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.remaining -= 1
            self.until_clock -= 1
            if self.remaining < 0:
                raise TemplateBoundError(f"The chat template ran more than {self.max_steps} steps (Python lines).")
            if self.until_clock <= 0:
                self.until_clock = _DEADLINE_CHECK_EVERY
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise TemplateBoundError("The chat template took longer than its time limit.")
        return self


def render_bounded(source: str, variables: dict[str, Any], max_steps: int | None,
                   timeout_s: float | None, compile: Callable[[str], jinja2.Template],
                   max_chars: int | None = None, dispose: bool = False) -> str:
    """Compile `source` (with `compile`, which may cache) and render it with its values and output bounded to
    max_chars (default MAX_TEMPLATE_CHARS); with max_steps, the compilation's and the rendering's work too
    (module docstring). Raises jinja2 TemplateError (TemplateBoundError for a bound), or compile's errors.
    `dispose`: the template is used once; its module namespace is emptied after the render (it holds a cycle
    through the template's functions)."""
    budget = None
    if max_steps is not None:
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        budget = _StepBudget(max_steps, deadline)
    previous = sys.gettrace()
    previous_max = getattr(_bound, "max_chars", None)
    if max_chars is not None:
        _bound.max_chars = max_chars
    if budget is not None:
        sys.settrace(budget)
    template: jinja2.Template | None = None
    try:
        template = compile(source)
        parts: list[str] = []
        total = 0
        for part in template.generate(**variables):
            total += len(part)
            if total > _max_chars():
                raise _too_big("an output", total)
            parts.append(part)
        return "".join(parts)
    finally:
        if budget is not None:
            sys.settrace(previous)
        if dispose and template is not None:
            template.root_render_func.__globals__.clear()
        if previous_max is None:
            _bound.__dict__.pop("max_chars", None)
        else:
            _bound.max_chars = previous_max


__all__ = ["BoundedSandbox", "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_STEPS", "TemplateBoundError", "render_bounded"]
