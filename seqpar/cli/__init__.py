"""The `seqpar` command line: it only assembles commands from option dataclasses; the work lives in seqpar.advisor,
seqpar.emit and seqpar.runtime."""

from seqpar.cli.commands import app, main

__all__ = ["app", "main"]
