"""Which part of a full-length sequence each rank holds, per mode: ``shard`` and its exact inverse ``unshard``.

- ``zigzag_ring_attn``: split into 2W chunks; rank r holds chunks r and 2W-1-r (balanced causal work, as in
  ring-flash-attention and PyTorch CP's head-tail load balancer).
- ``dist_flash_attn`` and ``ulysses_attn``: contiguous chunk r of W.
- ``usp_attn``: the zigzag split over the R = W/U ring ranks, then a contiguous split of that ring rank's part over its
  U Ulysses ranks; global rank = ring_rank * U + ulysses_rank (Ulysses groups are consecutive ranks).
- ``data_parallel``: the whole tensor.
Any tensor dim can be the sequence dim (``dim=1`` for (B, S, ...) activations). Lengths a mode cannot split raise
seqpar.schema's SeqparError with the nearest valid lengths (schema.check_split, imported only then: it needs pydantic).
"""

from __future__ import annotations

import torch
from torch import Tensor

MODES = ("data_parallel", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")


def _error(msg: str) -> Exception:
    from seqpar.runtime.kernels import _error as make

    return make(msg)


def degrees(mode: str, world_size: int, ulysses_degree: int | None = None) -> tuple[int, int]:
    """(ring_degree, ulysses_degree) of a mode over world_size ranks; validates the mode and the degrees."""
    if mode not in MODES:
        raise _error(f"mode {mode!r} is unknown; use one of {', '.join(MODES)}")
    if world_size < 1:
        raise _error(f"world_size must be >= 1, got {world_size}")
    if mode == "usp_attn":
        if ulysses_degree is None or ulysses_degree < 1 or world_size % ulysses_degree:
            raise _error(
                f"usp_attn needs ulysses_degree dividing world_size {world_size}, got {ulysses_degree}; "
                f"pick one of {[u for u in range(1, world_size + 1) if world_size % u == 0]}"
            )
        return world_size // ulysses_degree, ulysses_degree
    if mode == "zigzag_ring_attn":
        return world_size, 1
    if mode == "ulysses_attn":
        return 1, world_size
    return (world_size, 1) if mode == "dist_flash_attn" else (1, 1)


def required_multiple(mode: str, world_size: int, ulysses_degree: int | None = None) -> int:
    """The number a sequence length must be a multiple of for this mode (same rule as seqpar.schema.seq_len_multiple)."""
    ring, uly = degrees(mode, world_size, ulysses_degree)
    return {"data_parallel": 1, "zigzag_ring_attn": 2 * ring, "usp_attn": 2 * ring * uly}.get(mode, world_size)


def check_length(mode: str, seq_len: int, world_size: int, ulysses_degree: int | None = None) -> None:
    """SeqparError (one line, nearest valid lengths) when the mode cannot split seq_len over world_size ranks."""
    ring, uly = degrees(mode, world_size, ulysses_degree)
    if seq_len < 1 or seq_len % required_multiple(mode, world_size, ulysses_degree):
        from seqpar.schema import check_split  # lazy: pydantic is only needed to report the error

        check_split(mode, max(seq_len, 1), world_size if mode != "usp_attn" else ring * uly, uly, ring)
        raise _error(f"seq_len {seq_len} must be positive")


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
        raise _error(f"rank {rank} is outside 0..{world_size - 1}")
    dim %= x.dim()
    check_length(mode, x.shape[dim], world_size, ulysses_degree)
    if mode == "data_parallel":
        return x
    if mode in ("dist_flash_attn", "ulysses_attn"):
        return x.chunk(world_size, dim=dim)[rank].contiguous()
    ring_rank, uly_rank = divmod(rank, uly)
    local = _zigzag_shard(x, ring_rank, ring, dim)  # zigzag_ring_attn: uly == 1, so this is the answer
    return local if uly == 1 else local.chunk(uly, dim=dim)[uly_rank].contiguous()


def unshard(parts: list[Tensor], mode: str, dim: int = 1, ulysses_degree: int | None = None) -> Tensor:
    """The full-length tensor from every rank's part, in rank order: the exact inverse of shard."""
    world_size = len(parts)
    ring, uly = degrees(mode, world_size, ulysses_degree)
    dim %= parts[0].dim()
    if mode == "data_parallel":
        return parts[0]
    if mode in ("dist_flash_attn", "ulysses_attn"):
        return torch.cat(list(parts), dim=dim)
    ring_parts = [torch.cat(list(parts[r * uly : (r + 1) * uly]), dim=dim) for r in range(ring)]
    return _zigzag_unshard(ring_parts, dim)
