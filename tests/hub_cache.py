"""A Hugging Face Hub cache on disk, for tests that must not touch the network.

Written in huggingface_hub's documented layout ("Manage the cache" guide): ``models--ORG--NAME/blobs/<sha256>`` holds
each file once, ``snapshots/<commit>/<file>`` links to its blob, ``refs/<branch>`` holds the commit. Tests check the
result with huggingface_hub's own ``scan_cache_dir``, so the layout is the library's, not a guess.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes], *, ref: str = "main", commit: str | None = None) -> Path:
    """Put ``files`` (name -> bytes) into ``cache`` as repo ``repo_id`` at ``ref``; returns the snapshot folder."""
    commit = commit or hashlib.sha1(repo_id.encode() + b"".join(k.encode() + v for k, v in sorted(files.items()))).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def add_folder(cache: Path, repo_id: str, folder: Path, **kw) -> Path:
    """A saved model folder (save_pretrained) as repo ``repo_id``."""
    return add_repo(cache, repo_id, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}, **kw)


def use_cache(monkeypatch, home: Path, *, offline: bool = True) -> Path:
    """Point HF_HOME at ``home`` (the cache is ``home/hub``) and, by default, forbid the network (HF_HUB_OFFLINE=1)."""
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache = home / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    return cache
