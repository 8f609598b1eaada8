"""The tokenized-data cache: one folder per (data source, tokenizer), built once, shared by every rank and every stage.

Key: the SHA-256 of the source's identity (a file: its resolved path, size and modification time in ns, as `datasets`
keys local data files; a `save_to_disk` folder: its path and `datasets` fingerprint) and the tokenizer's (the fast
tokenizer's full JSON, the chat template, the special tokens, the transformers and tokenizers versions), and ``FORMAT``. Neither the sequence length nor the rank
is in it: recipe stages (other seq_len) and every rank read the same entry; only the packing into windows is per length
(``pack-<S>-<policy>.npz`` inside the entry, seqpar.runtime.data.pack).

Building is one process at a time per entry: an flock on ``<root>/<key>.lock`` (works across the processes of a node, and
across nodes on a file system with flock). The first process to take it builds into ``<key>.tmp-<pid>`` and renames the
folder into place (a reader never sees half an entry); the others wait on the lock, then find the entry and read it.
So the launcher builds it before any rank starts, and ranks started without it wait for the one that builds. A build
that fails on the input (a bad line) leaves ``<key>.error`` with its one line: the ranks waiting behind it repeat that
line instead of tokenizing again. Writes are atomic (a temporary name, then rename).

Default root: ``$SEQPAR_DATA_CACHE``, else ``$XDG_CACHE_HOME/seqpar/data``, else ``~/.cache/seqpar/data``; ``--data-cache``
overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from seqpar.plan.errors import SeqparError

FORMAT = 1  # bump when what an entry holds changes: older entries are then simply not found


def default_root() -> Path:
    if os.environ.get("SEQPAR_DATA_CACHE"):
        return Path(os.environ["SEQPAR_DATA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seqpar" / "data"


def source_identity(path: Path) -> dict:
    """What identifies a data file or folder without reading it all (a changed file gets a new entry)."""
    p = path.resolve()
    if p.is_dir():
        return {"path": str(p), "fingerprint": _datasets_fingerprint(p)}
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _datasets_fingerprint(folder: Path) -> str:
    """The `datasets` fingerprints recorded by save_to_disk (state.json, one per split), else the files' sizes and times."""
    found = sorted(folder.rglob("state.json"))
    if found:
        return ",".join(json.loads(f.read_text()).get("_fingerprint", "") for f in found)
    return ",".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(folder.rglob("*")) if f.is_file())


def tokenizer_identity(tok) -> str:
    """A digest of everything that decides how the tokenizer turns text and chats into ids (the library versions too:
    templates render, and masks are found, by transformers' code)."""
    import tokenizers
    import transformers

    h = hashlib.sha256(f"{type(tok).__name__} {transformers.__version__} {tokenizers.__version__}".encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary files
        for name in sorted(getattr(tok, "vocab_files_names", {}).values()):
            f = Path(tok.name_or_path) / name
            if f.is_file():
                h.update(f.read_bytes())
    template = getattr(tok, "chat_template", None)
    h.update(json.dumps(template, sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted((k, str(v)) for k, v in tok.special_tokens_map.items())).encode())
    return h.hexdigest()


def key(identity: dict) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **identity}, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _locked(root: Path, k: str):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{k}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds this entry
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def entry(root: Path, identity: dict, build) -> tuple[Path, bool]:
    """The entry folder for ``identity``, built by ``build(tmp_folder)`` when missing; (folder, built here).
    ``build`` writes the entry's files into the folder it gets; a SeqparError it raises is remembered (``<key>.error``)."""
    k = key(identity)
    folder, error = root / k, root / f"{k}.error"
    if (folder / "meta.json").is_file():
        return folder, False
    try:
        with _locked(root, k):
            if (folder / "meta.json").is_file():  # another process built it while this one waited
                return folder, False
            if error.is_file():
                raise SeqparError(error.read_text().strip())
            for stale in root.glob(f"{k}.tmp-*"):  # a build killed midway (the lock is ours: nobody else builds it)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f"{k}.tmp-{os.getpid()}"
            tmp.mkdir(parents=True)
            try:
                build(tmp)
                (tmp / "identity.json").write_text(json.dumps(identity, indent=2) + "\n")
                os.replace(tmp / "meta.json.part", tmp / "meta.json")  # the entry is complete when meta.json exists
                os.rename(tmp, folder)
            except SeqparError as e:
                write_atomic(error, str(e) + "\n")
                raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise SeqparError(
            f"cannot write the data cache at {str(root)!r} ({type(e).__name__}: {e}); pass --data-cache DIR on a writable disk"
        ) from None
    return folder, True


def write_meta(tmp: Path, meta: dict) -> None:
    """What ``build`` writes last: meta.json (as meta.json.part; ``entry`` commits it)."""
    (tmp / "meta.json.part").write_text(json.dumps(meta, indent=2) + "\n")


def write_atomic(path: Path, text: str) -> None:
    part = path.with_name(f"{path.name}.part-{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)


def read_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())
