"""What the trust tests plant: a pickle that would run code (it creates a marker file when unpickled), and the check
that a refusal is one printable line."""

from __future__ import annotations

from pathlib import Path

import pytest


class Marker:
    """Unpickled, it creates ``path`` (what a forged checkpoint, model .bin or .npy would run instead); the tests assert
    the file never appears."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __reduce__(self):
        return (Path.touch, (self.path,))


def one_line(e: pytest.ExceptionInfo) -> str:
    """The refusal's message, asserted to be one line of printable characters."""
    message = str(e.value)
    assert "\n" not in message and all(ch.isprintable() for ch in message), message
    return message
