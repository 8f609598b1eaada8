"""Per-rank inputs for a sequence-parallel step: ``prepare_inputs`` (``seqpar.prepare_inputs``), for any model.

``prepare_inputs`` shifts the labels over the whole sequence first (so the token at a shard's edge is still predicted
from its true successor), builds global position ids (RoPE must see the token's position in the full sequence), then
splits input ids, position ids and labels with ``seqpar.runtime.parallel.layout.shard`` in the mode's layout. Tensors are
(B, S) on the way in and (B, S_local) on the way out. EasyContext's variant is seqpar.runtime.hf.easycontext.

Packed documents: position ids in transformers' packed convention (restarting at 0 at each document, as its
DataCollatorWithFlattening makes them) or ``cu_seqlens`` give the boundaries. Then the position ids stay the
within-document ones (what RoPE must see), the last token of each document predicts nothing (label -100: a document on
its own has no successor there), and the output gains ``"cu_seqlens"``, the global boundaries (seqpar.runtime.parallel.documents)
that seqpar's attention reads. ``balance=True`` reorders the documents of each row so the ranks' attention work evens
out (seqpar.runtime.parallel.balance; exact: documents are independent and the loss is a sum over tokens).
``check_group``: every rank of a sequence-parallel group must hold the same full batch; one all-gather of checksums
stops a run whose ranks differ (e.g. a sampler seeded with the global rank) with one line naming them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_mode, describe
from seqpar.runtime.parallel import documents
from seqpar.runtime.parallel.layout import shard
from seqpar.runtime.parallel.loss import IGNORE_INDEX


def shift_labels(labels: Tensor) -> Tensor:
    """(B, S) labels in transformers' convention (label i = token i) -> target of position i = label i+1; last -100."""
    pad = labels.new_full((labels.shape[0], 1), IGNORE_INDEX)  # (B, 1)
    return torch.cat([labels[:, 1:], pad], dim=1)  # (B, S)


def check_ids(input_ids: Tensor, mode: str, rank: int, world_size: int) -> None:
    """SeqparError unless mode is known, input_ids is (batch, seq_len) and rank is inside world_size."""
    check_mode(mode)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise SeqparError(f"input_ids {shape} must be a (batch, seq_len) tensor; add a batch dim with input_ids[None]")
    if not 0 <= rank < world_size:
        raise SeqparError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")


def _doc_positions(rows: list[documents.Bounds], device) -> Tensor:
    """(B, S) position ids restarting at 0 at each document."""
    out = []
    for bounds in rows:
        out.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return torch.stack(out).to(device)


def _boundaries(position_ids: Tensor | None, cu_seqlens: Tensor | None, batch: int, seq_len: int) -> list[documents.Bounds]:
    """Per-row boundaries from position ids (packed convention) and/or cu_seqlens, which must then agree."""
    rows = None
    if cu_seqlens is not None:
        rows, problem = documents.bounds_of(cu_seqlens, seq_len, batch)
        if problem:
            raise SeqparError(problem)
    if position_ids is not None:
        from_pos = documents.bounds_from_positions(position_ids)
        if rows is not None and any(len(p) > 2 and p != r for p, r in zip(from_pos, rows)):
            raise SeqparError(
                "position_ids restart at other places than cu_seqlens says documents start; pass one of them, or both alike"
            )
        rows = rows or from_pos
    return rows or [(0, seq_len)] * batch


def _check_scored(labels: Tensor) -> None:
    scored = (labels != IGNORE_INDEX).any(dim=1)  # (B,)
    if not bool(scored.all()):
        row = int((~scored).nonzero()[0])
        raise SeqparError(
            f"row {row} of the batch scores no token (every label -100 after shifting, and masking the last token of "
            "each document): drop that window or unmask some of its labels"
        )


def _reorder(full: dict[str, Tensor], rows: list[documents.Bounds], mode: str, world_size: int, uly: int | None):
    """Documents of each row in seqpar.runtime.parallel.balance's order: (tensors, new boundaries)."""
    from seqpar.runtime.parallel.balance import balanced_order

    new_rows, index = [], []
    for bounds in rows:
        docs = list(zip(bounds, bounds[1:]))
        order = balanced_order([b - a for a, b in docs], mode, world_size, uly)
        index.append(torch.cat([torch.arange(*docs[i]) for i in order]))
        new = [0]
        for i in order:
            new.append(new[-1] + docs[i][1] - docs[i][0])
        new_rows.append(tuple(new))
    idx = torch.stack(index)  # (B, S): token i of the new row is token idx[b, i] of the old one
    return {k: v.gather(1, idx.to(v.device)) for k, v in full.items()}, new_rows


def check_same_batch(group, **tensors: Tensor) -> None:
    """Collective over the group: SeqparError on every rank, naming the ranks whose tensors differ from rank 0's.
    A checksum per tensor (shape, sum, position-weighted sum in int64: exact for ids below 2^20 and rows of up to 2M
    tokens), one all-gather of those few integers."""
    digest = []
    for t in tensors.values():
        x = t.reshape(-1).long()
        w = torch.arange(x.numel(), device=x.device) % 65521 + 1
        digest += [*t.shape, int(x.sum()), int((x * w).sum())]
    documents.agree(
        None,
        documents.checksum(digest),
        group,
        f"a batch ({', '.join(tensors)})",
        "every rank of a sequence-parallel group must load the same full batch (seed its sampler with the data-parallel "
        "rank, not the global rank)",
    )


def prepare_inputs(
    input_ids: Tensor,
    mode: str,
    rank: int,
    world_size: int,
    labels: Tensor | None = None,
    position_ids: Tensor | None = None,
    ulysses_degree: int | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    balance: bool = False,
    check_group=None,
    require_scored: bool = True,
) -> dict[str, Tensor]:
    """This rank's {"input_ids", "position_ids", "labels"} (each (B, S_local)) of a full (B, S) batch, and for packed
    documents "cu_seqlens" (global boundaries, (n+1,), or (B, n+1) when rows differ).

    labels: transformers' convention (unshifted; default input_ids); they are shifted over the whole sequence here, so
    call the model without labels and compute the loss with seqpar.loss. position_ids: global (default 0..S-1), or
    restarting at 0 at each document (packed). cu_seqlens: the documents' boundaries [0, l1, l1+l2, ..., S] instead of
    (or agreeing with) packed position ids. balance: reorder documents to even the ranks' attention work. check_group:
    verify (collectively) that every rank of this group passed the same batch. require_scored: a row that scores no
    token is an error (a training window with nothing to learn); False lets it count nothing (a Trainer's batch of
    packed chats, where a row may hold no assistant token). Lengths the mode cannot split raise SeqparError with the
    nearest valid lengths."""
    check_ids(input_ids, mode, rank, world_size)
    batch, seq_len = input_ids.shape
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape:
        raise SeqparError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if position_ids is not None:
        position_ids = position_ids[None] if position_ids.dim() == 1 else position_ids
        if position_ids.shape[-1] != seq_len:
            raise SeqparError(f"position_ids {tuple(position_ids.shape)} must have seq_len {seq_len} like input_ids")
        position_ids = position_ids.expand(batch, seq_len)  # (B, S)
    if check_group is not None and describe(mode).layout != "whole":  # data_parallel ranks hold different rows by design
        given = {"input_ids": input_ids, "labels": labels}
        given.update({} if position_ids is None else {"position_ids": position_ids})
        given.update({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens})
        check_same_batch(check_group, **given)
    rows = _boundaries(position_ids, cu_seqlens, batch, seq_len)
    packed = any(len(r) > 2 for r in rows)
    if position_ids is None:
        position_ids = _doc_positions(rows, input_ids.device) if packed else torch.arange(seq_len, device=input_ids.device)[None]
        position_ids = position_ids.expand(batch, seq_len)
    targets = shift_labels(labels)
    if packed:  # a document's last token has no successor of its own
        for b, bounds in enumerate(rows):
            targets[b, [x - 1 for x in bounds[1:]]] = IGNORE_INDEX
    if require_scored and (labels is not input_ids or packed):
        _check_scored(targets)
    full = {"input_ids": input_ids, "position_ids": position_ids, "labels": targets}
    if packed and balance:
        full, rows = _reorder(full, rows, mode, world_size, ulysses_degree)
    out = {k: shard(v, mode, rank, world_size, dim=1, ulysses_degree=ulysses_degree) for k, v in full.items()}
    if packed:
        out["cu_seqlens"] = documents.to_cu(rows, device=input_ids.device)
    return out
