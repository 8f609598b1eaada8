"""Plan-side files: JSON objects read with one-line errors, text written atomically (never half a file, never over what is
not a regular file), and pydantic errors said in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from seqpar.plan.base import SCHEMA_VERSION
from seqpar.plan.errors import SeqparError
from seqpar.plan.units import MAX_INT_DIGITS


def first_error(e: ValidationError) -> str:
    """One line from a pydantic error: the field path and the message."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = f"unknown field (not part of schema version {SCHEMA_VERSION})"
    return f"{loc}: {msg}" if loc else msg  # a rule across fields (a model validator) has no field path


# Bounds on a JSON file read back (a plan, a tool's or a model's config): a plan seqpar writes is tens of kilobytes and
# a few levels deep, a config.json a few kilobytes. A file far past them is no such file, and parsing it anyway costs
# memory without bound (a 150 MB plan grew past 7.8 GB in `seqpar explain`) or raises what is no one-line error (Python
# refuses an integer of over 4300 digits with a ValueError; a file nested thousands deep, a RecursionError).
MAX_JSON_BYTES = 4 << 20
MAX_JSON_DEPTH = 64


def read_json_object(
    path: Path,
    what: str,
    kind: str,
    *,
    missing_fix: str,
    invalid_fix: str,
    finite: bool = False,
    int_max: int | None = None,
    limit: int = MAX_JSON_BYTES,
) -> dict:
    """The JSON object in ``path``; SeqparError naming ``what`` file it is, what is wrong and a fix otherwise.

    Refused with one line: a path that is no regular file (a FIFO is not opened for reading: it would block), more than
    ``limit`` bytes (checked before reading), bytes that are not UTF-8 JSON, an integer of more than MAX_INT_DIGITS
    digits, nesting deeper than MAX_JSON_DEPTH, a lone surrogate in a string; with ``finite``, NaN and Infinity (which
    Python's json reads, and no finite quantity means); with ``int_max``, an integer beyond it."""
    raw = read_bounded(path, what, missing_fix, limit)
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_int_reader(path, what, invalid_fix))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SeqparError(f"{what} {_shown(path)} is not valid JSON ({e}); {invalid_fix}") from None
    except RecursionError:  # a hostile file nests thousands of levels deep
        raise SeqparError(f"{what} {_shown(path)} nests too deeply to be a {kind}; {invalid_fix}") from None
    if not isinstance(data, dict):
        raise SeqparError(f"{what} {_shown(path)} holds a {type(data).__name__}, not a {kind} object")
    bad = _first_problem(data, finite, int_max)
    if bad is not None:
        where, problem = bad
        if problem == "deep":
            raise SeqparError(
                f"{what} {_shown(path)} nests more than {MAX_JSON_DEPTH} levels deep (at {where}), too deeply to be a "
                f"{kind}; {invalid_fix}"
            )
        raise SeqparError(f"{what} {_shown(path)}: {where} {problem}; {invalid_fix}")
    return data


def _shown(path: Path) -> str:
    from seqpar.plan.safe import printable

    return repr(printable(str(path)))


def read_bounded(path: Path, what: str, missing_fix: str, limit: int) -> bytes:
    """The bytes of ``path`` (links followed: a Hub snapshot's files are links), a regular file of at most ``limit``."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SeqparError(f"{what} {_shown(path)} does not exist; {missing_fix}") from None
    except OSError as e:
        if os.path.isdir(path):
            raise SeqparError(f"{what} {_shown(path)} does not exist; {missing_fix}") from None  # as before: not a file
        raise SeqparError(f"{what} {_shown(path)} cannot be read ({e.strerror}); {missing_fix}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise SeqparError(f"{what} {_shown(path)} does not exist; {missing_fix}")
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
            raise SeqparError(f"{what} {_shown(path)} is {kind}, not a file; pass the file itself")
        if st.st_size > limit:
            raise SeqparError(
                f"{what} {_shown(path)} holds {st.st_size:,} bytes, more than the {limit:,} a {what} can hold; "
                f"it is not one: {missing_fix}"
            )
        os.set_blocking(f.fileno(), True)
        raw = f.read(limit + 1)  # a file that grew since fstat
    if len(raw) > limit:
        raise SeqparError(f"{what} {_shown(path)} holds more than the {limit:,} bytes a {what} can hold; {missing_fix}")
    return raw


def _int_reader(path: Path, what: str, invalid_fix: str):
    """json's parse_int: the digits counted before Python converts them (past 4300 it raises a bare ValueError)."""

    def read(text: str) -> int:
        digits = len(text) - text.startswith("-")
        if digits > MAX_INT_DIGITS:
            raise SeqparError(
                f"{what} {_shown(path)} holds an integer of {digits} digits ({text[:12]}...); no value seqpar reads has "
                f"more than {MAX_INT_DIGITS}; {invalid_fix}"
            )
        return int(text)

    return read


def _first_problem(data, finite: bool, int_max: int | None) -> tuple[str, str] | None:
    """(where, what is wrong) for the first value of a parsed JSON object, walked without recursion, that is too deep, a
    string (key or value) holding a lone UTF-16 surrogate (JSON's \\ud800 escapes decode to them; they cannot be printed
    or written as UTF-8), with ``finite`` a NaN or infinity, with ``int_max`` an integer beyond it; else None."""
    import math

    stack = [(data, "", 0)]
    while stack:
        obj, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return where, "deep"
        if isinstance(obj, str):
            if _lone_surrogate(obj):
                return where or "the value", "holds a lone surrogate (\\ud800-\\udfff), which is not text"
        elif isinstance(obj, float):
            if finite and not math.isfinite(obj):
                return where, f"is {'NaN' if obj != obj else 'Infinity' if obj > 0 else '-Infinity'}, not a finite number"
        elif isinstance(obj, int) and not isinstance(obj, bool):
            if int_max is not None and abs(obj) > int_max:
                return where, f"is {obj}, more than {int_max} (2**63 - 1), the most a count or size seqpar reads can be"
        elif isinstance(obj, (dict, list)):
            items = list(obj.items() if isinstance(obj, dict) else enumerate(obj))
            for k, v in reversed(items):  # popped in order: the first problem in the file is the one named
                stack.append((v, f"{where}.{k}" if where else str(k), depth + 1))
                if isinstance(k, str) and _lone_surrogate(k):
                    stack.append((k, f"a key of {where or 'the object'}", depth))
    return None


def _lone_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def write_atomic(path: str | Path, text: str) -> Path:
    """Write text to path via a temporary sibling and os.replace, so readers never see half a file. Only a new path or a
    regular file is written: a folder, FIFO, device or socket there is refused (SeqparError), never replaced."""
    import os
    import stat
    import tempfile

    p = Path(path)
    try:
        mode = p.stat().st_mode  # follows a symbolic link: a link to /dev/null is a device
    except FileNotFoundError:
        mode = None
    except OSError as e:  # e.g. a file where a folder of the path must be
        raise SeqparError(f"cannot write {str(p)!r}: {e.strerror}; pick another path") from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise SeqparError(f"{str(p)!r} is {kind}, not a file; seqpar writes only new paths or regular files: pick a file name")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise SeqparError(f"cannot write {str(p)!r}: {e.strerror} ({e.filename}); pick another path") from None
    try:
        # mkstemp makes the file 0600; a plan on a shared file system must be as readable as any file the user writes:
        # the mode of the file replaced, else 0666 less the umask.
        os.fchmod(fd, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask sets as it reads: a thread creating
    a file meanwhile would get the wrong mode)."""
    import os

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
