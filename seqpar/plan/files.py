"""Plan-side files: JSON objects read with one-line errors, text written atomically (never half a file, never over what is
not a regular file), and pydantic errors said in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from seqpar.plan.base import SCHEMA_VERSION
from seqpar.plan.errors import SeqparError


def first_error(e: ValidationError) -> str:
    """One line from a pydantic error: the field path and the message."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = f"unknown field (not part of schema version {SCHEMA_VERSION})"
    return f"{loc}: {msg}" if loc else msg  # a rule across fields (a model validator) has no field path


def read_json_object(path: Path, what: str, kind: str, *, missing_fix: str, invalid_fix: str) -> dict:
    """The JSON object in ``path``; SeqparError naming ``what`` file it is, what is wrong and a fix otherwise."""
    if not path.is_file():
        raise SeqparError(f"{what} {str(path)!r} does not exist; {missing_fix}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SeqparError(f"{what} {str(path)!r} is not valid JSON ({e}); {invalid_fix}") from None
    except RecursionError:  # a hostile file nests thousands of levels deep
        raise SeqparError(f"{what} {str(path)!r} nests too deeply to be a {kind}; {invalid_fix}") from None
    if not isinstance(data, dict):
        raise SeqparError(f"{what} {str(path)!r} holds a {type(data).__name__}, not a {kind} object")
    bad = _lone_surrogate(data)
    if bad is not None:
        raise SeqparError(
            f"{what} {str(path)!r}: {bad} holds a lone surrogate (\\ud800-\\udfff), which is not text; {invalid_fix}"
        )
    return data


def _lone_surrogate(obj, where: str = "") -> str | None:
    """The path of the first string (key or value) in a JSON value that holds a lone UTF-16 surrogate, else None (JSON's
    \\ud800 escapes decode to them; they cannot be printed or written as UTF-8)."""
    if isinstance(obj, str):
        return (where or "the value") if any("\ud800" <= ch <= "\udfff" for ch in obj) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        here = f"{where}.{k}" if where else str(k)
        if isinstance(k, str) and _lone_surrogate(k) is not None:
            return f"a key of {where or 'the object'}"
        found = _lone_surrogate(v, here)
        if found is not None:
            return found
    return None


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
