"""A run folder from someone else is data, never code: the primitives every reader and writer of a run folder uses.

* ``printable``: a value from a file, made safe to write to a log line or a terminal (control characters, line
  separators and bidirectional overrides escaped, so a value cannot start a new log line or redraw the screen).
* ``open_nofollow`` / ``append_text`` / ``read_bytes``: open a run-folder file without following a symbolic link, and
  only a regular file (a FIFO or device would block or never end).
* ``links_in``: every symbolic link in a folder tree (the run tree holds none that seqpar made).
* ``inside``: whether a path resolves inside a folder (``latest`` and other names read from the folder).

Pure Python, no seqpar import beyond errors: the launcher, the ranks and the CLI use the same rules.
"""

from __future__ import annotations

import os
import stat
import unicodedata
from pathlib import Path

from seqpar.plan.errors import SeqparError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def printable(value: object, limit: int = 200) -> str:
    """``value`` as text safe for one log line or a terminal: control characters (C0, DEL, C1), line and paragraph
    separators, and bidirectional or other format characters escaped as ``\\xNN`` / ``\\uNNNN``; longer than ``limit``
    characters, cut with the count of the rest."""
    text = value if isinstance(value, str) else str(value)
    out = []
    for ch in text[:limit]:
        cat = unicodedata.category(ch)
        if ch == "\\":
            out.append("\\\\")
        elif cat in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn") and ch != " ":
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    if len(text) > limit:
        out.append(f"... ({len(text) - limit} more characters)")
    return "".join(out)


def _link_error(path: Path, what: str) -> SeqparError:
    return SeqparError(
        f"{what} {printable(str(path))!r} is a symbolic link; seqpar never follows links in a run folder (one could "
        f"point a write at any file you own): remove it (rm {printable(str(path))!r}) or use another --output"
    )


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def open_nofollow(path: str | Path, flags: int, *, what: str = "run-folder file", create_mode: int = 0o644) -> int:
    """os.open ``path`` without following a symbolic link at its last component, and only a regular file: a link is
    refused with one line (SeqparError), as is a FIFO, device, socket or folder. Returns the file descriptor."""
    p = Path(path)
    try:
        fd = os.open(p, flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, create_mode)
    except OSError:
        if os.path.islink(p):  # ELOOP on Linux; some systems say EMLINK or EFTYPE
            raise _link_error(p, what) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SeqparError(
                f"{what} {printable(str(p))!r} is {_kind(mode)}, not a regular file; remove it or use another --output"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_text(path: str | Path, text: str, *, what: str = "run-folder file") -> None:
    """Append ``text`` to ``path`` (created 0644 if missing), never through a symbolic link."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what=what)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)


def read_bytes(path: str | Path, *, what: str = "run-folder file", limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, never through a symbolic link; over ``limit`` bytes is refused."""
    fd = open_nofollow(path, os.O_RDONLY, what=what)
    with os.fdopen(fd, "rb") as f:
        if limit is not None:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise SeqparError(
                    f"{what} {printable(str(path))!r} holds {size} bytes, more than the {limit} such a file can hold; "
                    "it is not one seqpar wrote: remove it or point at the right file"
                )
        return f.read()


def links_in(root: str | Path) -> list[Path]:
    """Every symbolic link at or under ``root`` (not followed), sorted."""
    r = Path(root)
    if r.is_symlink():
        return [r]
    found = []
    for here, dirs, files in os.walk(r, followlinks=False):
        for name in dirs + files:
            p = Path(here, name)
            if p.is_symlink():
                found.append(p)
    return sorted(found)


def refuse_links(root: str | Path, what: str = "run folder") -> None:
    """SeqparError naming the first symbolic link at or under ``root`` (and how many there are), if any."""
    found = links_in(root)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise SeqparError(
            f"{what} {printable(str(root))!r} holds a symbolic link, {printable(str(found[0]))!r}{more}; seqpar never "
            f"follows links in a run folder (one could point a write or a read at any file you own): remove "
            f"{'them' if more else 'it'} or use another --output"
        )


def inside(root: str | Path, path: str | Path) -> bool:
    """True when ``path`` (relative to ``root`` if not absolute) resolves to ``root`` or below it."""
    r = Path(root).resolve()
    p = Path(path) if Path(path).is_absolute() else Path(root, path)
    try:
        p.resolve().relative_to(r)
    except ValueError:
        return False
    return True
