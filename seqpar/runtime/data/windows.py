"""Training data for the trainer: documents packed into windows with their boundaries, and who reads which window.

Sources (seqpar.runtime.data.source): a ``.jsonl`` of ``{"text": ...}`` or ``{"messages": [...]}`` rows, a `datasets`
``save_to_disk`` folder, token files (``.bin``/``.npy``) or ``synthetic`` (seeded random tokens, for benchmarks and
tests). Text and chats are tokenized once per (data, tokenizer) into a cache shared by every rank and stage
(seqpar.runtime.data.text, data_cache).

By default documents keep their boundaries (``PackedData``, seqpar.runtime.data.pack): packed whole into windows of
``seq_len`` tokens, position ids restarting at 0 at each document, each document's first label -100, and chats scored
on the assistant's tokens only; the trainer passes labels and position ids to seqpar.prepare_inputs, so in every mode
a query attends only to its own document and the loss is the token-weighted loss of the documents run alone.
``--no-doc-boundaries`` keeps the older stream (``TokenData``): documents concatenated (text ends with EOS), cut into
``seq_len + 1``-token windows (inputs ``window[:-1]``, targets ``window[1:]``), attending across documents.

Both read windows in a seeded order that is a function of the step alone (data_pack.window_index), so a resumed run
reads exactly what the uninterrupted one would have:

    window(step, micro, dp_rank, b) = order[((step * grad_accum + micro) * dp_degree + dp_rank) * micro_batch + b]

Every sequence-parallel rank of a group reads the same windows (they keep their shard through ``prepare_inputs``);
different data-parallel groups read different ones. This module imports numpy only (torch lazily), so the launcher can
check (and tokenize) the data before starting any process.
"""

from __future__ import annotations

import numpy as np

from seqpar.plan.errors import SeqparError
from seqpar.plan.job_options import DataOptions  # the trainer's data options (--no-doc-boundaries, --data-cache, ...)
from seqpar.runtime.data import pack as data_pack
from seqpar.runtime.data.pack import first_window, window_index


def packing_fact(spec: str, opts: DataOptions) -> str:
    """How ``spec`` becomes windows, as a checkpoint records it ('' for synthetic data, which has no documents)."""
    return "" if spec == "synthetic" else opts.packing


def digest_fact(data) -> str:
    """The SHA-256 of the data's content, as a checkpoint records it ('' for synthetic data): a file edited in place
    between a run and its --resume is then refused, not trained on as if it were the data the checkpoint saw."""
    corpus = getattr(data, "corpus", None)
    return corpus.digest if corpus is not None else ""


class TokenData:
    """A token stream cut into windows; ``batch(...)`` returns (micro_batch, seq_len + 1) int64 tensors."""

    packed = False

    def __init__(self, name: str, seq_len: int, vocab_size: int, tokens=None, seed: int = 0, shuffle: bool = False):
        self.name, self.seq_len, self.vocab_size, self.seed, self.shuffle = name, seq_len, vocab_size, seed, shuffle
        self.tokens = tokens  # 1-D token ids; None = synthetic
        self.note = f"data {name!r}"
        window = seq_len + 1
        if tokens is None:
            self.num_windows = 2**31 - 1
        else:
            self.num_windows = len(tokens) // window
            if self.num_windows == 0:
                raise SeqparError(
                    f"data {name!r} holds {len(tokens)} tokens, shorter than one window of seq_len + 1 = {window}; "
                    f"add data or lower seq_len"
                )

    def window(self, index: int) -> np.ndarray:
        """Tokens of window ``index`` (wrapping around the data: one more epoch), (seq_len + 1,) int64."""
        w = self.seq_len + 1
        i = index % self.num_windows
        if self.tokens is None:
            # A generator per window: any window can be produced without generating the ones before it.
            return np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, size=w, dtype=np.int64)
        ids = np.asarray(self.tokens[i * w : (i + 1) * w], dtype=np.int64)
        top = int(ids.max())
        if top >= self.vocab_size:
            raise SeqparError(
                f"data {self.name!r} window {i} holds token id {top}, outside the model's vocabulary of {self.vocab_size}; "
                f"tokenize with the model's tokenizer"
            )
        return ids

    def scored(self, index: int) -> np.ndarray | None:
        """Which tokens of window ``index`` training scores, (seq_len + 1,) bool (chats: the assistant's, the data's
        scored mask); None when every token is (text, token files, synthetic)."""
        mask = getattr(getattr(self, "corpus", None), "scored", None)
        if mask is None or self.tokens is None:
            return None
        w, i = self.seq_len + 1, index % self.num_windows
        return np.asarray(mask[i * w : (i + 1) * w]) != 0

    def batch(self, step: int, micro: int, dp_rank: int, *, grad_accum: int, dp_degree: int, micro_batch: int):
        """The (micro_batch, seq_len + 1) int64 tensor this data-parallel rank trains on at (step, micro)."""
        import torch

        k = first_window(step, micro, dp_rank, grad_accum=grad_accum, dp_degree=dp_degree, micro_batch=micro_batch)
        order = [window_index(k + b, self.num_windows, self.seed, self.shuffle) for b in range(micro_batch)]
        return torch.from_numpy(np.stack([self.window(i) for i in order]))  # (B, S + 1)


class PackedData:
    """Documents packed into windows of seq_len tokens; ``batch(...)`` returns {"input_ids", "labels",
    "position_ids"}, each (micro_batch, seq_len) int64, for seqpar.prepare_inputs."""

    packed = True

    def __init__(self, corpus, seq_len: int, seed: int = 0, long_documents: str = "split"):
        self.corpus, self.seq_len, self.seed, self.name = corpus, seq_len, seed, corpus.name
        p = data_pack.pack(corpus, seq_len, long_documents)
        self.start, self.length, self.ptr, self.kept = p["start"], p["length"], p["ptr"], p["kept"]
        self.dropped, self.num_windows = int(p["dropped"]), len(self.kept)
        total = len(self.ptr) - 1
        if self.num_windows == 0:
            raise SeqparError(
                f"data {self.name!r}: none of its {total} windows scores a token (every label -100: chats without an "
                "assistant turn, or documents of one token); add documents with something to learn"
            )
        fill = float(self.length.sum()) / (total * seq_len)
        longer = int((corpus.lengths > seq_len).sum())
        self.note = (
            f"{corpus.note}; packed into {total:,} windows of {seq_len} tokens ({fill:.1%} document tokens, the rest "
            f"filler), {self.dropped:,} dropped (labels all -100), {longer:,} documents longer than the window "
            f"({long_documents})"
        )

    def window(self, index: int) -> dict[str, np.ndarray]:
        """Window ``index`` of the kept ones: input_ids, labels, position_ids, each (seq_len,) int64."""
        from seqpar.runtime.parallel.loss import IGNORE_INDEX  # torch's ignore index (loss.py imports torch: not at module level)

        w = int(self.kept[index])
        S, c = self.seq_len, self.corpus
        ids = np.full(S, c.pad_id, dtype=np.int64)
        labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros(S, dtype=np.int64)
        at = 0
        for s, n in zip(self.start[self.ptr[w] : self.ptr[w + 1]].tolist(), self.length[self.ptr[w] : self.ptr[w + 1]].tolist()):
            ids[at : at + n] = c.tokens[s : s + n]
            lab = ids[at : at + n].copy()
            if c.scored is not None:
                lab[np.asarray(c.scored[s : s + n]) == 0] = IGNORE_INDEX
            lab[0] = IGNORE_INDEX  # nothing in its document comes before a document's first token
            labels[at : at + n] = lab
            pos[at : at + n] = np.arange(n)
            at += n
        pos[at:] = np.arange(S - at)  # the filler: a document of its own, never scored
        return {"input_ids": ids, "labels": labels, "position_ids": pos}

    def batch(self, step: int, micro: int, dp_rank: int, *, grad_accum: int, dp_degree: int, micro_batch: int):
        import torch

        k = first_window(step, micro, dp_rank, grad_accum=grad_accum, dp_degree=dp_degree, micro_batch=micro_batch)
        rows = [self.window(window_index(k + b, self.num_windows, self.seed)) for b in range(micro_batch)]
        return {key: torch.from_numpy(np.stack([r[key] for r in rows])) for key in rows[0]}  # each (B, S)


def open_data(
    spec: str,
    *,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    tokenizer_path: str | None = None,
    cache: str | None = None,
    shuffle: bool = False,
    trust_remote_code: bool = False,
) -> TokenData:
    """``spec`` as one token stream ('synthetic', a .bin/.npy/.jsonl file or a datasets folder; what seqpar eval
    reads): its documents concatenated, text ones ending with EOS. SeqparError with one line if it cannot be read."""
    if spec == "synthetic":
        return TokenData("synthetic", seq_len, vocab_size, None, seed)
    from seqpar.runtime.data.source import read_corpus

    corpus = read_corpus(
        spec, vocab_size=vocab_size, tokenizer_path=tokenizer_path, cache_dir=cache, trust_remote_code=trust_remote_code
    )
    data = TokenData(spec, seq_len, vocab_size, corpus.tokens, seed, shuffle)
    data.corpus, data.note = corpus, corpus.note
    return data


def open_training_data(
    spec: str, opts: DataOptions, *, seq_len: int, vocab_size: int, seed: int = 0, tokenizer_path: str | None = None
) -> TokenData | PackedData:
    """What the trainer reads: ``PackedData`` (documents with boundaries), or with --no-doc-boundaries (or synthetic
    data) the shuffled ``TokenData`` stream. Tokenizes into the cache when the entry is missing (one process builds it,
    the others wait for it: seqpar.runtime.data.cache)."""
    if spec == "synthetic":
        return TokenData("synthetic", seq_len, vocab_size, None, seed)
    from seqpar.runtime.data.source import read_corpus

    corpus = read_corpus(
        spec,
        vocab_size=vocab_size,
        tokenizer_path=tokenizer_path,
        cache_dir=opts.cache,
        procs=opts.procs,
        trust_remote_code=opts.trust_remote_code,
    )
    if opts.doc_boundaries:
        return PackedData(corpus, seq_len, seed, opts.long_documents)
    if corpus.scored is not None:
        raise SeqparError(
            f"data {spec!r} holds chats, scored on the assistant's tokens only, and --no-doc-boundaries trains on every "
            "token of a stream; drop --no-doc-boundaries"
        )
    data = TokenData(spec, seq_len, vocab_size, corpus.tokens, seed, shuffle=True)
    data.corpus, data.note = corpus, f"{corpus.note}; one stream (--no-doc-boundaries), {data.num_windows:,} windows"
    return data
