"""The document-length mix `seqpar advise` / `check` plan with: read from a file, modelled from a mean, or sampled from data.

Three sources, one result, a ``seqpar.plan.specs.DocMix`` (quarter-octave histogram of (mean length, share of documents)):
* ``--doc-lens FILE``: the lengths in tokens, one integer per line, or a JSON list of integers, or a histogram CSV of
  ``length,count`` rows (a header line is allowed). One line holding one number: every document that long.
* ``--mean-doc-len N``: the long-tail mix seqpar measures packed attention with (bench/packed_kernels.py
  ``long_tail_lengths``: log-normal lengths, sigma 1.6, none shorter than 16 tokens; many short documents, a few of
  tens of K, as web and code corpora have), its median set so the mean is N. N <= 16: every document N tokens.
* ``--data FILE``: a sample of the training data, read without torch, numpy or a tokenizer (data_sample.py).
Documents longer than the window are fine: packing cuts them into window-sized pieces (seqpar.plan.flops).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import DocMix

BINS_PER_OCTAVE = 4
SIGMA, SHORTEST = 1.6, 16  # bench/packed_kernels.py long_tail_lengths: log-normal, sigma 1.6, at least 16 tokens
REFERENCE_MEDIAN = 512  # ... and median 512 tokens: the mix behind every packed measurement of the project


def _histogram(bins: dict[int, list[float]]) -> list[tuple[float, float]]:
    """[(mean length, share)] from {bin: [weight, weighted length sum]}, shortest first; rounded for a readable plan."""
    total = sum(w for w, _ in bins.values())
    out = [(round(s / w, 2), round(w / total, 12)) for _, (w, s) in sorted(bins.items()) if w > 0]
    return [(l, p) for l, p in out if p > 0]  # the far tail of a model rounds to nothing


def _mix(hist: list[tuple[float, float]], source: str, documents: Optional[int]) -> DocMix:
    total = sum(p for _, p in hist)
    hist = [(l, p / total) for l, p in hist]
    return DocMix(source=source, documents=documents, mean_tokens=sum(l * p for l, p in hist), histogram=hist)


def mix_from_counts(counts: Iterable[tuple[int, int]], source: str) -> DocMix:
    """The mix of documents given as (length, count) pairs, binned by quarter octaves (bin mean length kept)."""
    bins: dict[int, list[float]] = {}
    n = 0
    for length, count in counts:
        if count == 0:
            continue
        b = bins.setdefault(math.floor(BINS_PER_OCTAVE * math.log2(length) + 1e-9), [0.0, 0.0])
        b[0] += count
        b[1] += count * length
        n += count
    return _mix(_histogram(bins), source, n)


# --------------------------------------------------------------------------------------------- --mean-doc-len


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _clamped_mean(mu: float, sigma: float, shortest: float) -> float:
    """Mean of max(shortest, X), X log-normal(mu, sigma)."""
    z = (math.log(shortest) - mu) / sigma
    return shortest * _phi(z) + math.exp(mu + sigma * sigma / 2) * (1 - _phi(z - sigma))


def lognormal_mix(mean: Optional[float] = None, median: Optional[float] = None, sigma: float = SIGMA) -> DocMix:
    """The long-tail mix (module docstring) with this mean (or median), as a quarter-octave histogram computed from the
    distribution itself (no sampling): each bin's share and conditional mean length."""
    shortest = SHORTEST
    if mean is not None:
        if mean <= shortest:
            return _mix([(float(mean), 1.0)], f"every document {mean:g} tokens (--mean-doc-len at most {shortest})", None)
        lo, hi = math.log(shortest) - 20 * sigma, math.log(mean)  # _clamped_mean grows with mu; at mu = log(mean) it exceeds mean
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _clamped_mean(mid, sigma, shortest) < mean else (lo, mid)
        mu = (lo + hi) / 2
    else:
        mu = math.log(median or REFERENCE_MEDIAN)
    scale = math.exp(mu + sigma * sigma / 2)
    first = math.floor(BINS_PER_OCTAVE * math.log2(shortest))
    last = math.ceil(BINS_PER_OCTAVE * (mu + 8 * sigma) / math.log(2))  # beyond: less than 1e-15 of the documents
    bins: dict[int, list[float]] = {}
    for k in range(first, last + 1):
        a, b = max(2 ** (k / BINS_PER_OCTAVE), shortest), 2 ** ((k + 1) / BINS_PER_OCTAVE)
        za, zb = (math.log(a) - mu) / sigma, (math.log(b) - mu) / sigma
        w, s = _phi(zb) - _phi(za), scale * (_phi(zb - sigma) - _phi(za - sigma))
        if k == first:  # every shorter document is raised to `shortest`
            below = _phi((math.log(shortest) - mu) / sigma)
            w, s = w + below, s + below * shortest
        bins[k] = [w, s]
    what = f"mean {mean:g}" if mean is not None else f"median {math.exp(mu):g}"
    return _mix(
        _histogram(bins), f"long-tail model: log-normal, {what} tokens, sigma {sigma:g}, at least {shortest} tokens", None
    )


# --------------------------------------------------------------------------------------------- --doc-lens FILE


def _integer(text: str, where: str, what: str = "document length") -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise SeqparError(
            f"{where}: {text.strip()!r} is not an integer {what}; write one whole number of tokens per line"
        ) from None
    if v <= 0:
        raise SeqparError(f"{where}: {what} {v} is not positive; documents hold at least 1 token (drop empty ones)")
    return v


def read_doc_lens(path: str | Path) -> DocMix:
    """The mix in a lengths file (module docstring); SeqparError naming the file, the line and the rule otherwise."""
    p = Path(path)
    name = f"--doc-lens {str(p)!r}"
    if not p.is_file():
        raise SeqparError(f"{name} does not exist; give a file of document lengths in tokens, one per line")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SeqparError(f"{name} is not UTF-8 text; write the lengths as decimal numbers, one per line") from None
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise SeqparError(f"{name} is empty; write the document lengths in tokens, one per line (or a JSON list)")
    if lines[0][1].lstrip().startswith("["):
        try:
            values = json.loads(text)
        except (ValueError, RecursionError) as e:  # ValueError: also an integer of over 4300 digits
            raise SeqparError(f"{name} starts like a JSON list but is not valid JSON ({e}); write [512, 2048, ...]") from None
        if not isinstance(values, list) or not values:
            raise SeqparError(f"{name} holds an empty or nested JSON list; write the lengths as [512, 2048, ...]")
        bad = next((v for v in values if not isinstance(v, int) or isinstance(v, bool)), None)
        if bad is not None:
            raise SeqparError(f"{name}: JSON item {bad!r} is not an integer document length; write whole numbers of tokens")
        counts = Counter(_integer(str(v), name) for v in values)
        return mix_from_counts(sorted(counts.items()), f"lengths from {p.name} ({len(values)} documents)")
    if any("," in line for _, line in lines):  # a histogram: length,count
        if not any(ch.isdigit() for ch in lines[0][1]):
            lines = lines[1:]  # a header line, e.g. length,count
        counts: Counter = Counter()
        for i, line in lines:
            cells = line.split(",")
            if len(cells) != 2:
                raise SeqparError(f"{name} line {i}: {line.strip()!r} is not a `length,count` row; write e.g. 512,1200")
            length = _integer(cells[0], f"{name} line {i}")
            try:
                count = int(cells[1].strip())
            except ValueError:
                raise SeqparError(f"{name} line {i}: count {cells[1].strip()!r} is not an integer; write e.g. 512,1200") from None
            if count < 0:
                raise SeqparError(f"{name} line {i}: count {count} is negative; give how many documents have length {length}")
            counts[length] += count
        if not sum(counts.values()):
            raise SeqparError(f"{name} counts no documents (every count is 0); give each length how many documents have it")
        n = sum(counts.values())
        return mix_from_counts(sorted(counts.items()), f"length histogram from {p.name} ({n} documents)")
    counts = Counter(_integer(line, f"{name} line {i}") for i, line in lines)
    return mix_from_counts(sorted(counts.items()), f"lengths from {p.name} ({len(lines)} documents)")


# --------------------------------------------------------------------------------------------- the flags


def doc_mix(
    doc_lens: Optional[str],
    mean_doc_len: Optional[int],
    data: Optional[str],
    eos_id: Optional[int],
    seq_len: Optional[int],
    vocab_size: int,
) -> Optional[DocMix]:
    """The mix the flags describe (None: one document per window); SeqparError with one line for a bad combination.
    ``seq_len``: the window the user asked for (None when the command searches lengths itself)."""
    given = [f for f, v in (("--doc-lens", doc_lens), ("--mean-doc-len", mean_doc_len), ("--data", data)) if v is not None]
    if len(given) > 1:
        raise SeqparError(
            f"{' and '.join(given)} both describe the document lengths; give one of --doc-lens, --mean-doc-len or --data"
        )
    if eos_id is not None and data is None:
        raise SeqparError(f"--eos-id {eos_id} is for --data token files (.bin/.npy); add --data FILE or drop --eos-id")
    if eos_id is not None and eos_id < 0:
        raise SeqparError(f"--eos-id {eos_id} is negative; token ids start at 0 (the tokenizer's eos_token_id)")
    if mean_doc_len is not None:
        if mean_doc_len <= 0:
            raise SeqparError(f"--mean-doc-len {mean_doc_len} must be a positive number of tokens; e.g. --mean-doc-len 2048")
        if seq_len is not None and mean_doc_len > seq_len:
            raise SeqparError(
                f"--mean-doc-len {mean_doc_len} is longer than the window (seq_len {seq_len}): nearly every window would "
                f"be one document; give a mean <= {seq_len}, or drop the flag (one document per window)"
            )
        return lognormal_mix(mean=mean_doc_len)
    if doc_lens is not None:
        return read_doc_lens(doc_lens)
    if data is not None:
        from seqpar.advisor.data_sample import sample_data

        sample = sample_data(data, vocab_size, eos_id)
        return mix_from_counts(*sample) if sample is not None else None
    return None


__all__ = ["doc_mix", "lognormal_mix", "mix_from_counts", "read_doc_lens"]
