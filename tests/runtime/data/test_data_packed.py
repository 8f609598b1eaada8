"""The data path on its own (no ranks): documents packed into windows with their boundaries, chats scored on the
assistant's tokens, the tokenized-data cache, the seeded window order, the older stream.

References: the source documents themselves (every token of every document lands in exactly one window, as one
document or, when longer than the window, as window-sized pieces), masks computed by hand from the tokenizer's pieces,
and numpy's seeded permutation. The word-level tokenizer with a chat template and the mixed JSONL corpus come from
seqpar_testing.data.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from seqpar_testing.data import PLAIN, TEMPLATE, make_tokenizer, write_corpus


def _open(path, tok, cache, seq_len=64, **kw):
    from seqpar.runtime.data.windows import DataOptions, open_training_data

    return open_training_data(str(path), DataOptions(cache=str(cache), **kw), seq_len=seq_len, vocab_size=256, tokenizer_path=tok)


def _docs(window: dict) -> list[tuple[int, int]]:
    """(start, end) of each document of a window, from its position ids (restarting at 0)."""
    starts = list(np.flatnonzero(window["position_ids"] == 0)) + [len(window["position_ids"])]
    return list(zip(starts, starts[1:]))


def test_every_document_lands_in_one_window_whole_or_in_pieces(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    data = _open(write_corpus(tmp_path / "d.jsonl"), tok, tmp_path / "cache")
    c = data.corpus
    want = sorted(tuple(c.tokens[a:b]) for a, b in zip(c.offsets[:-1], c.offsets[1:]))
    pieces, filler = [], 0
    assert data.dropped == 0 and data.num_windows == len(data.ptr) - 1
    for i in range(data.num_windows):
        w = data.window(i)
        docs = _docs(w)
        if w["input_ids"][docs[-1][0]] == c.pad_id and (w["labels"][docs[-1][0] :] == -100).all():
            filler += docs[-1][1] - docs[-1][0]
            docs = docs[:-1]
        for a, b in docs:
            pieces.append(tuple(w["input_ids"][a:b]))
            assert w["labels"][a] == -100  # a document's first token: nothing of its own before it predicts it
    # the 151-token document (150 words + EOS) arrives as pieces of 64, 64 and 23 tokens; all others whole
    longest = max(want, key=len)
    assert len(longest) == 151
    rest = list(pieces)
    for piece in (longest[0:64], longest[64:128], longest[128:]):
        rest.remove(piece)  # ValueError if a piece is missing
    assert sorted(rest) == sorted(d for d in want if d != longest)
    assert filler == data.num_windows * 64 - sum(len(d) for d in want)


def test_labels_score_text_and_only_the_assistant_tokens_of_chats_both_template_kinds(tmp_path):
    """Expected ids and mask built by hand from the tokenizer's pieces of the rendered conversation."""
    from transformers import AutoTokenizer

    rows = [
        {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]},
        {"messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5"}]},  # no assistant turn
        {"text": "w7 w8"},
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pieces = [  # (rendered text, scored) in the template's order
        [("<user> w1 w2 </s> <assistant>", 0), ("w3 w4 </s>", 1)],
        [("<system> w9 </s> <user> w5 </s>", 0)],
        [("w7 w8 </s>", 1)],
    ]
    for template, method in ((TEMPLATE, "{% generation %} marks"), (PLAIN, "rendering prefixes")):
        tok = make_tokenizer(tmp_path / f"tok-{method[:5]}", template)
        t = AutoTokenizer.from_pretrained(tok)
        data = _open(tmp_path / "c.jsonl", tok, tmp_path / "cache", seq_len=16)
        assert method in data.note
        expected = []
        for doc in pieces:
            ids = [i for s, _ in doc for i in t(s, add_special_tokens=False)["input_ids"]]
            mask = [m for s, m in doc for _ in t(s, add_special_tokens=False)["input_ids"]]
            labels = [i if m else -100 for i, m in zip(ids, mask)]
            expected.append((ids, [-100] + labels[1:]))
        got = []
        for i in range(data.num_windows):
            w = data.window(i)
            got += [
                (list(w["input_ids"][a:b]), list(w["labels"][a:b])) for a, b in _docs(w) if w["input_ids"][a] != t.pad_token_id
            ]
        assert sorted(got) == sorted(expected), method


def test_the_cache_is_built_once_per_data_and_tokenizer_and_reused_for_every_length(tmp_path, monkeypatch):
    from seqpar.runtime.data import text as data_tokenize

    tok = make_tokenizer(tmp_path / "tok")
    corpus = write_corpus(tmp_path / "d.jsonl")
    first = _open(corpus, tok, tmp_path / "cache")
    assert "tokenized into the cache" in first.note
    folder = first.corpus.folder
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_tokenize, "build", refuse)
    for seq_len in (64, 128):  # recipe stages: another length, the same tokens
        again = _open(corpus, tok, tmp_path / "cache", seq_len=seq_len)
        assert "read from the cache" in again.note and again.corpus.folder == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name in stamp} == stamp
    np.testing.assert_array_equal(again.corpus.tokens, first.corpus.tokens)
    # another tokenizer: another entry
    other = make_tokenizer(tmp_path / "tok2", PLAIN)
    monkeypatch.undo()
    assert _open(corpus, other, tmp_path / "cache").corpus.folder != folder
    os.utime(corpus, ns=(1, 1))  # touched, not changed: the cache is keyed by content (test_cache.py edits in place)
    assert _open(corpus, tok, tmp_path / "cache").corpus.folder == folder


def _race(rank: int, world: int, corpus: str, tok: str, cache: str) -> str:
    return _open(corpus, tok, cache).note


def test_ranks_opening_uncached_data_at_once_tokenize_it_once(tmp_path):
    from seqpar_testing import run_ranks

    tok = make_tokenizer(tmp_path / "tok")
    corpus = write_corpus(tmp_path / "d.jsonl")
    notes = run_ranks(_race, 2, str(corpus), tok, str(tmp_path / "cache"), timeout=120)
    assert sorted("tokenized into" in n for n in notes) == [False, True], notes
    assert len({n.split("cache ")[-1] for n in notes}) == 1  # the same entry


def test_window_order_is_a_seeded_permutation_per_epoch_and_a_function_of_the_step(tmp_path):
    from seqpar.runtime.data.pack import first_window, window_index

    tok = make_tokenizer(tmp_path / "tok")
    data = _open(write_corpus(tmp_path / "d.jsonl"), tok, tmp_path / "cache", seq_len=32)
    n = data.num_windows
    for epoch in (0, 1):
        want = np.random.default_rng([0, epoch]).permutation(n)
        assert [window_index(epoch * n + i, n, 0) for i in range(n)] == list(want)
    assert sorted(window_index(i, n, 0) for i in range(n)) == list(range(n))
    b = data.batch(2, 1, 1, grad_accum=2, dp_degree=2, micro_batch=2)  # windows k = ((2*2+1)*2+1)*2 = 22, 23
    k = first_window(2, 1, 1, grad_accum=2, dp_degree=2, micro_batch=2)
    assert k == 22
    for row, kk in enumerate((22, 23)):
        w = data.window(window_index(kk, n, 0))
        for key in ("input_ids", "labels", "position_ids"):
            np.testing.assert_array_equal(b[key][row].numpy(), w[key])


def test_windows_scoring_nothing_are_dropped_and_counted(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    rows = [{"text": " ".join(["w1"] * 7)}]  # 8 tokens: a window of its own
    rows += [{"messages": [{"role": "user", "content": "w2"}]}] * 2  # 4 tokens each, nothing scored: one window
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _open(tmp_path / "d.jsonl", tok, tmp_path / "cache", seq_len=8)
    assert (data.num_windows, data.dropped) == (1, 1)
    assert "1 dropped (labels all -100)" in data.note


def test_no_doc_boundaries_keeps_the_stream_and_refuses_chats(tmp_path):
    from seqpar.plan.errors import SeqparError

    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "t.jsonl").write_text('{"text": "w1 w2"}\n{"text": "w3"}\n{"text": "w4 w5 w6"}\n')
    data = _open(tmp_path / "t.jsonl", tok, tmp_path / "cache", seq_len=3, doc_boundaries=False)
    assert not data.packed and data.num_windows == 2  # w1 w2 </s> w3 | </s> w4 w5 w6 | </s>: seq_len + 1 = 4 per window
    ids = {tuple(data.window(i)) for i in range(2)}
    assert ids == {(6, 7, 1, 8), (1, 9, 10, 11)}
    with pytest.raises(SeqparError, match="holds chats.*drop --no-doc-boundaries"):
        _open(write_corpus(tmp_path / "c.jsonl"), tok, tmp_path / "cache", doc_boundaries=False)


def test_token_files_split_documents_after_each_eos_of_the_model(tmp_path):
    from seqpar.runtime.data.windows import DataOptions, open_training_data

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    ids = np.array([5, 6, 7, 1, 8, 1, 9, 9, 9, 9, 9, 1], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    opts = DataOptions(cache=str(tmp_path / "cache"))
    data = open_training_data(str(tmp_path / "t.npy"), opts, seq_len=6, vocab_size=256, tokenizer_path=str(tmp_path / "model"))
    np.testing.assert_array_equal(data.corpus.offsets, [0, 4, 6, 12])
    assert data.num_windows == 2  # [9 9 9 9 9 1] alone; [5 6 7 1] + [8 1]
    plain = open_training_data(str(tmp_path / "t.npy"), opts, seq_len=6, vocab_size=256)
    assert "no EOS id known" in plain.note and list(plain.corpus.offsets) == [0, 12]  # one stream: two 6-token pieces
