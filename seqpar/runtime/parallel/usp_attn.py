"""usp_attn: Unified Sequence Parallelism, Ulysses inside groups of consecutive ranks and a zigzag ring across the groups.

Layout (seqpar.runtime.parallel.layout, ``usp_attn``): W = R x U ranks; the sequence is split zigzag over the R ring ranks (2R chunks,
ring rank i holds chunks i and 2R-1-i), then that part is split contiguously over the U Ulysses ranks of ring rank i;
group rank = ring_rank * U + ulysses_rank, so a Ulysses group is U consecutive ranks (the NVLink-near ones of one node under
torchrun's numbering) and a ring group is every U-th rank.
q (B, S/W, Hq, D); k, v (B, S/W, Hkv, D); out like q; lse (B, Hq, S/W).

Forward (Fang & Zhao, "USP: A Unified Sequence Parallelism Approach", arXiv:2405.07719; yunchang's LongContextAttention):
an all-to-all inside the Ulysses group turns (B, S/W, H, D) into (B, S/R, H/U, D), which is exactly ring rank i's zigzag part
of the sequence for H/U heads; zigzag ring attention (seqpar.runtime.parallel.zigzag_ring_attn) runs over the ring group on those heads;
an all-to-all brings out and lse back: ulysses_attn's head_split around zigzag_ring_attn's forward (and backward). Heads:
Hq % U == 0; KV heads split over U or, when Hkv < U with U % Hkv == 0, are replicated (see ulysses_attn). U = 1 is
zigzag_ring_attn and U = W is ulysses_attn with the same layouts, so those run directly.
The sub-groups are created once per (group, U) with torch.distributed.new_group, collectively and in the same order on every
rank, and cached (see ``subgroups``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import degrees
from seqpar.runtime.parallel.attention import Functions, attention, functions, plain
from seqpar.runtime.parallel.comm import group_rank, group_size
from seqpar.runtime.parallel.ulysses_attn import head_split, head_split_backward

_SUBGROUPS: dict[tuple[tuple[int, ...], int], tuple] = {}  # (global ranks of the parent group, U) -> (ulysses, ring)


def _split(ranks: tuple[int, ...], U: int) -> tuple[list[list[int]], list[list[int]]]:
    """Ulysses sets (U consecutive ranks each) and ring sets (every U-th rank) of one sequence-parallel group."""
    return [list(ranks[i : i + U]) for i in range(0, len(ranks), U)], [list(ranks[u::U]) for u in range(U)]


def create_subgroups(sp_groups: list[list[int]], ulysses_degree: int, backend: str | None = None) -> None:
    """Create and cache the sub-groups of every sequence-parallel group of the job at once (plain new_group, the same
    order everywhere). Call it on every process with the same arguments, right after creating the sp groups, when
    they do not span the job (dp x sp): then one group's ranks cannot safely create them by themselves."""
    me = dist.get_rank()
    for ranks in (tuple(sorted(g)) for g in sp_groups):
        uly_sets, ring_sets = _split(ranks, ulysses_degree)
        made = [dist.new_group(r, backend=backend) for r in uly_sets + ring_sets]  # every process, every group
        if me in ranks:
            ring_rank, uly_rank = divmod(ranks.index(me), ulysses_degree)
            _SUBGROUPS[(ranks, ulysses_degree)] = (made[ring_rank], made[len(uly_sets) + uly_rank])


def subgroups(group, ulysses_degree: int):
    """(Ulysses group, ring group) of this rank inside ``group``: U consecutive ranks, and every U-th rank. Cached.

    Collective on first use for a (group, U), unless ``create_subgroups`` made them. When ``group`` spans every process,
    every rank creates every sub-group in the same order (plain new_group). Otherwise only the group's members take
    part, with ``use_local_synchronization``: torch names such groups from their ranks and the number of groups the
    process already knows, so members that know different numbers would wait on each other forever; that is checked
    first and raised on every member with the fix (``create_subgroups``).
    """
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (ranks, ulysses_degree)
    if key not in _SUBGROUPS:
        U, R = ulysses_degree, len(ranks) // ulysses_degree
        ring_rank, uly_rank = divmod(group_rank(group), U)
        uly_sets, ring_sets = _split(ranks, U)
        backend = dist.get_backend(group)  # gloo parent -> gloo sub-groups (host staging for CUDA tensors keeps working)
        if len(ranks) == dist.get_world_size():
            made = [dist.new_group(r, backend=backend) for r in uly_sets + ring_sets]  # same order on every rank
            _SUBGROUPS[key] = (made[ring_rank], made[R + uly_rank])
        else:
            known = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
            if known is not None:
                counts: list = [None] * len(ranks)
                dist.all_gather_object(counts, len(known), group=group)
                if len(set(counts)) > 1:
                    raise SeqparError(
                        f"usp_attn cannot create the sub-groups of group {list(ranks)} from inside it: its ranks know "
                        f"different numbers of process groups ({counts}); call seqpar.runtime.parallel.usp_attn.create_subgroups"
                        f"(all sp groups, {U}) on every process after creating the sp groups"
                    )
            _SUBGROUPS[key] = tuple(
                dist.new_group(r, backend=backend, use_local_synchronization=True)
                for r in (uly_sets[ring_rank], ring_sets[uly_rank])
            )
    return _SUBGROUPS[key]


def _inner(group, ulysses_degree: int, causal: bool, scale: float, backend: str, docs) -> tuple[int, object, Functions]:
    """(U, this rank's Ulysses group, the attention the heads are split around). U = 1: no head split. Packed documents
    keep their global boundaries: after the head split a ring rank holds its zigzag part of the whole sequence."""
    R, U = degrees("usp_attn", group_size(group), ulysses_degree)
    kw = dict(causal=causal, scale=scale, backend=backend, **({} if docs is None else {"docs": docs}))
    if U == 1:  # zigzag_ring_attn over the whole group, same layout
        return U, None, functions("zigzag_ring_attn", group=group, **kw)
    if R == 1:  # ulysses_attn over the whole group, same layout
        return U, group, functions("data_parallel", **kw)
    uly_group, ring_group = subgroups(group, U)
    return U, uly_group, functions("zigzag_ring_attn", group=ring_group, **kw)


def forward(
    q, k, v, *, group, causal: bool, scale: float, backend: str, ulysses_degree: int, docs=None, attend=plain
) -> tuple[Tensor, Tensor]:
    """Ulysses inside the group of U consecutive ranks around the zigzag ring over every U-th rank: out (B, S/W, Hq, D)
    in q's dtype, lse (B, Hq, S/W)."""
    U, uly_group, inner = _inner(group, ulysses_degree, causal, scale, backend, docs)
    if U == 1:
        return attend(inner)(q, k, v)
    return head_split(q, k, v, uly_group, inner, attend)  # the ring runs on (B, S/R, Hq/U, D): its zigzag part, H/U heads


def backward(
    dout, q, k, v, out, lse, *, group, causal: bool, scale: float, backend: str, ulysses_degree: int, docs=None
) -> tuple[Tensor, Tensor, Tensor]:
    U, uly_group, inner = _inner(group, ulysses_degree, causal, scale, backend, docs)
    if U == 1:
        return inner.backward(dout, q, k, v, out, lse)
    return head_split_backward(dout, q, k, v, out, lse, uly_group, inner)


def usp_attn_attention(
    q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, ulysses_degree: int | None = None, cu_seqlens=None
) -> tuple[Tensor, Tensor]:
    """Exact attention over a sequence in the usp_attn layout; returns (out, lse) in this rank's layout.

    q (B, S/W, Hq, D); k, v (B, S/W, Hkv, D) -> out (B, S/W, Hq, D), lse (B, Hq, S/W). ulysses_degree U must divide W.
    cu_seqlens: global document boundaries (seqpar.runtime.parallel.attention).
    """
    return attention(
        q,
        k,
        v,
        "usp_attn",
        group=group,
        causal=causal,
        softmax_scale=softmax_scale,
        ulysses_degree=ulysses_degree,
        backend=backend,
        cu_seqlens=cu_seqlens,
    )
