"""The run folder's own files as the ranks write and read them back: train.log, metrics.jsonl, run_report.json,
tracker_run.json, the profiler's files, the eval reports.

A run folder may come from someone else (copied, shared, restored from an archive), so a name in it is never followed
through a symbolic link: a ``train.log`` linked to a ``.pth`` file in site-packages would otherwise have the log write
Python that the next interpreter start runs. Files are written whole (seqpar.plan.files.write_atomic) or appended to
(seqpar.plan.safe.append_text), each only after its name was found to be a new path or a regular file; a link, FIFO,
device or folder there is one line (SeqparError, exit 2). Folders the trainer writes into (``profile/``,
``tensorboard/``, ``wandb/``) must not be links nor hold one that leads out of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from seqpar.plan.files import write_atomic
from seqpar.plan.safe import inside, links_in, open_nofollow, read_bytes, refuse_links


def check_file(path: str | Path, what: str) -> None:
    """SeqparError when ``path`` is a symbolic link or anything but a regular file; nothing when it is missing."""
    try:
        fd = open_nofollow(path, os.O_RDONLY, what=what)
    except FileNotFoundError:
        return
    os.close(fd)


def write_file(path: str | Path, text: str, what: str) -> None:
    """``text`` as the whole of ``path`` (atomically), never through a link: a link there is refused, not replaced, so
    the refusal says what was planted."""
    check_file(path, what)
    write_atomic(path, text)


def read_file(path: str | Path, what: str, limit: int | None = None) -> bytes | None:
    """The bytes of ``path``, never through a link; None when it does not exist."""
    try:
        return read_bytes(path, what=what, limit=limit)
    except FileNotFoundError:
        return None


def check_folder(folder: str | Path, what: str, *, library_links: bool = False) -> None:
    """SeqparError when ``folder`` (one the trainer or a tracker writes into) is a symbolic link, or holds one whose
    target lies outside it (a link that stays inside cannot point a write at another file of yours).
    ``library_links``: the folder is a library's own that makes links out of it by design and re-creates them each run
    (W&B links ``wandb/*/logs/debug-core.log`` to its cache and writes each run into a new ``offline-run-*`` folder);
    only the folder itself is checked then."""
    if not os.path.lexists(folder):
        return
    root = Path(folder)
    if root.is_symlink():
        refuse_links(root, what)
    if library_links:
        return
    outside = [p for p in links_in(root) if not inside(root, p.resolve())]
    if outside:
        refuse_links(outside[0], what)


__all__ = ["check_file", "check_folder", "read_file", "write_file"]
