"""``--data`` from someone else: every hostile file is one line (exit 2), at once, and runs nothing.

Forged here: a FIFO or a device where the data should be (it would block or never end), ``.npy`` headers a colleague
could write by hand (a pickled object array whose ``__reduce__`` would create a marker file, a header of 4 GiB, a
5001-digit or nested-beyond-reason shape, Python where numpy expects a literal, shapes and dtypes that do not fit the
file), JSONL rows numpy and Python's json would turn into tracebacks (a 5001-digit integer, nesting past the parser's
depth, a lone surrogate escape), a config.json whose eos_token_id is no token id, a cached packing forged in the
cache, and a data file edited in place between a run and its ``--resume`` with its size and time kept.
"""

from __future__ import annotations

import json
import os
import signal
import struct
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from seqpar.plan.errors import SeqparError
from seqpar.runtime.data.source import read_corpus

from seqpar_testing import run_ranks
from seqpar_testing.cli import one_error_line, run
from seqpar_testing.data import make_tokenizer, write_corpus
from seqpar_testing.hostile import Marker, one_line
from seqpar_testing.train import make_plan

VOCAB = 256


@contextmanager
def within(seconds: float):
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``."""

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _read(path, tmp_path, tokenizer=None):
    return read_corpus(str(path), vocab_size=VOCAB, tokenizer_path=tokenizer, cache_dir=str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------- FIFOs and devices


@pytest.mark.parametrize("suffix", [".jsonl", ".npy", ".bin"])
def test_a_fifo_as_data_is_refused_at_once(tmp_path, suffix):
    fifo = tmp_path / f"data{suffix}"
    os.mkfifo(fifo)
    with within(10), pytest.raises(SeqparError) as e:
        _read(fifo, tmp_path, make_tokenizer(tmp_path / "tok"))
    assert "is a FIFO, not a regular file" in one_line(e)


def test_a_device_behind_a_data_name_is_refused_at_once(tmp_path):
    link = tmp_path / "tokens.bin"
    link.symlink_to("/dev/zero")  # an endless file: the check of every id would never end
    with within(10), pytest.raises(SeqparError) as e:
        _read(link, tmp_path)
    assert "is a device, not a regular file" in one_line(e)


def test_seqpar_launch_refuses_a_fifo_as_data_before_any_rank(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(1, steps=2).write(plan)
    fifo = tmp_path / "docs.jsonl"
    os.mkfifo(fifo)
    with within(60):
        r = run("launch", plan, "--data", fifo, "--output", tmp_path / "run", "--force")
    assert r.exit_code == 2, r.output
    assert "is a FIFO" in one_error_line(r)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------- .npy headers


def _npy(header: bytes, body: bytes = b"\0" * 64, version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy file with ``header`` as its header text, as numpy.lib.format lays it out."""
    size = struct.pack("<H" if version == (1, 0) else "<I", len(header))
    return b"\x93NUMPY" + bytes(version) + size + header + body


def _hostile_npy(kind: str, path: Path, marker: Path) -> None:
    good = "{'descr': '<u2', 'fortran_order': False, 'shape': (32,), }"
    if kind == "pickled-objects":
        np.save(path, np.array([Marker(marker), 1], dtype=object), allow_pickle=True)
        return
    text = {
        "python-call": f"__import__('pathlib').Path({str(marker)!r}).touch()",
        "5001-digit-shape": good.replace("(32,)", "(" + "9" * 5001 + ",)"),
        "nested-shape": good.replace("(32,)", "(" * 5000 + "32" + ")" * 5000),
        "negative-shape": good.replace("(32,)", "(-32,)"),
        "shape-past-the-file": good.replace("(32,)", f"({2**40},)"),
        "float-shape": good.replace("(32,)", "(3.5,)"),
        "garbage-descr": good.replace("'<u2'", "'<q9'"),
        "descr-a-dict": good.replace("'<u2'", "{'names': ['a'], 'formats': ['O']}"),
        "structured": good.replace("'<u2'", "[('a', '<u2')]"),
        "floats": good.replace("'<u2'", "'<f4'"),
        "fortran-order-a-string": good.replace("False", "'yes'"),
        "not-a-dict": "[1, 2, 3]",
        "missing-keys": "{'descr': '<u2'}",
    }.get(kind)
    if kind == "header-4gib":
        path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**32 - 1) + b"{" * 4096)
    elif kind == "bad-magic":
        path.write_bytes(b"\x93NUMPX\x01\x00" + b"\0" * 64)
    elif kind == "truncated":
        path.write_bytes(_npy(good.encode())[:12])
    else:
        path.write_bytes(_npy(text.encode()))


NPY = [
    "pickled-objects",
    "python-call",
    "5001-digit-shape",
    "nested-shape",
    "negative-shape",
    "shape-past-the-file",
    "float-shape",
    "garbage-descr",
    "descr-a-dict",
    "structured",
    "floats",
    "fortran-order-a-string",
    "not-a-dict",
    "missing-keys",
    "header-4gib",
    "bad-magic",
    "truncated",
]


@pytest.mark.parametrize("kind", NPY)
def test_a_hostile_npy_header_is_one_line_and_runs_nothing(tmp_path, kind):
    path, marker = tmp_path / "tokens.npy", tmp_path / "ran"
    _hostile_npy(kind, path, marker)
    with within(20), pytest.raises(SeqparError) as e:
        _read(path, tmp_path)
    assert "tokens.npy" in one_line(e)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------- JSONL rows


JSONL = {
    "5001-digit-integer": '{"text": "w1 w2", "n": ' + "7" * 5001 + "}",
    "nested-past-the-parser": '{"text": "w1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "lone-surrogate-in-text": '{"text": "w1 \\ud800 w2"}',
    "lone-surrogate-in-a-chat": '{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "\\udc00"}]}',
    "lone-surrogate-in-a-key": '{"text": "w1", "\\udfff": 1}',
}


@pytest.mark.parametrize("kind", list(JSONL))
def test_a_hostile_jsonl_row_is_one_line_naming_it(tmp_path, kind):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "w1 w2 w3"}\n' + JSONL[kind] + "\n")
    with within(60), pytest.raises(SeqparError) as e:
        _read(path, tmp_path, make_tokenizer(tmp_path / "tok"))
    assert "docs.jsonl" in (line := one_line(e)) and "line 2" in line, line


def test_seqpar_launch_refuses_a_5001_digit_integer_in_the_data_withone_line(tmp_path):
    plan = tmp_path / "plan.json"
    make_plan(1, steps=2).write(plan)
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "w1 w2 w3"}\n' + JSONL["5001-digit-integer"] + "\n")
    tok = make_tokenizer(tmp_path / "tok")
    out = tmp_path / "run"
    r = run("launch", plan, "--data", path, "--tokenizer", tok, "--output", out, "--force", "--data-cache", tmp_path / "c")
    assert r.exit_code == 2, r.output
    assert "line 2 is not JSON" in one_error_line(r)


@pytest.mark.parametrize("eos", ["7" * 5001, '"</s>"', "[-1]", "[]", "1.5", '{"a": 1}'])
def test_a_config_whose_eos_token_id_is_no_token_id_isone_line(tmp_path, eos):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "eos_token_id": ' + eos + "}")
    np.save(tmp_path / "tokens.npy", np.arange(64, dtype=np.uint16))
    with pytest.raises(SeqparError) as e:
        _read(tmp_path / "tokens.npy", tmp_path, str(folder))
    assert "config.json" in one_line(e)


# --------------------------------------------------------------------------------------------- the cache and resume


def test_a_forged_cached_packing_is_packed_again_unread(tmp_path):
    """The packing cached beside the tokens is data too: a pickle in it, or pieces outside the corpus, are not read."""
    from seqpar.runtime.data import pack
    from seqpar.runtime.data.windows import PackedData

    corpus = _read(write_corpus(tmp_path / "docs.jsonl"), tmp_path, make_tokenizer(tmp_path / "tok"))
    want = PackedData(corpus, 64).window(0)
    cached = next(Path(corpus.folder).glob("pack-*.npz"))
    marker = tmp_path / "unpickled"
    good = dict(np.load(cached))
    forgeries = {
        "pickle": lambda: np.savez(cached, **good | {"kept": np.array([Marker(marker)], dtype=object)}),
        "outside-the-corpus": lambda: np.savez(cached, **good | {"start": good["start"] + 10**9}),
        "overfull-window": lambda: np.savez(cached, **good | {"length": good["length"] * 0 + 64}),
        "garbage": lambda: cached.write_bytes(b"PK\x03\x04garbage"),
    }
    for name, forge in forgeries.items():
        forge()
        pack.pack.__globals__["_permutation"].cache_clear()
        got = PackedData(corpus, 64).window(0)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=name)
    assert not marker.exists()


def _edit_in_place(path: Path, ids: np.ndarray) -> None:
    """New ids of the same size into the same file, its access and modification times put back (touch -r)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(ids.tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_data_file_edited_in_place_is_read_again_not_from_a_stale_cache(tmp_path):
    path = tmp_path / "tokens.bin"
    rng = np.random.default_rng(0)
    first = rng.integers(0, VOCAB, 4096).astype(np.uint16)
    first.tofile(path)
    a = _read(path, tmp_path)
    edited = (first + 1) % VOCAB
    _edit_in_place(path, edited)
    b = _read(path, tmp_path)
    np.testing.assert_array_equal(np.asarray(b.tokens), edited)
    assert a.digest != b.digest and len(b.digest) == 64


def _train_then_resume_on_edited_data(rank, world, tmp):
    from seqpar.runtime.train.loop import parser, run

    tmp = Path(tmp)
    plan_file, data, out = tmp / "plan.json", tmp / "tokens.bin", tmp / "run"
    argv = ["--plan", str(plan_file), "--output", str(out), "--data", str(data), "--data-cache", str(tmp / "cache")]
    run(parser().parse_args(argv + ["--steps", "2"]))
    _edit_in_place(data, (np.fromfile(data, dtype=np.uint16) + 1) % VOCAB)
    try:
        run(parser().parse_args(argv + ["--steps", "3", "--resume"]))
    except SeqparError as e:
        return str(e)
    return None


def test_resuming_on_a_data_file_edited_in_place_is_refused(tmp_path):
    """The run records the data's SHA-256 with its checkpoint; the edit keeps the size, the time and the windows, and
    --resume refuses it with one line instead of training on other data as if it were the same."""
    make_plan(1, steps=3).write(tmp_path / "plan.json")
    np.random.default_rng(0).integers(0, VOCAB, 4096).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    (message,) = run_ranks(_train_then_resume_on_edited_data, 1, str(tmp_path), timeout=120)
    assert message is not None and "data sha256" in message and "\n" not in message, message
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert len(state["run"]["data sha256"]) == 64


def test_the_digest_is_remembered_not_recomputed_per_reader(tmp_path):
    """The launcher and every rank read the same file: it is hashed once per file identity (path, inode, size, mtime,
    ctime), the memo kept in the user's own cache folder as the tokenized entries are; an edit is a new identity."""
    import hashlib

    from seqpar.runtime.data import source

    path = tmp_path / "tokens.bin"
    np.arange(4096, dtype=np.uint16).tofile(path)
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert source.content_digest(path, tmp_path / "cache") == want
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    assert memo.read_text() == want
    memo.write_text("0" * 64)  # what a second reader finds: read, not recomputed
    assert source.content_digest(path, tmp_path / "cache") == "0" * 64
    _edit_in_place(path, np.arange(4096, dtype=np.uint16)[::-1].copy())  # ctime moves: another identity, hashed
    assert source.content_digest(path, tmp_path / "cache") == hashlib.sha256(path.read_bytes()).hexdigest() != want
