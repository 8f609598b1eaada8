"""The `seqpar` command line: it only assembles commands from option dataclasses; the work lives in seqpar.advisor,
seqpar.emit and seqpar.runtime.

One module per command family: advise (advise, explain, schema), check, calibrate, profiles (probe, profiles), launch
(launch, verify), eval (perplexity, needle); base holds what they share (help at 80 columns, exit codes, where text
goes), params the typer options built from seqpar.plan's option dataclasses. Importing it imports no torch.
"""

import typer

from seqpar.cli import advise, calibrate, check, launch, profiles
from seqpar.cli.base import ReadableCommand
from seqpar.cli.eval import eval_app
from seqpar.cli.glossary import GLOSSARY

app = typer.Typer(
    name="seqpar",
    help="Plan, check and run sequence-parallel long-context training.\n\n" + GLOSSARY,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
for command in (
    advise.advise,
    advise.explain,
    check.check,
    calibrate.calibrate,
    advise.schema,
    profiles.probe,
    launch.launch,
    launch.verify,
):
    app.command(cls=ReadableCommand)(command)
app.add_typer(profiles.profiles_app, name="profiles")
app.add_typer(eval_app, name="eval")


def _version(given: bool) -> None:
    if given:
        from seqpar import __version__

        typer.echo(f"seqpar {__version__}")
        raise typer.Exit()


@app.callback()
def _top(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print seqpar's version and exit."),
) -> None:
    """Plan, check and run sequence-parallel long-context training."""


def main() -> None:
    """Console-script entry (`seqpar`)."""
    app(prog_name="seqpar")


__all__ = ["app", "main"]
