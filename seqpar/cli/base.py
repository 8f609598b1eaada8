"""What every `seqpar` command shares: help that reads at 80 columns, where text goes, and the exit codes.

Conventions for every command:
- the docstring is the help and ends with an Examples section: a fenced block, one command per line of at most 76
  characters, so `--help` shows each on one line at 80 columns (commands use ReadableCommand for the same reason);
- ``--json`` puts only JSON on stdout, human text goes to stderr;
- exit 0 ok, 1 a known failure (`check`: risks OOM; `advise`: nothing fits; `launch`: the job failed, or the plan is
  predicted not to fit; any: a missing optional dependency, seqpar.plan.extras), 2 bad usage or invalid input (SeqparError,
  one line, nothing written), 3 an internal error (a bug: one line, SEQPAR_DEBUG=1 shows the traceback), 130 interrupted
  (Ctrl-C); wrap the command with ``@handle_errors`` to get this mapping;
- text from a plan or any other file is printed literally: ``literal`` escapes control characters (an ESC[2K in a plan
  would erase the line before it) and ``shown`` also rich markup, so a file cannot restyle or hide what the terminal shows.
Importing this module must not import torch.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import typer
from pydantic import ValidationError
from rich.console import Console
from typer.core import TyperCommand

from seqpar.cli.literal import literal
from seqpar.plan.errors import SeqparError
from seqpar.plan.extras import MissingExtra, from_error
from seqpar.plan.files import first_error
from seqpar.plan.units import INT64_MAX


class ReadableCommand(TyperCommand):
    """A command whose --help reads at 80 columns: an option with many choices shows a short name (MODE) in the type
    column, which rich would otherwise fold mid-word, and lists its choices in its help text instead; a number shows N
    (a whole number) or X; an option's other spellings (--max-steps for --steps, --no-tiled-mlp) are named in its help
    text, not in columns of their own, which would leave the help a word or two a line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.params:
            desc = getattr(p, "type_descriptor", None)  # typer >= 0.2x; older typer keeps click's Choice in p.type
            choices = (
                (desc.choices if desc.is_choice else None)
                if desc is not None
                else getattr(getattr(p, "type", None), "choices", None)
            )
            if choices and p.metavar is None and len(" ".join(map(str, choices))) > 16:
                p.metavar = p.opts[-1].lstrip("-").upper().replace("-", "_")
                p.help = f"{p.help or ''} One of: {', '.join(map(str, choices))}.".strip()
            kind = desc.annotation if desc is not None else getattr(getattr(p, "type", None), "name", None)
            if p.metavar is None and not getattr(p, "is_flag", False) and kind in (int, float, "integer", "float"):
                p.metavar = "N" if kind in (int, "integer") else "X"

    def format_help(self, ctx, formatter):
        """The help with each option's other spellings in its help text, only while it is drawn (parsing keeps them)."""
        drawn = []
        for p in self.params:
            longs = [o for o in p.opts if o.startswith("--")]
            also, off = longs[1:], list(getattr(p, "secondary_opts", []))
            if also or off:
                drawn.append((p, p.opts, p.secondary_opts, p.help))
                words = ([f"Also spelled {' or '.join(also)}."] if also else []) + ([f"Off: {' or '.join(off)}."] if off else [])
                p.opts, p.secondary_opts = [o for o in p.opts if o not in also], []
                p.help = " ".join([p.help or "", *words]).strip()
        try:
            return super().format_help(ctx, formatter)
        finally:
            for p, opts, secondary, text in drawn:
                p.opts, p.secondary_opts, p.help = opts, secondary, text


def stdout() -> Console:
    return Console(file=sys.stdout, soft_wrap=True)


def stderr() -> Console:
    return Console(file=sys.stderr, soft_wrap=True)


EXIT_OOM_OR_FAILED, EXIT_INVALID, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 2, 3, 130


def note(text: str) -> None:
    """A line for a person, on stderr (stdout stays clean for --json); printed literally."""
    typer.echo(literal(text), err=True)


def say(text: str) -> None:
    """A line for a person on stdout (commands without --json), printed literally."""
    typer.echo(literal(text))


def _pass_through() -> tuple[type[BaseException], ...]:
    """typer's own exits and usage errors: typer >= 0.2x vendors click (typer.TyperException), older typer uses click."""
    kinds: list[type[BaseException]] = [typer.Exit, typer.Abort]
    if hasattr(typer, "TyperException"):
        kinds.append(typer.TyperException)
    try:
        from click.exceptions import Abort, ClickException
    except ImportError:
        pass
    else:
        kinds += [ClickException, Abort]
    return tuple(kinds)


_PASS_THROUGH = _pass_through()


def _flag_names(fn) -> dict[str, str]:
    """Each parameter typer passes ``fn`` (the signature it reads: a dataclass's options, the command's own), by its
    first long flag."""
    import inspect
    from typing import get_args

    from typer.models import ParameterInfo

    names = {}
    for p in inspect.signature(fn).parameters.values():
        infos = [p.default, *get_args(p.annotation)[1:]]  # typer.Option as the default, or in Annotated[...]
        info = next((x for x in infos if isinstance(x, ParameterInfo)), None)
        # in Annotated[...], typer.Option's first argument is a flag, not the default
        given = [getattr(info, "default", None), *(getattr(info, "param_decls", None) or ())]
        decls = [d for d in given if isinstance(d, str) and d.startswith("--")]
        names[p.name] = decls[0].split("/")[0] if decls else p.name
    return names


def _check_integers(kwargs: dict, flags: dict[str, str]) -> None:
    """SeqparError for a whole-number option past INT64_MAX: typer reads any number of digits (a 400-digit --steps), and
    what the command hands it to (torch, NumPy, the cost model's floats) cannot hold it."""
    for name, value in kwargs.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            text = str(value)
            shown = text if len(text) <= 30 else f"{text[:12]}... ({len(text)} digits)"
            raise SeqparError(
                f"{flags.get(name, name)} {shown} is more than {INT64_MAX} (2**63 - 1), the most any count seqpar takes "
                "can be; give a smaller number"
            )


def handle_errors(fn):
    """Map exceptions to exit codes: SeqparError/ValidationError -> 2 (invalid input), a missing optional dependency
    (seqpar.plan.extras) -> 1 with the extra to install, Ctrl-C -> 130, any other error -> 3 (internal: never 1, which `check`
    and `launch` give a meaning; SEQPAR_DEBUG=1 re-raises). One line each."""

    flags = _flag_names(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _check_integers(kwargs, flags)
            return fn(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except SeqparError as e:
            note(f"error: {literal(str(e), newlines=False)}")
            raise typer.Exit(EXIT_INVALID) from None
        except MissingExtra as e:  # the install lacks an optional dependency: a known failure, not bad input
            note(f"error: {literal(str(e), newlines=False)}")
            raise typer.Exit(EXIT_OOM_OR_FAILED) from None
        except ValidationError as e:
            note(f"error: {literal(first_error(e), newlines=False)}")
            raise typer.Exit(EXIT_INVALID) from None
        except KeyboardInterrupt:
            note("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as e:
            if os.environ.get("SEQPAR_DEBUG"):
                raise
            missing = from_error(e) if isinstance(e, ModuleNotFoundError) else None
            if missing is not None:  # an optional dependency (seqpar.plan.extras) imported deep in a command
                note(f"error: {missing}")
                raise typer.Exit(EXIT_OOM_OR_FAILED) from None
            first = str(e).splitlines()[0] if str(e) else ""
            note(
                f"internal error: {type(e).__name__}: {literal(first, newlines=False)} (a bug in seqpar; "
                f"run with SEQPAR_DEBUG=1 to see the traceback)"
            )
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def print_json(obj) -> None:
    typer.echo(obj if isinstance(obj, str) else json.dumps(obj, indent=2))


__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OOM_OR_FAILED",
    "ReadableCommand",
    "handle_errors",
    "note",
    "print_json",
    "say",
    "stderr",
    "stdout",
]
