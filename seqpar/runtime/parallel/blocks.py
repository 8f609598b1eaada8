"""Attention blocks of packed documents: which pieces of a block attend, the kernels of those pieces, and which blocks
the ring modes can skip.

Every mode computes blocks: the local queries (consecutive global ranges, ``segments``) against some rank's local keys.
For one pair of ranges (queries [qa, qb), keys [ka, kb)) with documents:
- the same range (the causal diagonal): per-document causal attention inside it (seqpar.runtime.parallel.varlen);
- keys entirely before the queries (kb <= qa): a query sees a key only if they share a document, and a document holding
  a key (< kb) and a query (>= qa) holds kb-1 and qa, so it is the ONE document d of position kb-1, when end(d) > qa. The
  block is then the dense rectangle of rows [qa, min(qb, end(d))) x keys [max(ka, start(d)), kb), else nothing;
- keys after the queries: nothing (causal).
So each block is a few diagonal pieces and at most one rectangle per pair of ranges: no mask is ever built on a GPU.
``attend`` returns every query row (rows without a key: out 0, lse -inf, which kernels.merge leaves unchanged, exactly);
``attend_backward`` returns full-size gradients. ``need`` (does any query of dst see a key of src) is a pure function
of the boundaries and the layout, the same on every rank, so senders and receivers skip the same transfers.
Layout: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); out (B, Sq, Hq, D) float32 (float64 for float64); lse (B, Hq, Sq).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from seqpar.runtime.parallel import kernels, varlen
from seqpar.runtime.parallel.documents import Bounds, Documents, clip, doc_of

Segments = tuple[tuple[int, int], ...]  # ((global start, length), ...) of consecutive local pieces


def zigzag_segments(rank: int, world: int, S: int) -> Segments:
    c = S // (2 * world)
    return ((rank * c, c), ((2 * world - 1 - rank) * c, c))


def contiguous_segments(rank: int, world: int, S: int) -> Segments:
    return ((rank * (S // world), S // world),)


class Piece(NamedTuple):
    """Local query rows [r0, r1) against local key rows [c0, c1); ``bounds`` for a diagonal piece (per-document causal),
    None for a dense rectangle."""

    r0: int
    r1: int
    c0: int
    c1: int
    bounds: Bounds | None

    @property
    def area(self) -> int:
        """Query-key pairs that attend."""
        if self.bounds is None:
            return (self.r1 - self.r0) * (self.c1 - self.c0)
        return sum((b - a) * (b - a + 1) // 2 for a, b in zip(self.bounds, self.bounds[1:]))


def pieces(q_segs: Segments, k_segs: Segments, bounds: Bounds) -> list[Piece]:
    """The pieces of one block that attend, diagonal ones first (see the module docstring)."""
    diag, rect = [], []
    qo = 0
    for qs, ql in q_segs:
        ko = 0
        for ks, kl in k_segs:
            if (qs, ql) == (ks, kl):
                diag.append(Piece(qo, qo + ql, ko, ko + kl, clip(bounds, qs, qs + ql)))
            elif ks + kl <= qs:
                d = doc_of(bounds, ks + kl - 1)
                start, end = bounds[d], bounds[d + 1]
                if end > qs:
                    rect.append(Piece(qo, qo + min(ql, end - qs), ko + max(0, start - ks), ko + kl, None))
            elif ks < qs + ql:  # layouts cut the sequence on one grid: ranges are equal or disjoint
                raise AssertionError(f"overlapping query {qs, ql} and key {ks, kl} ranges")
            ko += kl
        qo += ql
    return diag + rect


def block_pieces(q_segs: Segments, k_segs: Segments, docs: Documents) -> list[tuple[tuple[int, ...] | None, list[Piece]]]:
    """[(rows, pieces)] per row group, memoised on the Documents (every layer of a forward asks the same)."""
    key = ("pieces", q_segs, k_segs)
    if key not in docs._memo:
        docs._memo[key] = [(rows, pieces(q_segs, k_segs, b)) for rows, b in docs.groups]
    return docs._memo[key]


def need(q_segs: Segments, k_segs: Segments, docs: Documents) -> bool:
    """Does any query of q_segs see any key of k_segs (in any row)?"""
    return any(ps for _, ps in block_pieces(q_segs, k_segs, docs))


def area(q_segs: Segments, k_segs: Segments, docs: Documents, batch: int = 1) -> int:
    """Query-key pairs of the block that attend, summed over the batch rows (useful work, per head)."""
    return sum(
        (batch if rows is None else len(rows)) * sum(p.area for p in ps) for rows, ps in block_pieces(q_segs, k_segs, docs)
    )


def ring_need(segs: list[Segments], docs: Documents) -> tuple[list[list[bool]], list[int]]:
    """need[src][dst] over the ranks of a ring, and reach[src]: the farthest ring distance at which a rank uses src's
    block (0: only src itself). Block src travels hops 1..reach[src] and no further."""
    key = ("ring", tuple(segs))
    if key not in docs._memo:
        W = len(segs)
        nd = [[need(segs[dst], segs[src], docs) for dst in range(W)] for src in range(W)]
        reach = [max(t for t in range(W) if t == 0 or nd[src][(src + t) % W]) for src in range(W)]
        docs._memo[key] = (nd, reach)
    return docs._memo[key]


def _rows(x: Tensor, rows: tuple[int, ...] | None) -> Tensor:
    return x if rows is None else x[list(rows)]


def _put(full: Tensor, rows, r0: int, r1: int, value: Tensor, dim: int = 1) -> None:
    """full[rows][..., r0:r1 on dim] = value (dim 1: (B, S, H, D) tensors; dim 2: (B, H, S) lse)."""
    index = (slice(None),) * dim + (slice(r0, r1),)
    if rows is None:
        full[index] = value
    else:
        sub = full[list(rows)]
        sub[index] = value
        full[list(rows)] = sub


def _whole_diagonal(groups, n: int) -> Bounds | None:
    """The bounds when the block is one diagonal piece over all rows of one shared group (data_parallel, Ulysses)."""
    if len(groups) == 1 and groups[0][0] is None and len(groups[0][1]) == 1:
        p = groups[0][1][0]
        if p.bounds is not None and (p.r0, p.r1, p.c0, p.c1) == (0, n, 0, n):
            return p.bounds
    return None


def _merge(cur_o: Tensor, cur_l: Tensor, o: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    """kernels.merge, except rows no earlier piece reached (lse -inf) take the new piece as it is."""
    mo, ml = kernels.merge(cur_o, cur_l, o, l)
    fresh = torch.isneginf(cur_l)  # (B, Hq, rows)
    return torch.where(fresh.transpose(1, 2).unsqueeze(-1), o.to(mo.dtype), mo), torch.where(fresh, l.to(ml.dtype), ml)


def attend(q: Tensor, k: Tensor, v: Tensor, q_segs: Segments, k_segs: Segments, docs: Documents, *, scale: float, backend: str):
    """The block's (out, lse) over every query row (rows without a key: 0 and -inf), or None when nothing attends.
    out is float32 (float64), or q's dtype when the block is one diagonal over every row (the kernel's own result)."""
    groups = block_pieces(q_segs, k_segs, docs)
    if not any(ps for _, ps in groups):
        return None
    whole = _whole_diagonal(groups, q.shape[1])
    if whole is not None:
        return varlen.forward(q, k, v, whole, scale=scale, backend=backend)
    B, Sq, Hq, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=acc, device=q.device)  # (B, Sq, Hq, D)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.promote_types(acc, torch.float32), device=q.device)
    for rows, ps in groups:
        qq, kk, vv = (_rows(x, rows) for x in (q, k, v))
        for p in ps:  # diagonals first: they are the first value of their rows, rectangles merge into them
            qs, ks = slice(p.r0, p.r1), slice(p.c0, p.c1)
            if p.bounds is not None:
                o, l = varlen.forward(qq[:, qs], kk[:, ks], vv[:, ks], p.bounds, scale=scale, backend=backend)
            else:
                o, l = kernels.attn_forward(qq[:, qs], kk[:, ks], vv[:, ks], causal=False, softmax_scale=scale, backend=backend)
                o, l = _merge(_rows(out, rows)[:, qs], _rows(lse, rows)[..., qs], o, l)
            _put(out, rows, p.r0, p.r1, o.to(acc))
            _put(lse, rows, p.r0, p.r1, l.to(lse.dtype), dim=2)
    return out, lse


def attend_backward(dout, q, k, v, out, lse, q_segs: Segments, k_segs: Segments, docs: Documents, *, scale: float, backend: str):
    """(dq, dk, dv) of the block given the global out and lse of q's rows, full size in float32 (float64; the inputs'
    dtypes for one diagonal over every row), or None when nothing attends."""
    groups = block_pieces(q_segs, k_segs, docs)
    if not any(ps for _, ps in groups):
        return None
    whole = _whole_diagonal(groups, q.shape[1])
    if whole is not None:
        return varlen.backward(dout, q, k, v, out, lse, whole, scale=scale, backend=backend)
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, Sq, Hq, D)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, Sk, Hkv, D)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for rows, ps in groups:
        dd, qq, kk, vv, oo = (_rows(x, rows) for x in (dout, q, k, v, out))
        ll = _rows(lse, rows)
        for p in ps:
            qs, ks = slice(p.r0, p.r1), slice(p.c0, p.c1)
            args = (dd[:, qs], qq[:, qs], kk[:, ks], vv[:, ks], oo[:, qs], ll[..., qs])
            if p.bounds is not None:
                g = varlen.backward(*args, p.bounds, scale=scale, backend=backend)
            else:
                g = kernels.attn_backward(*args, causal=False, softmax_scale=scale, backend=backend)
            for full, part, (a, b) in zip((dq, dk, dv), g, ((p.r0, p.r1), (p.c0, p.c1), (p.c0, p.c1))):
                if rows is None:
                    full[:, a:b] += part
                else:
                    idx = list(rows)
                    sub = full[idx]
                    sub[:, a:b] += part
                    full[idx] = sub
    return dq, dk, dv
