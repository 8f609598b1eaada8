"""The tokenized-data cache: one folder per (data content, tokenizer), built once, shared by every rank and every stage.

Key: the SHA-256 of the source's identity and the tokenizer's (the fast tokenizer's full JSON, the chat template, the
special tokens, the transformers and tokenizers versions), and ``FORMAT``. The source is keyed by its content: the
SHA-256 of its bytes (seqpar.runtime.data.source.content_digest) when the identity holds it, so a file edited in place
gets a new entry whatever its path, size or time, and a moved, copied or touched one finds its old entry; without a
digest, by its path, size and modification time (a `save_to_disk` folder: its path and `datasets` fingerprint). Neither
the sequence length nor the rank is in it: recipe stages (other seq_len) and every rank read the same entry; only the
packing into windows is per length (``pack-<S>-<policy>.npz`` inside the entry, seqpar.runtime.data.pack).

Building is one process at a time per entry: an flock on ``<root>/<key>.lock`` (works across the processes of a node, and
across nodes on a file system with flock). The first process to take it builds into ``<key>.tmp-<pid>`` and renames the
folder into place (a reader never sees half an entry); the others wait on the lock, then find the entry and read it.
So the launcher builds it before any rank starts, and ranks started without it wait for the one that builds. A build
that fails on the input (a bad line) leaves ``<key>.error`` with its one line: the ranks waiting behind it repeat that
line instead of tokenizing again. Writes are atomic (a temporary name, then rename).

An entry records the size and SHA-256 of each file it was built with (``digests.json``); a reader checks them (once per
file as it is on disk: device, inode, size, and modification and change times, which any write moves) and rebuilds an
entry whose files were truncated, edited or removed, instead of training on them or failing with a traceback.

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
from seqpar.plan.safe import printable

FORMAT = 2  # bump when what an entry holds changes: older entries are then simply not found (2: digests.json)
DIGESTS = "digests.json"
META_LIMIT = 1 << 20  # bytes of meta.json, digests.json or a build's error line: each is a few hundred
_verified: set[tuple] = set()  # (file identity, digest) checked by this process


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
    """The `datasets` fingerprints recorded by save_to_disk (state.json, one per split), else the files' sizes and times
    (also for a state.json that is no JSON object: the folder is data from anyone)."""
    found = sorted(folder.rglob("state.json"))
    try:
        prints = [json.loads(f.read_bytes()[:META_LIMIT]).get("_fingerprint", "") for f in found]
        if found and all(isinstance(x, str) for x in prints):
            return ",".join(prints)
    except (OSError, ValueError, RecursionError, AttributeError):
        pass
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
    """The entry's name for ``identity``: a source that carries its content digest (``sha256``) is keyed by it alone."""
    source = identity.get("source")
    if isinstance(source, dict) and source.get("sha256"):
        identity = {**identity, "source": {"sha256": source["sha256"]}}
    return hashlib.sha256(json.dumps({"format": FORMAT, **identity}, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _locked(root: Path, k: str):
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{k}.lock"
    try:  # never through a link: one could make the open create a file wherever it points
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o644)
    except OSError:
        if lock.is_symlink():
            raise SeqparError(
                f"data cache lock {printable(str(lock))!r} is a symbolic link, which seqpar never follows; remove it or "
                "pass --data-cache DIR"
            ) from None
        raise
    with os.fdopen(fd, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds this entry
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def entry(root: Path, identity: dict, build) -> tuple[Path, bool]:
    """The entry folder for ``identity``, built by ``build(tmp_folder)`` when missing or damaged; (folder, built here).
    ``build`` writes the entry's files into the folder it gets; a SeqparError it raises is remembered (``<key>.error``)."""
    k = key(identity)
    folder, error = root / k, root / f"{k}.error"
    if (folder / "meta.json").is_file() and _intact(folder):
        return folder, False
    try:
        with _locked(root, k):
            if (folder / "meta.json").is_file() and _intact(folder):  # another process built it while this one waited
                return folder, False
            if folder.exists():  # damaged (a file truncated, edited or gone) or never finished: built again
                aside = root / f"{k}.damaged-{os.getpid()}"
                os.rename(folder, aside)  # a process still reading the old files keeps them until it closes them
                shutil.rmtree(aside, ignore_errors=True)
            remembered = _remembered_error(error)
            if remembered:
                raise SeqparError(remembered)
            for stale in root.glob(f"{k}.tmp-*"):  # a build killed midway (the lock is ours: nobody else builds it)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f"{k}.tmp-{os.getpid()}"
            tmp.mkdir(parents=True)
            try:
                build(tmp)
                (tmp / "identity.json").write_text(json.dumps(identity, indent=2) + "\n")
                recorded = _write_digests(tmp)
                os.replace(tmp / "meta.json.part", tmp / "meta.json")  # the entry is complete when meta.json exists
                os.rename(tmp, folder)
                for name, want in recorded.items():  # hashed as written: no reader needs to hash them again
                    _remember(folder, folder / name, want["sha256"])
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


def _remembered_error(error: Path) -> str:
    """The one line a failed build left, safe to print; "" when there is none (or it is no such line: built again)."""
    try:
        if not error.is_file() or error.is_symlink():
            return ""
        with open(error, "rb") as f:
            raw = f.read(META_LIMIT)
    except OSError:
        return ""
    return printable(raw.decode("utf-8", errors="replace").strip(), limit=2000)


def _files(folder: Path) -> list[str]:
    """The entry's files, relative and sorted (a build may write sub-folders)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _write_digests(tmp: Path) -> dict:
    """digests.json: each file's size and SHA-256 (meta.json under its final name), written before the entry commits."""
    files = {}
    for name in _files(tmp):
        f = tmp / name
        files[name.removesuffix(".part") if name == "meta.json.part" else name] = {
            "size": f.stat().st_size,
            "sha256": _sha256(f),
        }
    (tmp / DIGESTS).write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")
    return files


def _mark(f: Path, digest) -> tuple:
    """A file's identity on disk with the digest it was checked against."""
    st = f.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)


def _stamp(folder: Path, mark: tuple) -> Path:
    return folder / ".verified" / hashlib.sha256(repr(mark).encode()).hexdigest()[:32]


def _remember(folder: Path, f: Path, digest: str) -> None:
    """Note that ``f`` holds ``digest`` as it is on disk now, for this process and the next (beside the entry)."""
    with contextlib.suppress(OSError):  # a read-only cache: checked again next time
        mark = _mark(f, digest)
        _verified.add(mark)
        _stamp(folder, mark).parent.mkdir(exist_ok=True)
        _stamp(folder, mark).touch()


def _intact(folder: Path) -> bool:
    """Does every file the entry was built with hold what it held then? A file's check is remembered, for this process
    and beside the entry, per its identity on disk: a later write changes the identity (its change time cannot be set
    back), so a large entry is hashed once, not by every rank of every launch."""
    try:
        raw = (folder / DIGESTS).read_bytes() if (folder / DIGESTS).stat().st_size <= META_LIMIT else b""
        recorded = json.loads(raw)
        if not isinstance(recorded, dict) or "meta.json" not in recorded:
            return False
        for name, want in recorded.items():
            f = folder / name
            if not isinstance(want, dict) or ".." in Path(name).parts or f.is_symlink() or not f.is_file():
                return False
            if f.stat().st_size != want.get("size"):
                return False
            mark = _mark(f, want.get("sha256"))
            if mark in _verified or _stamp(folder, mark).is_file():
                continue
            if _sha256(f) != want.get("sha256"):
                return False
            _remember(folder, f, want["sha256"])
    except (OSError, ValueError, RecursionError):  # digests.json gone, torn or not JSON
        return False
    return True


def write_meta(tmp: Path, meta: dict) -> None:
    """What ``build`` writes last: meta.json (as meta.json.part; ``entry`` commits it)."""
    (tmp / "meta.json.part").write_text(json.dumps(meta, indent=2) + "\n")


def write_atomic(path: Path, text: str) -> None:
    part = path.with_name(f"{path.name}.part-{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)


def read_meta(folder: Path) -> dict:
    """The entry's meta.json; SeqparError with one line for one that is not what a build wrote (changed since the entry
    was checked)."""
    f = folder / "meta.json"
    try:
        data = json.loads(f.read_bytes()[: META_LIMIT + 1]) if f.stat().st_size <= META_LIMIT else None
    except (OSError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise SeqparError(
            f"the data cache entry {printable(str(folder))!r} is damaged (its meta.json is not what seqpar wrote); remove "
            "the folder and run again, which builds it anew"
        )
    return data
