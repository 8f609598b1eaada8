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


class ReadableCommand(TyperCommand):
    """A command whose --help reads at 80 columns: an option with many choices shows a short name (MODE) in the type
    column, which rich would otherwise fold mid-word, and lists its choices in its help text instead."""

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


def handle_errors(fn):
    """Map exceptions to exit codes: SeqparError/ValidationError -> 2 (invalid input), a missing optional dependency
    (seqpar.plan.extras) -> 1 with the extra to install, Ctrl-C -> 130, any other error -> 3 (internal: never 1, which `check`
    and `launch` give a meaning; SEQPAR_DEBUG=1 re-raises). One line each."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
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
