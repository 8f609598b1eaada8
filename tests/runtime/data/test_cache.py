"""The tokenized-data cache is keyed by the data's content and checks its own files: a data file edited in place (same
size, its modification time set back) is tokenized again, never read from the stale entry; a moved or touched file finds
its entry; an entry whose files were truncated, overwritten, removed or replaced by a link is built again, never read
(np.load's traceback, or the old tokens at the same size); what the cache remembers is printed as one line.

Reference: the ids the word-level tokenizer gives each word (w<i> is id i + 5, </s> is 1), and the first build's arrays.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from seqpar.plan.errors import SeqparError
from seqpar.runtime.data import cache as data_cache

from seqpar_testing.data import make_tokenizer, write_corpus

EOS = 1


def _open(path, tok, cache, seq_len=64):
    from seqpar.runtime.data.windows import DataOptions, open_training_data

    return open_training_data(str(path), DataOptions(cache=str(cache)), seq_len=seq_len, vocab_size=256, tokenizer_path=tok)


def _ids(words: str) -> list[int]:
    return [int(w[1:]) + 5 for w in words.split()] + [EOS]


def test_a_file_edited_in_place_is_tokenized_again(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "w1 w2 w3"}\n')
    first = _open(data, tok, tmp_path / "cache", seq_len=4)
    assert list(first.corpus.tokens) == _ids("w1 w2 w3")
    st = data.stat()
    data.write_text('{"text": "w7 w8 w9"}\n')  # the same size, and its time set back: only the bytes differ
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    again = _open(data, tok, tmp_path / "cache", seq_len=4)
    assert "tokenized into the cache" in again.note and again.corpus.folder != first.corpus.folder
    assert list(again.corpus.tokens) == _ids("w7 w8 w9")


def test_a_moved_or_touched_file_finds_its_entry(tmp_path, monkeypatch):
    from seqpar.runtime.data import text as data_tokenize

    tok = make_tokenizer(tmp_path / "tok")
    data = write_corpus(tmp_path / "d.jsonl")
    first = _open(data, tok, tmp_path / "cache")

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_tokenize, "build", refuse)
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(data, moved)
    os.utime(moved, ns=(1, 1))
    again = _open(moved, tok, tmp_path / "cache")
    assert "read from the cache" in again.note and again.corpus.folder == first.corpus.folder


def _damage_tokens_same_size(folder):
    f = folder / "tokens.npy"
    raw = bytearray(f.read_bytes())
    raw[-8:] = bytes(8)  # the last two int32 ids made 0: the file still loads, with other tokens
    f.write_bytes(bytes(raw))


def _link_tokens(folder):
    f = folder / "tokens.npy"
    copy = folder.parent / "elsewhere.npy"
    shutil.copy(f, copy)
    f.unlink()
    f.symlink_to(copy)


DAMAGE = {
    "tokens truncated": lambda d: os.truncate(d / "tokens.npy", 100),
    "tokens overwritten at the same size": _damage_tokens_same_size,
    "offsets emptied": lambda d: (d / "offsets.npy").write_bytes(b""),
    "meta.json not JSON": lambda d: (d / "meta.json").write_text("{not json"),
    "meta.json a list": lambda d: (d / "meta.json").write_text("[]"),
    "digests.json torn": lambda d: (d / "digests.json").write_text('{"meta.json": '),
    "digests.json gone": lambda d: (d / "digests.json").unlink(),
    "lines removed": lambda d: (d / "lines.npy").unlink(),
    "tokens a link": _link_tokens,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_built_again(tmp_path, damage):
    tok = make_tokenizer(tmp_path / "tok")
    data = write_corpus(tmp_path / "d.jsonl")
    first = _open(data, tok, tmp_path / "cache")
    want = {k: np.array(getattr(first.corpus, k)) for k in ("tokens", "offsets", "lines")}
    folder = first.corpus.folder
    del first
    DAMAGE[damage](folder)
    data_cache._verified.clear()  # a new process: only what is on disk is known
    again = _open(data, tok, tmp_path / "cache")
    assert "tokenized into the cache" in again.note and again.corpus.folder == folder
    for k, v in want.items():
        np.testing.assert_array_equal(getattr(again.corpus, k), v)
    assert not (folder / "tokens.npy").is_symlink()


def test_an_intact_entry_is_hashed_once(tmp_path, monkeypatch):
    tok = make_tokenizer(tmp_path / "tok")
    data = write_corpus(tmp_path / "d.jsonl")
    _open(data, tok, tmp_path / "cache")
    data_cache._verified.clear()

    def refuse(path):
        raise AssertionError(f"hashed again: {path}")

    monkeypatch.setattr(data_cache, "_sha256", refuse)  # the build's digests were remembered beside the entry
    assert "read from the cache" in _open(data, tok, tmp_path / "cache").note


def test_a_remembered_error_is_printed_as_one_line(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "w1"}\n{"text": 5}\n')
    with pytest.raises(SeqparError, match="line 2"):
        _open(data, tok, tmp_path / "cache")
    (error,) = (tmp_path / "cache").glob("*.error")
    error.write_text("forged\nsecond line \x1b[2J\u202e\n" + "x" * 100_000)  # a line break, ESC and bidi, far too long
    with pytest.raises(SeqparError) as got:
        _open(data, tok, tmp_path / "cache")
    msg = str(got.value)
    assert msg.startswith("forged\\x0asecond line \\x1b[2J\\u202e") and len(msg) < 2100
    assert "\n" not in msg and "\x1b" not in msg and "\u202e" not in msg


def test_a_linked_lock_is_refused_and_not_followed(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    data = write_corpus(tmp_path / "d.jsonl")
    folder = _open(data, tok, tmp_path / "cache").corpus.folder
    lock = folder.with_name(folder.name + ".lock")
    lock.unlink()
    target = tmp_path / "not-to-be-created"
    lock.symlink_to(target)
    (folder / "meta.json").write_text("{}")  # damaged: the lock is taken to build it again
    data_cache._verified.clear()
    with pytest.raises(SeqparError, match="is a symbolic link, which seqpar never follows"):
        _open(data, tok, tmp_path / "cache")
    assert not target.exists()


def test_a_read_meta_of_a_damaged_entry_is_one_line(tmp_path):
    (tmp_path / "meta.json").write_text('{"documents": ' + "[" * 5000)
    with pytest.raises(SeqparError, match="is damaged .* remove the folder and run again"):
        data_cache.read_meta(tmp_path)


def test_a_datasets_folder_with_a_forged_state_json_still_has_an_identity(tmp_path):
    (tmp_path / "train").mkdir()
    for state in ("[1, 2]", "{not json", json.dumps({"_fingerprint": ["x"]}), "9" * 5000):
        (tmp_path / "train" / "state.json").write_text(state)
        ident = data_cache.source_identity(tmp_path)
        assert ident["path"] == str(tmp_path.resolve()) and "state.json" in ident["fingerprint"]
