"""Documents packed into windows of ``seq_len`` tokens with their boundaries, and the seeded order the trainer reads them in.

Packing (best-fit decreasing, TRL's ``packing_strategy="bfd"`` for SFT): documents longest first, each into the open
window whose free space fits it most tightly, else into a new window. Documents stay whole; the tail of a window that
nothing fits is filler (the tokenizer's pad or EOS id), a document of its own that is never scored. Measured on 1M
long-tail documents (log-normal, median 512, sigma 1.6): 99.99% of the window tokens are documents at seq_len 4K and
128K, in 6 and 12 s (2 shared cores), once: the packing is cached in the data's cache entry per (seq_len, policy).

A document longer than the window (``--long-documents``): ``split`` (the default) cuts it into window-sized pieces, each
its own document (the first fills a window alone; a query of a later piece does not see the earlier ones); ``truncate``
keeps its first seq_len tokens; ``error`` refuses the data with one line naming the document.

A window is (input_ids, labels, position_ids), each (seq_len,): position ids restart at 0 at each document (transformers'
packed convention, what seqpar.prepare_inputs reads the boundaries from), labels are the tokens (transformers'
convention: unshifted) with -100 at each document's first token (nothing before it in its document predicts it), on
unscored tokens (a chat's prompt) and on the filler. A window whose labels are all -100 trains nothing: it is dropped at
packing time and counted.

Order: window(step, micro, dp_rank, b) = order[((step * grad_accum + micro) * dp_degree + dp_rank) * micro_batch + b],
where ``order`` is a seeded permutation of the windows, a new one per epoch (numpy's Generator seeded with
(seed, epoch)): a function of the step alone, so ``--resume`` reads exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import os
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from seqpar.plan.errors import SeqparError

FORMAT = 1  # of the cached packing files


def _pieces(corpus, S: int, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """(token start, length) of every piece: whole documents, and long ones as the policy says."""
    starts, lengths = corpus.offsets[:-1], corpus.lengths
    long = np.flatnonzero(lengths > S)
    if long.size and policy == "error":
        d = int(long[0])
        raise SeqparError(
            f"{corpus.where(d)} is a document of {int(lengths[d])} tokens, longer than the window of seq_len {S} "
            f"({long.size} such), and --long-documents error refuses it; --long-documents split (the default) trains "
            f"on it in window-sized pieces, truncate on its first {S} tokens; or raise seq_len"
        )
    if policy == "truncate":
        return starts.copy(), np.minimum(lengths, S)
    count = (lengths + S - 1) // S  # split: ceil(L / S) pieces
    first = np.repeat(np.cumsum(count) - count, count)  # index of each piece's first sibling
    k = np.arange(count.sum()) - first  # piece number inside its document
    doc_len = np.repeat(lengths, count)
    return np.repeat(starts, count) + k * S, np.minimum(S, doc_len - k * S)


def best_fit_decreasing(lengths: np.ndarray, S: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(window of each piece, the order pieces were placed in, number of windows). A max-tree over free capacities
    0..S (leaf c holds c while some window has exactly c free) finds the tightest fit in log2(S) steps."""
    size = 1 << max(1, int(S).bit_length())
    tree = [0] * (2 * size)
    open_at: dict[int, list[int]] = {}  # free capacity -> windows with exactly that much free

    def set_leaf(c: int, v: int) -> None:
        i = c + size
        tree[i] = v
        i >>= 1
        while i:
            m = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == m:  # the ancestors are unchanged too
                break
            tree[i] = m
            i >>= 1

    order = np.argsort(-lengths, kind="stable")
    window = np.empty(len(lengths), dtype=np.int64)
    n = 0
    for k in order.tolist():
        need = int(lengths[k])
        if tree[1] >= need:
            i = 1
            while i < size:  # leftmost leaf >= need: the smallest free capacity that fits
                i = 2 * i if tree[2 * i] >= need else 2 * i + 1
            cap = i - size
            ws = open_at[cap]
            w = ws.pop()
            if not ws:
                del open_at[cap]
                set_leaf(cap, 0)
        else:
            w, cap, n = n, S, n + 1
        window[k] = w
        left = cap - need
        if left:
            if left in open_at:
                open_at[left].append(w)
            else:
                open_at[left] = [w]
                set_leaf(left, left)
    return window, order, n


def _sums(values: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum(values[a_i:b_i]) for every i, in one chunked pass over values (a memory-mapped array of any size)."""
    points = np.unique(np.concatenate([a, b]))
    at = np.zeros(len(points), dtype=np.int64)  # prefix sums at the points
    total, j, chunk = 0, 0, 1 << 24
    for lo in range(0, len(values) + 1, chunk):
        hi = min(lo + chunk, len(values))
        pre = np.concatenate([[total], total + np.cumsum(values[lo:hi], dtype=np.int64)])  # prefix at lo .. hi
        k = np.searchsorted(points, hi, side="right")
        at[j:k] = pre[points[j:k] - lo]
        total, j = int(pre[-1]), k
    return at[np.searchsorted(points, b)] - at[np.searchsorted(points, a)]


def pack(corpus, S: int, policy: str) -> dict:
    """The packing of ``corpus`` into windows of S tokens: {"start", "length"} of the pieces in window order,
    "ptr" (window w = pieces ptr[w]:ptr[w+1]), "kept" (windows that score a token), "dropped"; cached."""
    cached = Path(corpus.folder) / f"pack-{FORMAT}-{S}-{policy}.npz"
    if cached.is_file():
        held = _read_cached(cached, corpus, S)
        if held is not None:
            return held
    start, length = _pieces(corpus, S, policy)
    window, order, n = best_fit_decreasing(length, S)
    placed = order[np.argsort(window[order], kind="stable")]  # by window, longest first inside each
    start, length, window = start[placed], length[placed], window[placed]
    ptr = np.searchsorted(window, np.arange(n + 1))
    if corpus.scored is None:
        targets = length - 1  # every token but the document's first
    else:
        targets = _sums(corpus.scored, start + 1, start + length)
    per_window = np.add.reduceat(targets, ptr[:-1]) if n else np.zeros(0, dtype=np.int64)
    kept = np.flatnonzero(per_window > 0)
    out = {"start": start, "length": length.astype(np.int64), "ptr": ptr, "kept": kept, "dropped": np.int64(n - len(kept))}
    part = cached.with_name(f"{cached.stem}.part-{os.getpid()}.npz")
    try:
        np.savez(part, **out)
        os.replace(part, cached)
    except OSError:  # a read-only cache still trains: the packing is recomputed next time
        part.unlink(missing_ok=True)
    return out


_PACK_KEYS = ("dropped", "kept", "length", "ptr", "start")
_PACK_ERRORS = (ValueError, OSError, EOFError, TypeError, KeyError, OverflowError, zipfile.BadZipFile)


def _read_cached(path: Path, corpus, S: int) -> dict | None:
    """A cached packing, or None (packed again) when the file is not one this code wrote for this corpus: unreadable,
    holding a pickle, or with pieces outside the corpus or the windows (a torn or edited cache file would otherwise
    read tokens from anywhere, or never end)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if sorted(f.files) != sorted(_PACK_KEYS):
                return None
            out = {k: f[k] for k in f.files}
    except _PACK_ERRORS:
        return None
    start, length, ptr, kept, dropped = (out[k] for k in ("start", "length", "ptr", "kept", "dropped"))
    if any(a.dtype.kind != "i" or a.ndim != 1 for a in (start, length, ptr, kept)) or dropped.ndim or dropped.dtype.kind != "i":
        return None
    n = len(ptr) - 1
    ok = (
        n >= 0
        and len(start) == len(length)
        and (n == 0 or (ptr[0] == 0 and ptr[-1] == len(start) and bool(np.all(np.diff(ptr) > 0))))
        and bool(np.all(start >= 0))
        and bool(np.all((length > 0) & (length <= S)))
        and bool(np.all(start + length <= int(corpus.offsets[-1])))
        and bool(np.all((kept >= 0) & (kept < max(n, 1))))
        and 0 <= int(dropped) <= n
        and len(kept) + int(dropped) == n
    )
    if ok and n:  # every window's pieces fit it
        ok = bool(np.all(np.add.reduceat(length, ptr[:-1]) <= S))
    return out if ok else None


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def window_index(k: int, n: int, seed: int, shuffle: bool = True) -> int:
    """The window read k-th (k counts windows over the whole run): a seeded permutation per epoch of n windows."""
    epoch, i = divmod(k, n)
    return int(_permutation(n, seed, epoch)[i]) if shuffle else i


def first_window(step: int, micro: int, dp_rank: int, *, grad_accum: int, dp_degree: int, micro_batch: int) -> int:
    """k of the first window of (step, micro) on this data-parallel rank; the rank's micro-batch is k .. k + B - 1."""
    return ((step * grad_accum + micro) * dp_degree + dp_rank) * micro_batch
