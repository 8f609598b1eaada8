"""A data source (``--data``) read into a ``Corpus``: documents as token ids, which tokens are scored, checked once.

- ``.jsonl``: text and chat rows, tokenized with `datasets` into the cache (seqpar.runtime.data.text).
- a `datasets` ``save_to_disk`` folder: a ``text`` or ``messages`` column, tokenized the same way, or an ``input_ids``
  column (one document per row, ids as they are).
- ``.bin`` (uint16 when the vocabulary fits in 16 bits, else uint32: nanoGPT's format) / ``.npy`` (unsigned or signed
  integers): a token stream read in place (memory-mapped). A document ends after each EOS token (the model's
  ``eos_token_id`` in ``--model-path``'s config.json, else its tokenizer's); with no EOS id known the file is one
  stream. The first read checks every id (negative, or outside the model's vocabulary: one line naming the index)
  and caches the boundaries and the check, so later reads are instant.

Every problem is one line (SeqparError) naming the file, the value, the rule and a fix.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqpar.plan.errors import SeqparError
from seqpar.runtime.data import cache as data_cache
from seqpar.runtime.data import text as data_tokenize

CHUNK = 1 << 24  # tokens per pass over a memory-mapped file: bounded temporaries whatever the file's size


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
    spec: str, *, vocab_size: int, tokenizer_path: str | None, cache_dir: str | None = None, procs: int | None = None
) -> Corpus:
    """The documents of ``spec`` (not 'synthetic'); SeqparError with one line if they cannot be read."""
    p = Path(spec)
    if not p.exists():
        raise SeqparError(
            f"data path {spec!r} does not exist; pass --data synthetic, a .jsonl/.bin/.npy file or a datasets folder"
        )
    root = Path(cache_dir) if cache_dir else data_cache.default_root()
    suffix = p.suffix.lower()
    if p.is_dir():
        corpus = _folder(spec, p, root, tokenizer_path, procs, vocab_size)
    elif suffix in (".bin", ".npy"):
        corpus = _token_file(spec, p, root, tokenizer_path, vocab_size)
    elif suffix in (".jsonl", ".json"):
        data_tokenize.require_datasets(f"data file {spec!r}")
        tok = data_tokenize.load_tokenizer(tokenizer_path, f"data file {spec!r}")
        identity = {"source": data_cache.source_identity(p), "tokenizer": data_cache.tokenizer_identity(tok), "kind": "rows"}
        folder, built = data_cache.entry(
            root, identity, lambda tmp: data_tokenize.build(tmp, source=p, tok=tok, procs=procs, where=f"data file {spec!r}")
        )
        corpus = _load(spec, folder, built, _pad(tok))
    else:
        raise SeqparError(
            f"data file {spec!r} has an unknown type {suffix!r}; use .jsonl (text or chats), .bin/.npy (token ids) or synthetic"
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


def _pad(tok) -> int:
    for x in (tok.pad_token_id, tok.eos_token_id):
        if x is not None:
            return int(x)
    return 0


def _load(spec: str, folder: Path, built: bool, pad_id: int, tokens: np.ndarray | None = None) -> Corpus:
    meta = data_cache.read_meta(folder)
    has = {n: (folder / f"{n}.npy").is_file() for n in ("scored", "lines")}
    what = f"{meta['documents']:,} documents, {meta['tokens']:,} tokens"
    if meta.get("kind") == "chat":
        how = "{% generation %} marks" if meta.get("mask") == "generation" else "rendering prefixes"
        what += f", chats: the assistant's tokens scored (found by {how})"
    return Corpus(
        name=spec,
        tokens=tokens if tokens is not None else np.load(folder / "tokens.npy", mmap_mode="r"),
        offsets=np.load(folder / "offsets.npy"),
        scored=np.load(folder / "scored.npy", mmap_mode="r") if has["scored"] else None,
        lines=np.load(folder / "lines.npy") if has["lines"] else None,
        folder=folder,
        pad_id=pad_id,
        note=f"data {spec!r}: {what}; {_how(meta['kind']) if built else 'read from'} the cache {str(folder)!r}",
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
    try:
        arr = np.load(p, mmap_mode="r")
    except (ValueError, OSError, EOFError, pickle.UnpicklingError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SeqparError(f"data file {spec!r} is not a readable .npy file ({first}); write it with numpy.save") from None
    if arr.dtype.kind not in "ui":
        raise SeqparError(f"data file {spec!r} holds {arr.dtype} values; token files must be uint16/uint32 (or int)")
    if arr.size == 0:
        raise SeqparError(f"data file {spec!r} holds no tokens (shape {arr.shape}); pass a file of token ids")
    return arr.reshape(-1)


def _eos_ids(tokenizer_path: str | None) -> list[int]:
    """The model's EOS id(s): config.json's eos_token_id (an int or a list), else the tokenizer's; [] when unknown."""
    if not tokenizer_path:
        return []
    cfg = Path(tokenizer_path) / "config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text()).get("eos_token_id")
        if eos is not None:
            return sorted({int(x) for x in (eos if isinstance(eos, list) else [eos])})
    try:
        tok = data_tokenize.load_tokenizer(tokenizer_path, "token data")
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


def _token_file(spec: str, p: Path, root: Path, tokenizer_path: str | None, vocab_size: int) -> Corpus:
    tokens = _open_tokens(spec, p, vocab_size)
    eos = _eos_ids(tokenizer_path)
    # the vocabulary is in the key: the check (and a .bin's dtype) depends on it
    identity = {"source": data_cache.source_identity(p), "eos": eos, "vocab": vocab_size, "kind": "tokens"}
    folder, built = data_cache.entry(root, identity, lambda tmp: _check_and_split(tmp, spec, tokens, vocab_size, eos))
    corpus = _load(spec, folder, built, eos[0] if eos else 0, tokens=tokens)
    if not eos:
        corpus.note += "; no EOS id known (pass --model-path): the file is one stream of documents"
    return corpus


# --------------------------------------------------------------------------------------------- datasets folders


def _folder(spec: str, p: Path, root: Path, tokenizer_path: str | None, procs: int | None, vocab_size: int) -> Corpus:
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
    identity = {"source": data_cache.source_identity(p)}
    if "input_ids" in ds.column_names:
        ids = ds.select_columns(["input_ids"]).add_column("line", rows)
        folder, built = data_cache.entry(
            root, identity | {"kind": "ids"}, lambda tmp: _ids(tmp, ids) if len(ids) else _empty(where)
        )
        return _load(spec, folder, built, 0)
    have = [c for c in ("text", "messages") if c in ds.column_names]
    if not have:
        raise SeqparError(f"{where} has none of the columns input_ids, text, messages (it has {ds.column_names})")
    tok = data_tokenize.load_tokenizer(tokenizer_path, where)
    view = ds.select_columns(have)
    for c in ("text", "messages"):
        if c not in have:
            view = view.add_column(c, [None] * len(view))
    view = view.add_column("line", rows)
    identity |= {"tokenizer": data_cache.tokenizer_identity(tok), "kind": "rows"}
    folder, built = data_cache.entry(
        root, identity, lambda tmp: data_tokenize.build(tmp, source=view, tok=tok, procs=procs, where=where, unit="row")
    )
    return _load(spec, folder, built, _pad(tok))


def _ids(tmp: Path, ds) -> None:
    meta = data_tokenize.write_arrays(tmp, ds, False, 2**32)  # uint32: the ids are checked against a vocabulary later
    data_cache.write_meta(tmp, meta | {"kind": "ids"})


def _empty(where: str):
    raise SeqparError(f"{where} holds no rows; pass a dataset with at least one document")
