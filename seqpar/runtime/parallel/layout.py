"""Which part of a full-length sequence each rank holds, per mode: ``shard`` and its exact inverse ``unshard``.

- ``zigzag_ring_attn``: split into 2W chunks; rank r holds chunks r and 2W-1-r (balanced causal work, as in
  ring-flash-attention and PyTorch CP's head-tail load balancer).
- ``dist_flash_attn`` and ``ulysses_attn``: contiguous chunk r of W.
- ``usp_attn``: the zigzag split over the R = W/U ring ranks, then a contiguous split of that ring rank's part over its
  U Ulysses ranks; global rank = ring_rank * U + ulysses_rank (Ulysses groups are consecutive ranks).
- ``data_parallel``: the whole tensor.
Any tensor dim can be the sequence dim (``dim=1`` for (B, S, ...) activations). Lengths a mode cannot split raise
SeqparError with the nearest valid lengths (seqpar.plan.modes.check_split: the same rule the plan and the advisor use).
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import check_split, degrees, describe


def _zigzag_shard(x: Tensor, rank: int, n: int, dim: int) -> Tensor:
    chunks = x.chunk(2 * n, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim=dim)


def _zigzag_unshard(parts: list[Tensor], dim: int) -> Tensor:
    n = len(parts)
    chunks: list[Tensor | None] = [None] * (2 * n)
    for r, p in enumerate(parts):
        chunks[r], chunks[2 * n - 1 - r] = p.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def shard(x: Tensor, mode: str, rank: int, world_size: int, dim: int = 1, ulysses_degree: int | None = None) -> Tensor:
    """This rank's part of the full-length tensor x along dim, in the mode's layout (a new contiguous tensor or x)."""
    ring, uly = degrees(mode, world_size, ulysses_degree)
    if not 0 <= rank < world_size:
        raise SeqparError(f"rank {rank} is outside 0..{world_size - 1}")
    dim %= x.dim()
    check_split(mode, x.shape[dim], world_size, ulysses_degree)
    layout = describe(mode).layout
    if layout == "whole":
        return x
    if layout == "contiguous":
        return x.chunk(world_size, dim=dim)[rank].contiguous()
    ring_rank, uly_rank = divmod(rank, uly)
    local = _zigzag_shard(x, ring_rank, ring, dim)  # zigzag_ring_attn: uly == 1, so this is the answer
    return local if uly == 1 else local.chunk(uly, dim=dim)[uly_rank].contiguous()


def unshard(parts: list[Tensor], mode: str, dim: int = 1, ulysses_degree: int | None = None) -> Tensor:
    """The full-length tensor from every rank's part, in rank order: the exact inverse of shard."""
    world_size = len(parts)
    ring, uly = degrees(mode, world_size, ulysses_degree)
    dim %= parts[0].dim()
    layout = describe(mode).layout
    if layout == "whole":
        return parts[0]
    if layout == "contiguous":
        return torch.cat(list(parts), dim=dim)
    ring_parts = [torch.cat(list(parts[r * uly : (r + 1) * uly]), dim=dim) for r in range(ring)]
    return _zigzag_unshard(ring_parts, dim)
