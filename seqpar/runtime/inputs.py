"""Per-rank inputs for a sequence-parallel step: ``prepare_inputs`` (``seqpar.prepare_inputs``), for any model.

``prepare_inputs`` shifts the labels over the whole sequence first (so the token at a shard's edge is still predicted
from its true successor), builds global position ids (RoPE must see the token's position in the full sequence), then
splits input ids, position ids and labels with ``seqpar.runtime.layout.shard`` in the mode's layout. Tensors are
(B, S) on the way in and (B, S_local) on the way out. EasyContext's variant is seqpar.runtime.easycontext.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.errors import SeqparError
from seqpar.modes import check_mode
from seqpar.runtime.layout import shard
from seqpar.runtime.loss import IGNORE_INDEX


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


def _check_positions(position_ids: Tensor) -> None:
    # The kernels apply one causal mask over the whole row: positions restarting mean packed documents, which
    # transformers would mask per document, so the results would differ. Refuse rather than train on the wrong mask.
    steps = torch.diff(position_ids, dim=-1)  # (B, S-1)
    if steps.numel() and not bool((steps == 1).all()):
        where = int((steps != 1).nonzero()[0, -1]) + 1
        raise SeqparError(
            f"position_ids do not increase by 1 at index {where} (packed documents?); seqpar applies one causal mask "
            "per row, so pass one document per row with consecutive positions"
        )


def prepare_inputs(
    input_ids: Tensor,
    mode: str,
    rank: int,
    world_size: int,
    labels: Tensor | None = None,
    position_ids: Tensor | None = None,
    ulysses_degree: int | None = None,
) -> dict[str, Tensor]:
    """This rank's {"input_ids", "position_ids", "labels"} (each (B, S_local)) of a full (B, S) batch.

    labels: transformers' convention (unshifted; default input_ids); they are shifted over the whole sequence here, so
    call the model without labels and compute the loss with seqpar.loss. position_ids: global, default 0..S-1.
    Lengths the mode cannot split raise SeqparError with the nearest valid lengths."""
    check_ids(input_ids, mode, rank, world_size)
    batch, seq_len = input_ids.shape
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape:
        raise SeqparError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device)[None]  # (1, S)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.shape[-1] != seq_len:
        raise SeqparError(f"position_ids {tuple(position_ids.shape)} must have seq_len {seq_len} like input_ids")
    _check_positions(position_ids)
    position_ids = position_ids.expand(batch, seq_len)  # (B, S)
    full = {"input_ids": input_ids, "position_ids": position_ids, "labels": shift_labels(labels)}
    return {k: shard(v, mode, rank, world_size, dim=1, ulysses_degree=ulysses_degree) for k, v in full.items()}
