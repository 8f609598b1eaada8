"""Per-rank attention work of a packed window in each mode's layout, and a document order that balances it.

With packing, the work of a rank is the sum of the useful areas (query-key pairs that attend, seqpar.runtime.parallel.blocks) of
the blocks it computes, not S^2/W: a rank holding the tail of a long document does far more than one holding many short
ones. ``rank_work`` counts it exactly, by the mode's balance (seqpar.plan.modes; in pair-heads: pairs x the share of
heads the rank computes):
- zigzag (zigzag_ring_attn, usp_attn): ring rank i's queries of chunks i and 2R-1-i against every earlier key, on 1/U
  of the heads (U = 1 without a head split);
- lightseq (dist_flash_attn): the blocks LightSeq's schedule gives rank r
  (seqpar.runtime.parallel.dist_flash_attn.packed_schedule);
- contiguous: chunk r's queries against every earlier key;
- even: ulysses_attn's whole sequence on 1/W of the heads (balanced whatever the documents), and whole windows
  (data_parallel: every rank its own windows, nothing to balance inside one).

Documents are independent and the loss is a sum over tokens, so reordering the documents of a window changes no loss
and no gradient, only who computes what. ``balanced_order`` searches such an order, deterministically (every rank of
a group computes the same one from the same lengths): candidate orders (as given, longest first, long and short
interleaved, seeded shuffles), then a local search that moves the busiest rank's heaviest document; it stops at the
first order within ``target`` (1.05: the busiest rank at most 5% above the mean) or after ``rounds`` moves.
Measured numbers (W = 8, the long-tail mix): bench/packed_balance.py.
"""

from __future__ import annotations

import bisect
import random

from seqpar.plan.modes import degrees, describe
from seqpar.runtime.parallel import blocks

ORDERED = ("zigzag", "contiguous", "lightseq")  # the balances where the documents' order changes who does how much


def reorders(mode: str) -> bool:
    """Whether the order of a window's documents changes the mode's per-rank work (balanced_order searches one)."""
    d = describe(mode)
    return d.layout != "whole" and d.balance in ORDERED


class _Prefix:
    """Boundaries and cumulative pair counts of one order: G(x) = pairs (query, earlier key of its document) with the
    query before position x, in O(log docs) (each document of l tokens holds l(l+1)/2 pairs)."""

    def __init__(self, lengths: list[int]):
        self.bounds, self.pairs = [0], [0]
        for n in lengths:
            self.bounds.append(self.bounds[-1] + n)
            self.pairs.append(self.pairs[-1] + n * (n + 1) // 2)

    def doc(self, x: int) -> int:
        return min(bisect.bisect_right(self.bounds, x) - 1, len(self.bounds) - 2)

    def G(self, x: int) -> int:
        d = self.doc(x)
        m = x - self.bounds[d]
        return self.pairs[d] + m * (m + 1) // 2

    def diagonal(self, a: int, b: int) -> int:
        """Pairs with query and key both in [a, b): G minus what the document crossing a sees before a."""
        d = self.doc(a)
        before = a - self.bounds[d]
        return self.G(b) - self.G(a) - (min(b, self.bounds[d + 1]) - a) * before

    def rectangle(self, qa: int, qb: int, ka: int, kb: int) -> int:
        """Pairs of queries [qa, qb) and keys [ka, kb), kb <= qa: the one document of position kb-1 (blocks.py)."""
        d = self.doc(kb - 1)
        start, end = self.bounds[d], self.bounds[d + 1]
        return max(0, min(qb, end) - qa) * (kb - max(ka, start)) if end > qa else 0


def rank_work(lengths: list[int], mode: str, world_size: int, ulysses_degree: int | None = None) -> list[float]:
    """Useful pair-heads of each rank for one window holding documents of these lengths, in this order."""
    ring, uly = degrees(mode, world_size, ulysses_degree)
    pre = _Prefix(lengths)
    S = pre.bounds[-1]
    d = describe(mode)
    if d.layout == "whole":
        return [float(pre.pairs[-1])] * world_size
    if d.balance == "even":
        return [pre.pairs[-1] / world_size] * world_size
    if d.balance == "contiguous":
        n = S // world_size
        return [float(pre.G((r + 1) * n) - pre.G(r * n)) for r in range(world_size)]
    if d.balance == "lightseq":
        from seqpar.runtime.parallel.dist_flash_attn import rows, schedule

        n = S // world_size
        work = [0.0] * world_size
        for step in schedule(world_size, True, split_last=n >= 2):  # blocks with no pair add 0 (packed_schedule idles them)
            for r, b in enumerate(step):
                if b is None:
                    continue
                r0, r1 = rows(b.half, n).indices(n)[:2]
                if b.causal:
                    work[r] += pre.diagonal(b.q * n, (b.q + 1) * n)
                else:
                    work[r] += pre.rectangle(b.q * n + r0, b.q * n + r1, b.kv * n, (b.kv + 1) * n)
        return work
    c = S // (2 * ring)  # zigzag: a rank's queries see all their earlier keys
    chunk = [pre.G((j + 1) * c) - pre.G(j * c) for j in range(2 * ring)]
    per_ring = [(chunk[i] + chunk[2 * ring - 1 - i]) / uly for i in range(ring)]
    return [per_ring[r // uly] for r in range(world_size)]  # global rank = ring_rank * U + ulysses_rank


def imbalance(work: list[float]) -> float:
    """Busiest rank over the mean (1.0 = perfect)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def _query_segments(mode: str, world_size: int, ulysses_degree: int | None, S: int, rank: int) -> blocks.Segments:
    """Global ranges of the queries whose work lands on this rank (a guide for the search's moves)."""
    ring, uly = degrees(mode, world_size, ulysses_degree)
    if describe(mode).balance != "zigzag":  # contiguous chunks, LightSeq's among them
        return blocks.contiguous_segments(rank, world_size, S)
    return blocks.zigzag_segments(rank // uly, ring, S)


def _docs_in(order: list[int], lengths: list[int], segs: blocks.Segments) -> list[tuple[int, int]]:
    """(position in order, work inside segs) of every document overlapping segs, heaviest first."""
    found, pos = [], 0
    for k, i in enumerate(order):
        a, b = pos, pos + lengths[i]
        w = 0
        for s, n in segs:
            lo, hi = max(a, s), min(b, s + n)
            if lo < hi:  # positions lo-a .. hi-a-1 of the document: pairs (i+1) each
                w += ((hi - a) * (hi - a + 1) - (lo - a) * (lo - a + 1)) // 2
        if w:
            found.append((k, w))
        pos = b
    return sorted(found, key=lambda x: -x[1])


def _interleave(n: int) -> list[int]:
    """0, n-1, 1, n-2, ...: the largest, the smallest, the second largest, ..."""
    out, lo, hi = [], 0, n - 1
    while lo <= hi:
        out.append(lo)
        if lo != hi:
            out.append(hi)
        lo, hi = lo + 1, hi - 1
    return out


def _candidates(lengths: list[int], seed: int, shuffles: int) -> list[list[int]]:
    n = len(lengths)
    by_len = sorted(range(n), key=lambda i: (-lengths[i], i))
    interleaved = [by_len[k] for k in _interleave(n)]  # longest, shortest, second longest, second shortest, ...
    # mirror pairs (zigzag): documents of similar length at mirrored positions, the first of each pair in the first half
    # in long/short interleaved order, its partner at the mirrored place of the second half. A token at offset i of a
    # document of l tokens and its mirror at offset ~l-i of the partner see ~l+1 keys together: every zigzag pair of
    # chunks gets about the same work, as for one document
    firsts, seconds = by_len[0::2], by_len[1::2]
    pairs = list(zip(firsts, seconds))
    mixed = [pairs[k] for k in _interleave(len(pairs))]
    mirror = [a for a, _ in mixed] + ([firsts[-1]] if len(firsts) > len(seconds) else []) + [b for _, b in mixed][::-1]
    cands = [list(range(n)), by_len, by_len[::-1], interleaved, mirror]
    rng = random.Random(seed)
    for _ in range(shuffles):
        order = list(range(n))
        rng.shuffle(order)
        cands.append(order)
    return cands


def _score(work: list[float]) -> tuple[float, float]:
    """Busiest rank first, then the spread (so moves that relieve the second-busiest rank count too)."""
    mean = sum(work) / len(work)
    return max(work), sum((w - mean) ** 2 for w in work)


def balanced_order(
    lengths: list[int],
    mode: str,
    world_size: int,
    ulysses_degree: int | None = None,
    *,
    target: float = 1.05,
    rounds: int = 40,
    starts: int = 3,
    shuffles: int = 8,
    seed: int = 0,
) -> list[int]:
    """A permutation of the documents (indices into lengths) whose per-rank work is as even as this search finds;
    the identity for modes whose balance does not depend on the order. Deterministic in its arguments.

    From each of the ``starts`` best candidate orders, each round tries moving one of the busiest rank's heaviest
    documents in front of a document of one of the lightest ranks (or to either end) and keeps the best move
    (busiest rank first, then the spread); a start ends when no move helps or at ``target``."""
    if not reorders(mode) or len(lengths) < 2:
        return list(range(len(lengths)))
    S = sum(lengths)

    def work(order):
        return rank_work([lengths[i] for i in order], mode, world_size, ulysses_degree)

    def segs(rank):
        return _query_segments(mode, world_size, ulysses_degree, S, rank)

    scored = sorted(((_score(w), o, w) for o in _candidates(lengths, seed, shuffles) for w in [work(o)]), key=lambda x: x[0])
    best_score, best, best_work = scored[0]
    for score, order, w in scored[:starts]:
        for _ in range(rounds):
            if imbalance(w) <= target:
                break
            ranked = sorted(range(world_size), key=w.__getitem__)
            movers = [k for k, _ in _docs_in(order, lengths, segs(ranked[-1]))[:4]]
            places = {0, len(order) - 1}
            for r in ranked[:2]:  # the lightest ranks' heaviest documents: in front of them lands the new work
                places |= {k for k, _ in _docs_in(order, lengths, segs(r))[:5]}
            trials = []
            for i in movers:
                for j in sorted(places):
                    if i != j:
                        t = order[:]
                        t.insert(j, t.pop(i))  # move: the documents between shift by its length
                        trials.append(t)
                        t = order[:]
                        t[i], t[j] = t[j], t[i]  # swap: only the stretch between shifts, by the difference
                        trials.append(t)
            results = [(_score(tw), t, tw) for t in trials for tw in [work(t)]]
            if not results:
                break
            top = min(results, key=lambda x: x[0])
            if top[0] >= score:
                break
            score, order, w = top
        if score < best_score:
            best_score, best, best_work = score, order, w
        if imbalance(best_work) <= target:
            break
    return best
