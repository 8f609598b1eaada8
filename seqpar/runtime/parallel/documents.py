"""Document boundaries of packed sequences: checked once, the same on every rank, and what attention plans with.

A packed row holds several documents; a query attends only to the earlier tokens of its own document. The boundaries are
*global*: ``cu_seqlens = [0, l1, l1+l2, ..., S]`` over the full, unsharded row (int tensor, the same on every rank of
the group), one row for the whole batch or (B, n+1) with one row per batch row, a shorter row padded with repeats of S
(empty documents at the end). transformers' packed convention, position ids restarting at 0 at each document (as its
DataCollatorWithFlattening makes them), gives the same boundaries (``bounds_from_positions``).

``plan(cu_seqlens, S, B, group)`` checks them and returns a ``Documents`` (None for one document per row: then every mode
runs its plain causal path, bit for bit). Every check is local except one: that every rank of the group holds the same
boundaries, decided by one small all-gather of each rank's verdict and checksum, so a bad value raises the same one-line
SeqparError on every rank before any transfer. The result is cached per cu_seqlens tensor (every layer of a forward,
and backward's recomputation, reuse it: one check per batch).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from seqpar.plan.errors import SeqparError

Bounds = tuple[int, ...]  # [0, b1, ..., S], strictly increasing


@dataclass(frozen=True)
class Documents:
    """The checked boundaries of a batch: ``groups`` = ((rows, bounds), ...), rows None = every row of the batch
    (all rows share one set of boundaries), else the batch rows (a tuple of ints) that share ``bounds``."""

    S: int
    groups: tuple[tuple[tuple[int, ...] | None, Bounds], ...]
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-layout plans (seqpar.runtime.parallel.blocks)

    @property
    def shared(self) -> bool:
        return len(self.groups) == 1 and self.groups[0][0] is None


def doc_of(bounds: Bounds, pos: int) -> int:
    """Index of the document holding global position pos."""
    return bisect.bisect_right(bounds, pos) - 1


def clip(bounds: Bounds, a: int, b: int) -> Bounds:
    """Boundaries inside [a, b), shifted to start at 0: [0, ..., b - a]."""
    inner = bounds[bisect.bisect_right(bounds, a) : bisect.bisect_left(bounds, b)]
    return (0, *(x - a for x in inner), b - a)


# --------------------------------------------------------------------------------------------- checks


def _row_problem(row: list[int], S: int, where: str) -> str | None:
    """What is wrong with one row of boundaries, or None. Trailing repeats of S are padding."""
    rule = "cu_seqlens are global cumulative document lengths [0, l1, l1+l2, ..., S] over the unsharded sequence"
    if not row or row[0] != 0:
        return f"cu_seqlens{where} must start at 0, got {row[0] if row else 'nothing'} ({rule})"
    while len(row) > 2 and row[-1] == row[-2] == S:
        row = row[:-1]
    if row[-1] != S:
        return f"cu_seqlens{where} ends at {row[-1]} but the full sequence has S = {S} tokens ({rule}; S = local length x ranks)"
    for i in range(1, len(row)):
        if row[i] <= row[i - 1]:
            return f"cu_seqlens{where} must increase (every document holds a token), got {row[i - 1]} then {row[i]} at index {i}"
    return None


def bounds_of(cu_seqlens: Tensor, S: int, batch: int) -> tuple[list[Bounds] | None, str | None]:
    """(per-row boundaries, None) or (None, the one-line problem). Host copy of cu_seqlens (one sync)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.dim() not in (1, 2):
        what = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, Tensor) else type(cu_seqlens).__name__
        return None, f"cu_seqlens must be an integer tensor [0, l1, ..., S] (or one such row per batch row), got {what}"
    rows = cu_seqlens.tolist()
    if cu_seqlens.dim() == 1:
        rows = [rows] * batch
    elif len(rows) != batch:
        return None, f"cu_seqlens has {len(rows)} rows but the batch has {batch}; pass one row, or one per batch row"
    out = []
    for i, row in enumerate(rows):
        problem = _row_problem(row, S, f" (row {i})" if cu_seqlens.dim() == 2 else "")
        if problem:
            return None, problem
        while len(row) > 2 and row[-1] == row[-2]:
            row = row[:-1]
        out.append(tuple(int(x) for x in row))
    return out, None


def bounds_from_positions(position_ids: Tensor) -> list[Bounds]:
    """Per-row boundaries of (B, S) position ids in transformers' packed convention: each step is +1 (same document)
    or back to 0 (a new one); the first position may be anything (a document continued from an earlier window)."""
    pos = position_ids.detach().cpu().long()
    steps = pos[:, 1:] - pos[:, :-1]  # (B, S-1)
    new = pos[:, 1:] == 0
    bad = (steps != 1) & ~new
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise SeqparError(
            f"position_ids go from {int(pos[b, i])} to {int(pos[b, i + 1])} at index {i + 1} (row {b}); packed documents "
            "need positions that increase by 1 or restart at 0 at each document (transformers' DataCollatorWithFlattening)"
        )
    S = pos.shape[1]
    return [(0, *(int(i) + 1 for i in new[b].nonzero().flatten()), S) for b in range(pos.shape[0])]


def to_cu(rows: list[Bounds], device=None) -> Tensor:
    """The cu_seqlens tensor of per-row boundaries: one row when every row agrees, else (B, n+1) padded with S."""
    if all(r == rows[0] for r in rows):
        return torch.tensor(rows[0], dtype=torch.int32, device=device)
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


def make(rows: list[Bounds], S: int) -> Documents | None:
    """Documents of per-row boundaries; None when every row is one document (the plain causal path)."""
    if all(len(r) == 2 for r in rows):
        return None
    if all(r == rows[0] for r in rows):
        return Documents(S, ((None, rows[0]),))
    groups: dict[Bounds, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r, []).append(i)
    return Documents(S, tuple((tuple(idx), r) for r, idx in groups.items()))


def checksum(values: list[int]) -> int:
    """A cheap order-sensitive checksum of a list of ints (exact in Python integers)."""
    h = len(values)
    for x in values:
        h = (h * 1_000_003 + x) % (1 << 61)
    return h


def agree(problem: str | None, digest: int, group, what: str, fix: str) -> None:
    """Collective over the group: every rank raises the first rank's problem, or, when the digests differ, one line
    naming the ranks that differ from rank 0. One all_gather_object of two small values."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem:
            raise SeqparError(problem)
        return
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (problem, digest), group=group)
    first = next((p for p, _ in views if p), None)
    if first:
        raise SeqparError(first)
    differ = [r for r, (_, d) in enumerate(views) if d != views[0][1]]
    if differ:
        raise SeqparError(f"ranks {differ} of the sequence-parallel group hold {what} other than rank 0's; {fix}")


_CACHE = WeakTensorKeyDictionary()  # cu_seqlens tensor -> ((version, S, B, group), Documents | None, ranks agreed)


def plan(cu_seqlens: Tensor, S: int, batch: int, group=None, across_ranks: bool = True, agreed: bool = False) -> Documents | None:
    """Check cu_seqlens for a (B, S) batch (and, when across_ranks, that the group's ranks agree); Documents or None.
    agreed: the caller knows every rank holds the same boundaries (derived from gathered data): no collective."""
    key = (getattr(cu_seqlens, "_version", None), S, batch, id(group))
    hit = _CACHE.get(cu_seqlens) if isinstance(cu_seqlens, Tensor) else None
    if hit is not None and hit[0] == key and (hit[2] or not across_ranks):
        return hit[1]
    rows, problem = bounds_of(cu_seqlens, S, batch)
    if across_ranks and not agreed:
        agree(
            problem,
            checksum([x for r in rows for x in r]) if rows else 0,
            group,
            "cu_seqlens",
            "pass the same global boundaries on every rank (seqpar.prepare_inputs returns them)",
        )
    elif problem:
        raise SeqparError(problem)
    docs = make(rows, S)
    _CACHE[cu_seqlens] = (key, docs, across_ranks or agreed)
    return docs
