"""A command's typer options from an option dataclass (seqpar.plan.flags): the command offers its owner's options, never
restates them.

``with_options(cls, name)`` gives ``command`` the options of ``cls`` (``leave_out``: dotted field paths it does not
offer) before its own, builds one ``cls`` from what typer parsed and hands it to the command in its parameter ``name``.
Flags, help, defaults and lower bounds come from the fields; a value typer reads as text (choices, a field's parser) is
read when the dataclass is built, so a bad one is a SeqparError: one line and exit 2 under ``handle_errors``.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, Optional

import typer

from seqpar.plan.errors import SeqparError
from seqpar.plan.flags import Option, build, options
from seqpar.plan.units import INT64_MAX, MAX_INT_DIGITS


def with_options(cls: type, name: str, leave_out: tuple[str, ...] = ()):
    """Decorator: ``command`` gets the options of ``cls`` but those in ``leave_out`` (a field, or a nested dataclass's
    whole group), and receives them as one ``cls`` in ``name``."""
    dotted = lambda o: ".".join(o.path)
    offered = [o for o in options(cls) if not any(dotted(o) == p or dotted(o).startswith(p + ".") for p in leave_out)]

    def decorate(command):
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(command).parameters.values()
            if p.name != name
        ]  # typer passes every parameter by name; the dataclass's options come first in --help

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            given = {o.path: _value(o, kwargs.pop(_param_name(o))) for o in offered}
            return command(*args, **{name: build(cls, given)}, **kwargs)

        wrapper.__signature__ = inspect.Signature([_parameter(o) for o in offered] + own)
        return wrapper

    return decorate


def _param_name(o: Option) -> str:
    return "__".join(o.path)


def _parameter(o: Option) -> inspect.Parameter:
    """The typer parameter of one option: a switch, a repeated flag, text for a parser, or a typed value."""
    f = o.flag
    kw: dict[str, Any] = {"help": f.help, "metavar": f.metavar, "rich_help_panel": f.panel}
    if o.kind is bool:
        annotation, default = bool, False
    elif o.repeated:
        annotation, default = list[str], list(o.default)
    elif f.parse is not None or f.choices:  # read and checked when the dataclass is built
        annotation = Optional[str]
        default = None if o.default in (None, ()) else f.show(o.default)
    else:
        annotation = o.kind if o.default is not None else Optional[o.kind]
        default, kw["min"] = o.default, f.min
    return inspect.Parameter(
        _param_name(o),
        inspect.Parameter.KEYWORD_ONLY,
        default=typer.Option(default, f.name, *f.aliases, **kw),
        annotation=annotation,
    )


def _value(o: Option, given: Any) -> Any:
    """The field's value from typer's: a switch flips the default (``--no-x`` sets x False)."""
    if o.kind is bool:
        return o.default != bool(given)
    if o.repeated:
        return tuple(given or ())
    if given is None:
        return o.default
    if isinstance(given, str) and (o.flag.parse or o.flag.choices):
        return read_text(o.flag.name, given, o.read)
    return given


def read_text(flag: str, text: str, parse: Callable[[str], Any]) -> Any:
    """``parse(text)`` for an option typer hands over as text, SeqparError naming ``flag`` for a number no count can be:
    its digits are counted before parsing (Python's int() raises a bare ValueError past 4300), its value after."""
    run = max((len(m) for m in re.findall(r"\d+", text)), default=0)
    if run > MAX_INT_DIGITS:
        raise SeqparError(
            f"{flag} {text[:12]}... holds a number of {run} digits, more than any count seqpar takes; give a smaller one"
        )
    value = parse(text)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise SeqparError(f"{flag} {text} is more than {INT64_MAX} (2**63 - 1); give a smaller number")
    return value


__all__ = ["read_text", "with_options"]
