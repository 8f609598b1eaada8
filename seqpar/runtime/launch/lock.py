"""One job per output folder, for as long as any process of it lives: the launcher's lock and the ranks' hold.

Two flocks on two files in the output folder, never unlinked (a later launch must find the same files to see them):

- ``.seqpar-launch.lock``, exclusive, held by the launcher for its life; it holds the launcher's pid as text, for the
  messages. A second launch into the folder is refused naming that pid.
- ``.seqpar-ranks.lock``, shared, held by every rank of the job for its life (``hold``: the launcher names the file in
  SEQPAR_RANKS_LOCK). The kernel drops a flock when the last process holding it exits, so the folder stays taken while
  any rank lives. A launcher killed with ``kill -9`` frees its own lock at once, while its ranks get the parent-death
  signal and stop after their step with a checkpoint (seqpar.runtime.launch.stopping): the next launch waits for them
  (``wait_for_ranks``) before it reads the folder, so no two jobs write it at once. A stopped launcher waits on the
  same lock before it says which checkpoint the ranks left.

Both files are opened without following a symbolic link (seqpar.plan.safe.open_nofollow): a link there is refused with
one line and whatever it points at is left untouched. Linux and macOS (flock); torch-free.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import open_nofollow, printable

LOCK_NAME = ".seqpar-launch.lock"
RANKS_NAME = ".seqpar-ranks.lock"
RANKS_ENV = "SEQPAR_RANKS_LOCK"  # set by the launcher for its ranks: the file they hold
_POLL_S = 0.05
_held: list[int] = []  # this rank's hold (a file descriptor kept open for the life of the process)


def _open(path: Path, flags: int) -> int | None:
    """A descriptor of the lock file ``path`` (never through a link); None when it does not exist."""
    try:
        return open_nofollow(path, flags, what="launch lock file")
    except FileNotFoundError:
        return None


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_holder(out: Path) -> int | None:
    """The pid of the live launch that holds ``out``'s lock; None when there is none (no lock file, or a dead one's);
    -1 when the holder wrote no pid."""
    fd = _open(Path(out) / LOCK_NAME, os.O_RDONLY)
    if fd is None:
        return None
    try:
        if _try(fd, fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)


def _recorded_pid(out: Path) -> str:
    fd = _open(Path(out) / LOCK_NAME, os.O_RDONLY)
    if fd is None:
        return "unknown"
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return text if text.isdigit() else "unknown"


def rank_pids(out: Path) -> list[int] | None:
    """The pids of the processes holding ``out``'s ranks lock (empty when they cannot be named), or None when no
    process holds it."""
    fd = _open(Path(out) / RANKS_NAME, os.O_RDONLY)
    if fd is None:
        return None
    try:
        if _try(fd, fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return _flock_pids(st.st_dev, st.st_ino)


def _flock_pids(dev: int, ino: int) -> list[int]:
    """Who holds a flock on the file (dev, ino), from /proc/locks (Linux): "1: FLOCK ADVISORY READ <pid> MA:MI:INODE ..."."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    pids = set()
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want and parts[4].isdigit():
            pids.add(int(parts[4]))
    return sorted(pids)


def wait_for_ranks(out: Path, timeout_s: float, echo=None) -> list[int]:
    """Wait up to ``timeout_s`` for every process holding ``out``'s ranks lock to exit; the pids still holding it
    (empty: none). ``echo`` gets one line when there is something to wait for."""
    held = rank_pids(out)
    if held is None:
        return []
    if echo is not None:
        who = f" (pid {', '.join(map(str, held))})" if held else ""
        echo(
            f"seqpar launch: ranks of an earlier launch of {printable(str(out))!r} (launcher pid {_recorded_pid(out)}, "
            f"which has ended) are still exiting{who}; waiting up to {timeout_s:.0f} s for them"
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        held = rank_pids(out)
        if held is None:
            return []
    return held or [-1]


def check_free(out: Path, timeout_s: float, echo=None) -> None:
    """SeqparError (one line) when a live launch holds ``out``, or when the ranks of an ended one still hold it after
    ``timeout_s`` seconds of waiting for them."""
    holder = lock_holder(out)
    if holder is not None:
        pid = holder if holder > 0 else "unknown"
        raise SeqparError(
            f"output {printable(str(out))!r} is in use by another seqpar launch (pid {pid}); wait for it, stop it "
            f"(kill {pid}), or pick another --output"
        )
    left = wait_for_ranks(out, timeout_s, echo)
    if left:
        pids = " ".join(str(p) for p in left if p > 0)
        how = f"stop them (kill {pids})" if pids else f"find them with `fuser -v {printable(str(Path(out) / RANKS_NAME))}`"
        raise SeqparError(
            f"output {printable(str(out))!r} is still in use by ranks of an earlier launch (launcher pid "
            f"{_recorded_pid(out)}, which has ended) after {timeout_s:.0f} s; {how}, or pick another --output"
        )


class OutputLock:
    """The launcher's hold on an output folder (``lock_output``); ``close()`` or the process's end releases it."""

    def __init__(self, out: Path, fd: int):
        self.out, self.fd = out, fd

    @property
    def ranks_file(self) -> Path:
        return self.out / RANKS_NAME

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_output(out: Path) -> OutputLock:
    """Hold ``out``'s lock for this process, write its pid there and make the ranks' lock file; SeqparError when another
    launch holds it, or when either file is a link."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fd = open_nofollow(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, what="launch lock file")
    if not _try(fd, fcntl.LOCK_EX):
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        os.close(fd)
        pid = text if text.isdigit() else "unknown"
        raise SeqparError(f"output {printable(str(out))!r} is in use by another seqpar launch (pid {pid}); pick another --output")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.close(open_nofollow(out / RANKS_NAME, os.O_RDONLY | os.O_CREAT, what="launch lock file"))
    except BaseException:
        os.close(fd)
        raise
    return OutputLock(out, fd)


def hold(timeout_s: float = 5.0) -> None:
    """In a rank: hold the ranks lock the launcher named (SEQPAR_RANKS_LOCK) for the life of this process; nothing when
    none is named or the file is gone. Only a launch's instant probe can hold it exclusively, so a short wait covers
    that; past ``timeout_s``, SeqparError (another launch is taking the folder)."""
    path = os.environ.get(RANKS_ENV)
    if not path or _held:
        return
    fd = _open(Path(path), os.O_RDONLY)
    if fd is None:
        return
    deadline = time.monotonic() + timeout_s
    while not _try(fd, fcntl.LOCK_SH):
        if time.monotonic() > deadline:
            os.close(fd)
            raise SeqparError(
                f"the output folder's ranks lock {printable(path)!r} is taken by another seqpar launch; this job stops"
            )
        time.sleep(_POLL_S / 5)
    _held.append(fd)


__all__ = [
    "LOCK_NAME",
    "RANKS_ENV",
    "RANKS_NAME",
    "OutputLock",
    "check_free",
    "hold",
    "lock_holder",
    "lock_output",
    "rank_pids",
    "wait_for_ranks",
]
