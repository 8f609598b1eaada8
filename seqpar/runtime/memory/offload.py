"""Host offload of checkpointed layer inputs (``checkpointing: offload``), with a pinned-memory budget.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` pins every saved tensor through PyTorch's caching host allocator,
which rounds each block up to a power of two: a Llama-2-7B layer input at 384K tokens (3 GiB) takes a 4 GiB pinned block,
so 32 layers would ask for 128 GiB of page-locked host RAM and the run dies far below the host's real capacity.
``HostOffload`` pins while the rounded pinned bytes it holds stay within a budget (default: 40% of the host's physical
RAM shared by the node's ranks; the plan's pinned_host_gib or ``SEQPAR_PINNED_BUDGET_GIB`` state another) and puts the rest in ordinary pageable memory: those copies are synchronous
and slower (pageable PCIe ~10-20 GB/s against ~25-50 pinned), which only the longest sequences reach, where attention
dominates the step. CPU tensors are kept as they are.

``offload_stride`` k > 1: seqpar.runtime.memory.strided_offload (one layer input in k to host memory, built on
``to_host`` / ``from_host`` here).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

import torch
from torch import Tensor

from seqpar.plan.options import PINNED_FRACTION, pinned_block
from seqpar.plan.units import GIB


def _physical_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * GIB


def pinned_budget(gib: float | None = None) -> int:
    """Page-locked bytes this process may hold: ``gib`` (the plan's ClusterSpec.stated_pinned_gib_per_rank, seqpar.apply's
    pinned_budget_gib), else SEQPAR_PINNED_BUDGET_GIB (per process), else 40% of the host's RAM shared by the node's
    ranks (torchrun's LOCAL_WORLD_SIZE)."""
    if gib is not None:
        return int(gib * GIB)
    env = os.environ.get("SEQPAR_PINNED_BUDGET_GIB")
    if env:
        return int(float(env) * GIB)
    return int(PINNED_FRACTION * _physical_ram() / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1))


# Callables ``reclaim(nbytes)`` that unpin idle page-locked blocks counted in HostOffload.held (the pool of
# seqpar.runtime.memory.matmul_keep registers one): asked when a pack would pass the budget, before it falls back to pageable.
RECLAIMERS: list = []


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """saved_tensors_hooks moving CUDA tensors to host memory until backward needs them (pinned within a budget)."""

    held = 0  # rounded pinned bytes held by live offloaded tensors, all instances together
    stats = {"pinned": 0, "pageable": 0}  # bytes offloaded each way since import (tests and logs read it)

    def __init__(self, budget: int | None = None):
        budget = pinned_budget() if budget is None else budget
        super().__init__(functools.partial(to_host, budget=budget), from_host)

    @staticmethod
    def _release(nbytes: int) -> None:
        HostOffload.held -= nbytes


def to_host(t: Tensor, budget: int) -> Any:
    """HostOffload's pack: a CUDA tensor's host copy (pinned while HostOffload.held stays within ``budget`` bytes) as
    (device, host tensor, pinned); any other tensor as it is."""
    if not t.is_cuda:
        return t
    nbytes = t.numel() * t.element_size()
    over = HostOffload.held + pinned_block(nbytes) - budget
    if over > 0:
        for reclaim in RECLAIMERS:  # idle pinned blocks of the kept matmul outputs' pool
            reclaim(over)
    pin = HostOffload.held + pinned_block(nbytes) <= budget
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    if pin:
        HostOffload.held += pinned_block(nbytes)
        weakref.finalize(host, HostOffload._release, pinned_block(nbytes))
    HostOffload.stats["pinned" if pin else "pageable"] += nbytes
    return (t.device, host, pin)


def from_host(packed: Any) -> Tensor:
    """HostOffload's unpack: the tensor ``to_host`` packed, back on its device."""
    if isinstance(packed, Tensor):
        return packed
    device, host, pin = packed
    return host.to(device, non_blocking=pin)
