"""Packed-document boundaries of one transformers forward, for seqpar's attention function (seqpar.runtime.hf.apply).

transformers forwards the model's keyword arguments to attention functions (4.48+, 5.x), which is how its own varlen
kernels learn about packed sequences; seqpar reads the same two sources, in this order:
- ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers' names; they must agree): seqpar's GLOBAL boundaries
  ``[0, l1, ..., S]`` over the unsharded row, the "cu_seqlens" seqpar.prepare_inputs returns. For data_parallel and a
  row of one process they are exactly transformers' own (one flattened row, as DataCollatorWithFlattening makes it).
- else the ``position_ids`` every layer receives, restarting at 0 at each document. A rank holds its shard only, so the
  group all-gathers them (S/W integers per rank) and derives the boundaries of the whole row, the same on every rank
  by construction. Once per forward: the result is cached on the position ids tensor, which every layer and the
  recomputation under checkpointing receive.
None (one document per row) keeps the plain causal path.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import describe
from seqpar.runtime.parallel import documents

_FROM_POSITIONS = WeakTensorKeyDictionary()  # position ids -> (key, cu_seqlens or None)
_SAME_QK = WeakTensorKeyDictionary()  # cu_seq_lens_q -> (cu_seq_lens_k, equal)


def _whole(ctx) -> bool:
    return describe(ctx.mode).layout == "whole"


def _from_positions(ctx, position_ids: Tensor, batch: int) -> Tensor | None:
    key = (position_ids._version, batch, id(ctx.group))
    hit = _FROM_POSITIONS.get(position_ids)
    if hit is not None and hit[0] == key:
        return hit[1]
    pos = position_ids if position_ids.dim() == 2 else position_ids[None]  # (B or 1, s)
    if not _whole(ctx):
        from seqpar.runtime.parallel.comm import all_gather
        from seqpar.runtime.parallel.layout import unshard

        pos = unshard(all_gather(pos, ctx.group), ctx.mode, dim=1, ulysses_degree=ctx.ulysses_degree)  # (B or 1, S)
    rows = documents.bounds_from_positions(pos.expand(batch, -1))  # the same SeqparError on every rank: gathered data
    cu = None
    if any(len(r) > 2 for r in rows):
        cu = documents.to_cu(rows)
        documents.plan(cu, pos.shape[1], batch, ctx.group, across_ranks=not _whole(ctx), agreed=True)  # no second collective
    _FROM_POSITIONS[position_ids] = (key, cu)
    return cu


def boundaries(ctx, kwargs: dict, batch: int, local_len: int) -> Tensor | None:
    """The global cu_seqlens of this forward (see the module docstring), or None for one document per row."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and cu_k is not cu_q:
        hit = _SAME_QK.get(cu_q)
        if hit is None or hit[0] is not cu_k:
            hit = (cu_k, cu_q.shape == cu_k.shape and bool(torch.equal(cu_q.cpu(), cu_k.cpu())))
            _SAME_QK[cu_q] = hit
        if not hit[1]:
            raise SeqparError(
                f"{ctx.model_name}: cu_seq_lens_q and cu_seq_lens_k differ (cross attention); seqpar's packed documents "
                "attend within themselves: pass the same boundaries for both, or only cu_seq_lens_q"
            )
    cu = cu_q if cu_q is not None else cu_k
    if cu is not None:
        return cu
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, Tensor) and position_ids.shape[-1] == local_len:
        return _from_positions(ctx, position_ids, batch)
    return None
