"""Options declared once, on their owner's dataclass, and the one codec between such a dataclass and a command line.

An option is a dataclass field built by ``option(default, "--flag", help=...)``: its metadata holds a ``Flag`` (the flag,
its help, metavar, lower bound, choices, and a parser for values that are not plain text or numbers). From those fields:
``to_argv(opts)`` writes the options that differ from their defaults, in field order (what seqpar launch hands every
rank); ``OptionsParser(cls)`` is the argparse parser whose ``parse_args`` returns a ``cls`` (what a rank reads); and
seqpar.cli.params builds a command's typer options. A field that holds another options dataclass lays its options out
in its place (the trainer's options hold the data's), the way torchtitan's job config nests its sections.

Types: str, int, float, bool (a switch: given, it flips the default, so ``--no-x`` declares a field ``x`` defaulting to
True), ``X | None`` of those, ``tuple[str, ...]`` (the flag repeated), and any value a ``parse`` function reads from
text (``show`` writes it back). Pure Python: the CLI, the launcher and every rank import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable

from seqpar.plan.errors import SeqparError

FLAG = "seqpar.flag"  # the metadata key that makes a dataclass field an option


@dataclass(frozen=True)
class Flag:
    """How one option reads on a command line."""

    name: str  # e.g. "--skip-nonfinite"
    help: str
    metavar: str | None = None
    min: int | None = None  # the smallest value an int option takes
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None  # text -> value, SeqparError naming the flag; instead of the field's type
    show: Callable[[Any], str] = str  # value -> text (to_argv)
    always: bool = False  # written even at its default: a recorded command names it
    required: bool = False  # a rank refuses to start without it
    panel: str | None = None  # the group --help shows it in (None: the command's Options)
    aliases: tuple[str, ...] = ()  # other spellings accepted (e.g. the Hugging Face Trainer's); the name is written


def option(default: Any, name: str, help: str, **kw: Any) -> Any:
    """A dataclass field that is an option (``kw``: the other fields of ``Flag``)."""
    return field(default=default, metadata={FLAG: Flag(name, help, **kw)})


@dataclass(frozen=True)
class Option:
    """One option of an options dataclass, laid out: its field names from the top, its flag, base type and default."""

    path: tuple[str, ...]
    flag: Flag
    kind: type  # str, int, float, bool, or tuple (the flag repeated); any type when flag.parse reads it
    default: Any

    @property
    def repeated(self) -> bool:
        return self.kind is tuple and self.flag.parse is None

    def read(self, text: str) -> Any:
        """The value of one occurrence of the flag; SeqparError naming the flag for text it cannot mean."""
        f = self.flag
        if f.parse is not None:
            value = f.parse(text)
        elif self.kind in (int, float):
            try:
                value = self.kind(text)
            except ValueError:
                raise SeqparError(f"{f.name} {text!r} is not {'an integer' if self.kind is int else 'a number'}") from None
        else:
            value = text
        return self.check(value)

    def check(self, value: Any) -> Any:
        """``value`` when the flag's choices and lower bound admit it; SeqparError otherwise."""
        f = self.flag
        if f.choices and value not in f.choices:
            raise SeqparError(f"{f.name} {value!r} is not one of {', '.join(f.choices)}; e.g. {f.name} {f.choices[0]}")
        if f.min is not None and isinstance(value, int) and value < f.min:
            raise SeqparError(f"{f.name} {value} is below {f.min}; give {f.name} {f.min} or more")
        return value


@cache
def options(cls: type) -> tuple[Option, ...]:
    """Every option of the dataclass ``cls`` in field order, a nested options dataclass's in its place."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if FLAG in f.metadata:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append(Option((f.name,), f.metadata[FLAG], _base(t), default))
        elif isinstance(t, type) and dataclasses.is_dataclass(t):
            out += [dataclasses.replace(o, path=(f.name, *o.path)) for o in options(t)]
    return tuple(out)


def _base(t: Any) -> type:
    """int for ``int | None`` (the first type of a union that is not None), tuple for ``tuple[str, ...]``."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def value_at(opts: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        opts = getattr(opts, name)
    return opts


def build(cls: type, values: dict[tuple[str, ...], Any]) -> Any:
    """A ``cls`` from option values by path (a nested options dataclass built from its own); absent ones keep their default."""
    kw = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if FLAG in f.metadata and (f.name,) in values:
            kw[f.name] = values[(f.name,)]
        elif FLAG not in f.metadata and isinstance(t, type) and dataclasses.is_dataclass(t):
            mine = {p[1:]: v for p, v in values.items() if p[0] == f.name}
            if mine:
                kw[f.name] = build(t, mine)
    return cls(**kw)


def to_argv(opts: Any) -> list[str]:
    """The flags of ``opts`` that differ from their defaults (and those marked always), in field order."""
    argv: list[str] = []
    for o in options(type(opts)):
        value = value_at(opts, o.path)
        if value is None or (value == o.default and (not o.flag.always or o.kind is bool)):
            continue
        if o.kind is bool:
            argv.append(o.flag.name)
        elif o.repeated:
            for v in value:
                argv += [o.flag.name, str(v)]
        else:
            argv += [o.flag.name, o.flag.show(value)]
    return argv


class OptionsParser(argparse.ArgumentParser):
    """argparse built from an options dataclass (``cls``); ``parse_args`` returns a ``cls``. A value the flag cannot
    mean is argparse's usage error (exit 2) with the flag's own one-line reason."""

    def __init__(self, cls: type, **kw: Any):
        super().__init__(**kw)
        self.cls = cls
        for o in options(cls):
            f, dest = o.flag, "__".join(o.path)
            metavar = f.metavar or f.name.lstrip("-").upper().replace("-", "_")
            shown = o.default not in (None, "", ()) and o.kind is not bool and not f.required
            help = f"{f.help} [default: {f.show(o.default)}]" if shown else f.help  # as typer shows it
            if o.kind is bool:
                self.add_argument(f.name, *f.aliases, dest=dest, action="store_false" if o.default else "store_true", help=help)
            elif o.repeated:
                self.add_argument(f.name, *f.aliases, dest=dest, action="append", metavar=metavar, help=help)
            else:
                kw = {"required": True} if f.required else {"default": o.default}
                self.add_argument(f.name, *f.aliases, dest=dest, type=_reader(o), metavar=metavar, help=help, **kw)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        values = {}
        for o in options(self.cls):
            v = getattr(ns, "__".join(o.path))
            values[o.path] = (o.default if v is None else tuple(v)) if o.repeated else v
        return build(self.cls, values)


def _reader(o: Option) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return o.read(text)
        except SeqparError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = o.flag.name  # argparse names the type in some of its messages
    return read


def from_argv(cls: type, argv: list[str], **kw: Any) -> Any:
    """``to_argv``'s inverse: a ``cls`` from its flags (``kw``: argparse.ArgumentParser's, e.g. prog)."""
    return OptionsParser(cls, **kw).parse_args(argv)


__all__ = ["FLAG", "Flag", "Option", "OptionsParser", "build", "from_argv", "option", "options", "to_argv", "value_at"]
