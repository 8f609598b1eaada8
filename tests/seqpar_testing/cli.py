"""The CLI tests' tools: the typer app through CliRunner, the one-line error a refusal prints, and a character device
of our own to aim outputs at. No torch."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from seqpar.cli import app

runner = CliRunner()


def run(*args):
    """``seqpar ARGS`` in this process (CliRunner: stdout and stderr apart)."""
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(r) -> str:
    """The refusal's only line on stderr, which starts with "error: "."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def device_node(path: Path) -> Path:
    """A character device of our own (what /dev/null is), never the real one: a seqpar that replaced the target would
    turn the system's /dev/null into a file when run as root. Making one needs root; the test is skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path
