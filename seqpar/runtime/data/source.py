"""A data source (``--data``) read into a ``Corpus``: documents as token ids, which tokens are scored, checked once.

- ``.jsonl``: text and chat rows, tokenized with `datasets` into the cache (seqpar.runtime.data.text).
- a `datasets` ``save_to_disk`` folder: a ``text`` or ``messages`` column, tokenized the same way, or an ``input_ids``
  column (one document per row, ids as they are).
- ``.bin`` (uint16 when the vocabulary fits in 16 bits, else uint32: nanoGPT's format) / ``.npy`` (unsigned or signed
  integers): a token stream read in place (memory-mapped). A document ends after each EOS token (the model's
  ``eos_token_id`` in ``--model-path``'s config.json, else its tokenizer's); with no EOS id known the file is one
  stream. The first read checks every id (negative, or outside the model's vocabulary: one line naming the index)
  and caches the boundaries and the check, so later reads are instant.

Every problem is one line (SeqparError) naming the file, the value, the rule and a fix. A data file is data from
anyone: a FIFO or device is refused before it is opened (it would block or never end), a ``.npy`` header is read with
pickles refused and its size bounded, and the file's content digest (``content_digest``: SHA-256, remembered per
file identity beside the cache) keys the cache and is recorded with the run, so a file edited in place is neither
read from a stale cache nor resumed as if it were the data the checkpoint trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import printable
from seqpar.runtime.data import cache as data_cache
from seqpar.runtime.data import text as data_tokenize
from seqpar.runtime.data.hf_folder import read_config, refuse_remote_code

CHUNK = 1 << 24  # tokens per pass over a memory-mapped file: bounded temporaries whatever the file's size
NPY_HEADER_LIMIT = 10_000  # bytes of a .npy header (numpy's own default bound; a real one is under 200)
# what np.load raises for a file that is no .npy it can read: a bad magic or header, a pickle refused, a header
# literal Python will not evaluate (too deep, a 5000-digit number), a shape or dtype that cannot be mapped
NPY_ERRORS = (ValueError, OSError, EOFError, TypeError, OverflowError, SyntaxError, RecursionError, pickle.UnpicklingError)


@dataclass
class Corpus:
    name: str  # the --data value
    tokens: np.ndarray  # (N,) token ids, memory-mapped
    offsets: np.ndarray  # (n + 1,) int64: document i is tokens[offsets[i]:offsets[i+1]]
    scored: np.ndarray | None  # (N,) uint8, 1 = a training target (chats: the assistant's tokens); None = all
    lines: np.ndarray | None  # (n,) the JSONL line / row of each document (errors name it); None for token files
    folder: Path  # its cache entry (packings into windows are cached there too)
    pad_id: int  # the filler token of a window's unused tail (never scored, attends only to itself)
    note: str  # one line: what it holds and where it came from
    digest: str = ""  # SHA-256 of the source's content (content_digest): what a checkpoint records

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def where(self, doc: int) -> str:
        """How an error names document ``doc``."""
        if self.lines is None:
            return f"data file {self.name!r} document {doc} (tokens {int(self.offsets[doc])}..{int(self.offsets[doc + 1])})"
        unit = "row" if Path(self.name).is_dir() else "line"
        return f"data {'folder' if unit == 'row' else 'file'} {self.name!r} {unit} {int(self.lines[doc])}"


def read_corpus(
    spec: str,
    *,
    vocab_size: int,
    tokenizer_path: str | None,
    cache_dir: str | None = None,
    procs: int | None = None,
    trust_remote_code: bool = False,
) -> Corpus:
    """The documents of ``spec`` (not 'synthetic'); SeqparError with one line if they cannot be read.
    ``trust_remote_code``: a tokenizer folder may run the code it ships (--trust-remote-code)."""
    p = Path(spec)
    kind = _kind(p, spec)
    root = Path(cache_dir) if cache_dir else data_cache.default_root()
    suffix = p.suffix.lower()
    # the content digest is taken once the path is known to be data seqpar reads (never of any folder or file given)
    if kind == "folder":
        corpus = _folder(spec, p, root, tokenizer_path, procs, vocab_size, trust_remote_code)
    elif suffix in (".bin", ".npy"):
        corpus = _token_file(spec, p, root, tokenizer_path, vocab_size, trust_remote_code)
    elif suffix in (".jsonl", ".json"):
        data_tokenize.require_datasets(f"data file {spec!r}")
        tok = data_tokenize.load_tokenizer(tokenizer_path, f"data file {spec!r}", trust_remote_code=trust_remote_code)
        digest = content_digest(p, root)
        identity = {
            "source": data_cache.source_identity(p) | {"sha256": digest},
            "tokenizer": data_cache.tokenizer_identity(tok),
            "kind": "rows",
        }
        folder, built = data_cache.entry(
            root, identity, lambda tmp: data_tokenize.build(tmp, source=p, tok=tok, procs=procs, where=f"data file {spec!r}")
        )
        corpus = _load(spec, folder, built, _pad(tok), digest=digest)
    else:
        raise SeqparError(
            f"data file {spec!r} has an unknown type {printable(suffix)!r}; use .jsonl (text or chats), .bin/.npy (token "
            "ids) or synthetic"
        )
    meta = data_cache.read_meta(corpus.folder)
    low, top = meta.get("min_token_id", 0), meta.get("max_token_id", -1)
    if low < 0:
        raise SeqparError(f"data {spec!r} holds token id {low}, negative; token ids are 0 .. vocabulary - 1")
    if top >= vocab_size:
        raise SeqparError(
            f"data {spec!r} holds token id {top}, outside the model's vocabulary of {vocab_size}; tokenize with the model's "
            f"tokenizer (or pass the --model-path whose vocabulary it was made for)"
        )
    return corpus


def _kind(p: Path, spec: str) -> str:
    """'file' or 'folder'; SeqparError at once for a path that is neither (a FIFO would block the first read, a device
    never end) or does not exist."""
    try:
        mode = p.stat().st_mode  # a link is followed: what it points at is what would be read
    except FileNotFoundError:
        raise SeqparError(
            f"data path {spec!r} does not exist; pass --data synthetic, a .jsonl/.bin/.npy file or a datasets folder"
        ) from None
    except OSError as e:
        raise SeqparError(f"data path {spec!r} cannot be read ({e.strerror}); pass a file or folder you can read") from None
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        return "file"
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise SeqparError(
        f"data path {spec!r} is {what}, not a regular file; seqpar reads the data more than once (the launcher, then "
        "every rank), so pass a file or a datasets folder"
    )


def _file_identity(p: Path) -> dict:
    """What changes whenever a file's bytes may have: ctime moves on every write and cannot be set back (touch -d sets
    only mtime), so an edit in place that keeps the size and the time is still seen."""
    st = p.stat()
    return {"path": str(p.resolve()), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}  # fmt: skip


def _file_sha256(p: Path, root: Path) -> str:
    """SHA-256 of a file's bytes, remembered under the cache root per file identity (``_file_identity``): the launcher
    and every rank read the same data, and a large file is read through once."""
    ident = _file_identity(p)
    memo = root / "digests" / (hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32] + ".txt")
    try:
        known = memo.read_text()[:64] if memo.is_file() and memo.stat().st_size == 64 else ""
    except OSError:
        known = ""
    if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
        return known
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    if _file_identity(p) != ident:  # written while read: remember nothing; the next reader sees another identity
        return digest
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        part = memo.with_name(f"{memo.name}.part-{os.getpid()}")
        part.write_text(digest)
        os.replace(part, memo)
    except OSError:  # a read-only cache: the digest is computed again next time
        pass
    return digest


def content_digest(p: Path, root: Path) -> str:
    """SHA-256 of a data file's content; of a folder, of its files' relative names and digests (links not followed)."""
    if not p.is_dir():
        return _file_sha256(p, root)
    h = hashlib.sha256()
    for here, dirs, files in os.walk(p, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            f = Path(here, name)
            if f.is_file() and not f.is_symlink():
                h.update(f"{f.relative_to(p).as_posix()}\0{_file_sha256(f, root)}\n".encode())
    return h.hexdigest()


def _pad(tok) -> int:
    for x in (tok.pad_token_id, tok.eos_token_id):
        if x is not None:
            return int(x)
    return 0


def _load(spec: str, folder: Path, built: bool, pad_id: int, tokens: np.ndarray | None = None, *, digest: str) -> Corpus:
    meta = data_cache.read_meta(folder)
    has = {n: (folder / f"{n}.npy").is_file() for n in ("scored", "lines")}
    what = f"{meta['documents']:,} documents, {meta['tokens']:,} tokens"
    if meta.get("kind") == "chat":
        how = "{% generation %} marks" if meta.get("mask") == "generation" else "rendering prefixes"
        what += f", chats: the assistant's tokens scored (found by {how})"
    return Corpus(
        name=spec,
        tokens=tokens if tokens is not None else np.load(folder / "tokens.npy", mmap_mode="r", allow_pickle=False),
        offsets=np.load(folder / "offsets.npy", allow_pickle=False),
        scored=np.load(folder / "scored.npy", mmap_mode="r", allow_pickle=False) if has["scored"] else None,
        lines=np.load(folder / "lines.npy", allow_pickle=False) if has["lines"] else None,
        folder=folder,
        pad_id=pad_id,
        note=f"data {spec!r}: {what}; {_how(meta['kind']) if built else 'read from'} the cache {str(folder)!r}",
        digest=digest,
    )


def _how(kind: str) -> str:
    return "tokenized into" if kind in ("text", "chat") else "checked, its document boundaries written into"


# --------------------------------------------------------------------------------------------- token files


def _open_tokens(spec: str, p: Path, vocab_size: int) -> np.ndarray:
    size = p.stat().st_size
    if size == 0:
        raise SeqparError(f"data file {spec!r} is empty (0 bytes); pass a file of token ids (numpy .tofile or numpy.save)")
    if p.suffix.lower() == ".bin":
        dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
        if size % dtype.itemsize:
            raise SeqparError(
                f"data file {spec!r} has {size} bytes, not a whole number of {dtype.name} tokens (vocabulary {vocab_size}); "
                "write it with numpy .tofile in that dtype"
            )
        return np.memmap(p, dtype=dtype, mode="r")
    with open(p, "rb") as f:  # the header's stated length, bounded before numpy reads that many bytes
        start = f.read(12)
    if start[:6] == b"\x93NUMPY" and len(start) >= 10:
        wide = start[6] >= 2  # format 2 and 3 state the header length in 4 bytes
        stated = int.from_bytes(start[8:12] if wide else start[8:10], "little")
        if stated > NPY_HEADER_LIMIT:
            raise SeqparError(
                f"data file {spec!r} is not a readable .npy file (its header states {stated} bytes, more than the "
                f"{NPY_HEADER_LIMIT} a header of token ids needs); write it with numpy.save"
            )
    try:
        # no pickles (an object array would unpickle), and numpy's bound on the header it evaluates
        arr = np.load(p, mmap_mode="r", allow_pickle=False, max_header_size=NPY_HEADER_LIMIT)
    except NPY_ERRORS as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SeqparError(
            f"data file {spec!r} is not a readable .npy file of numbers ({printable(first, 160)}); write it with numpy.save"
        ) from None
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "ui":
        dtype = printable(getattr(arr, "dtype", type(arr).__name__), 80)
        raise SeqparError(f"data file {spec!r} holds {dtype} values; token files must be uint16/uint32 (or int)")
    if arr.size == 0:
        raise SeqparError(f"data file {spec!r} holds no tokens (shape {arr.shape}); pass a file of token ids")
    return arr.reshape(-1)


def _eos_ids(tokenizer_path: str | None, trust_remote_code: bool = False) -> list[int]:
    """The model's EOS id(s): config.json's eos_token_id (an int or a list), else the tokenizer's; [] when unknown."""
    if not tokenizer_path:
        return []
    folder = Path(tokenizer_path)
    cfg = read_config(folder, "config.json", "model config") if folder.is_dir() else None
    eos = cfg.get("eos_token_id") if cfg else None
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(type(x) is int and 0 <= x < 2**32 for x in ids):  # ids, never what int() would make one
            raise SeqparError(
                f"model config {printable(str(folder / 'config.json'))!r} has eos_token_id {printable(eos, 80)}, not a "
                "token id or a list of them; restore the file"
            )
        return sorted(set(ids))
    if folder.is_dir():  # a folder asking for custom code is said so, not read as one without a tokenizer
        refuse_remote_code(folder, "tokenizer folder", trust_remote_code)
    try:
        tok = data_tokenize.load_tokenizer(tokenizer_path, "token data", trust_remote_code=trust_remote_code)
    except SeqparError:
        return []
    return [] if tok.eos_token_id is None else [int(tok.eos_token_id)]


def _check_and_split(tmp: Path, spec: str, tokens: np.ndarray, vocab_size: int, eos: list[int]) -> None:
    """Every id checked (in chunks), document ends after each EOS; offsets.npy and meta.json into the entry."""
    ends, top = [], 0
    for a in range(0, tokens.size, CHUNK):
        x = np.asarray(tokens[a : a + CHUNK])
        top = max(top, int(x.max()))
        bad = (x < 0) | (x >= vocab_size) if x.dtype.kind == "i" else x >= vocab_size
        if bad.any():
            i = int(np.argmax(bad))
            rule = "negative" if x[i] < 0 else f"outside the model's vocabulary of {vocab_size}"
            raise SeqparError(
                f"data file {spec!r} holds token id {int(x[i])} at index {a + i}, {rule}; tokenize with the model's tokenizer"
            )
        if eos:
            ends.append(np.flatnonzero(np.isin(x, eos)) + a + 1)
    cuts = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    offsets = np.unique(np.concatenate([[0], cuts, [tokens.size]]).astype(np.int64))
    np.save(tmp / "offsets.npy", offsets)
    lengths = np.diff(offsets)
    meta = {"documents": len(lengths), "tokens": int(tokens.size), "max_token_id": top, "eos": eos}
    data_cache.write_meta(tmp, meta | {"kind": "tokens", "longest": int(lengths.max())})


def _token_file(spec: str, p: Path, root: Path, tokenizer_path: str | None, vocab_size: int, trust_remote_code: bool) -> Corpus:
    tokens = _open_tokens(spec, p, vocab_size)
    eos = _eos_ids(tokenizer_path, trust_remote_code)
    digest = content_digest(p, root)
    # the vocabulary is in the key: the check (and a .bin's dtype) depends on it
    source = data_cache.source_identity(p) | {"sha256": digest}
    identity = {"source": source, "eos": eos, "vocab": vocab_size, "kind": "tokens"}
    folder, built = data_cache.entry(root, identity, lambda tmp: _check_and_split(tmp, spec, tokens, vocab_size, eos))
    corpus = _load(spec, folder, built, eos[0] if eos else 0, tokens=tokens, digest=digest)
    if not eos:
        corpus.note += "; no EOS id known (pass --model-path): the file is one stream of documents"
    return corpus


# --------------------------------------------------------------------------------------------- datasets folders


def _folder(
    spec: str,
    p: Path,
    root: Path,
    tokenizer_path: str | None,
    procs: int | None,
    vocab_size: int,
    trust_remote_code: bool,
) -> Corpus:
    where = f"data folder {spec!r}"
    if not any((p / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise SeqparError(f"{where} is not a `datasets` save_to_disk folder (no dataset_info.json/state.json)")
    datasets = data_tokenize.require_datasets(where)
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # a folder save_to_disk did not write completely
        raise SeqparError(
            f"{where} is not a readable `datasets` save_to_disk folder ({type(e).__name__}: {e}); write it again with "
            "Dataset.save_to_disk"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    rows = list(range(1, len(ds) + 1))
    digest = content_digest(p, root)
    identity = {"source": data_cache.source_identity(p) | {"sha256": digest}}
    if "input_ids" in ds.column_names:
        ids = ds.select_columns(["input_ids"]).add_column("line", rows)
        folder, built = data_cache.entry(
            root, identity | {"kind": "ids"}, lambda tmp: _ids(tmp, ids) if len(ids) else _empty(where)
        )
        return _load(spec, folder, built, 0, digest=digest)
    have = [c for c in ("text", "messages") if c in ds.column_names]
    if not have:
        raise SeqparError(f"{where} has none of the columns input_ids, text, messages (it has {ds.column_names})")
    tok = data_tokenize.load_tokenizer(tokenizer_path, where, trust_remote_code=trust_remote_code)
    view = ds.select_columns(have)
    for c in ("text", "messages"):
        if c not in have:
            view = view.add_column(c, [None] * len(view))
    view = view.add_column("line", rows)
    identity |= {"tokenizer": data_cache.tokenizer_identity(tok), "kind": "rows"}
    folder, built = data_cache.entry(
        root, identity, lambda tmp: data_tokenize.build(tmp, source=view, tok=tok, procs=procs, where=where, unit="row")
    )
    return _load(spec, folder, built, _pad(tok), digest=digest)


def _ids(tmp: Path, ds) -> None:
    meta = data_tokenize.write_arrays(tmp, ds, False, 2**32)  # uint32: the ids are checked against a vocabulary later
    data_cache.write_meta(tmp, meta | {"kind": "ids"})


def _empty(where: str):
    raise SeqparError(f"{where} holds no rows; pass a dataset with at least one document")
