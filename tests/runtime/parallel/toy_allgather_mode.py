"""A sixth mode in one module, to show that a mode is one registered description: all-gather of K/V (the Llama-3
context-parallel recipe's shape, without its load balancing).

Layout: contiguous chunk r of W (seqpar.runtime.parallel.layout, ``allgather_kv``). q (B, S/W, Hq, D); k, v
(B, S/W, Hkv, D); out like q; lse (B, Hq, S/W). Every rank gathers every rank's K and V chunk and runs its own queries
against the keys they may see: the earlier chunks whole, its own chunk causally (the kernels' diagonal block), folded
with the log-sum-exp merge. Backward gathers K and V again, computes each block's gradients against the merged out and
lse, and sums every rank's dK, dV of each chunk on the rank that owns it (an all-reduce, then its own chunk: gloo has
no reduce-scatter). Importing this module registers the mode (the ranks of a test import it through their function).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import ModeDescription, register
from seqpar.runtime.parallel import kernels
from seqpar.runtime.parallel.attention import attention
from seqpar.runtime.parallel.comm import all_gather, group_rank, group_size

DESCRIPTION = register(
    ModeDescription(
        name="allgather_kv",
        implementation="seqpar_allgather_kv",
        runtime=__name__,
        layout="contiguous",
        degrees="sequence",
        comm=("all_gather_kv",),
        balance="contiguous",
        summary="toy: every rank gathers all K/V and attends its own queries to the keys before them",
    )
)  # no export rows: no tool runs it, and `seqpar advise --emit` says so


def _blocks(k: Tensor, v: Tensor, group, causal: bool) -> list[tuple[Tensor, Tensor, bool]]:
    """(k, v, causal) of every chunk this rank's queries see: the earlier chunks whole, its own causally (all, not causal)."""
    r = group_rank(group)
    ks, vs = all_gather(k, group), all_gather(v, group)  # W x (B, S/W, Hkv, D)
    seen = range(r + 1) if causal else range(len(ks))
    return [(ks[j], vs[j], causal and j == r) for j in seen]


def forward(q, k, v, *, group, causal: bool, scale: float, backend: str, docs=None) -> tuple[Tensor, Tensor]:
    if docs is not None:
        raise SeqparError("allgather_kv is a toy mode without packed documents; pass cu_seqlens=None")
    out = lse = None
    for kb, vb, diagonal in _blocks(k, v, group, causal):
        o, l = kernels.attn_forward(q, kb, vb, causal=diagonal, softmax_scale=scale, backend=backend)
        out, lse = kernels.merge(out, lse, o, l)
    return out.to(q.dtype), lse


def backward(dout, q, k, v, out, lse, *, group, causal: bool, scale: float, backend: str, docs=None):
    blocks = _blocks(k, v, group, causal)
    W, r, n = group_size(group), group_rank(group), k.shape[1]
    dq = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
    dkv = torch.zeros((2, k.shape[0], W * n, *k.shape[2:]), dtype=dq.dtype, device=k.device)  # dK, dV of the whole sequence
    for j, (kb, vb, diagonal) in enumerate(blocks):
        g = kernels.attn_backward(dout, q, kb, vb, out, lse, causal=diagonal, softmax_scale=scale, backend=backend)
        dq += g[0]
        dkv[0, :, j * n : (j + 1) * n] += g[1]
        dkv[1, :, j * n : (j + 1) * n] += g[2]
    if W > 1:
        dist.all_reduce(dkv, group=group)  # every rank's share of each chunk's gradients
    dk, dv = dkv[:, :, r * n : (r + 1) * n]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def allgather_kv_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, cu_seqlens=None):
    """Exact attention over contiguous chunks by all-gathering K/V; returns (out, lse), out differentiable in q, k, v."""
    return attention(
        q, k, v, DESCRIPTION.name, group=group, causal=causal, softmax_scale=softmax_scale, backend=backend, cu_seqlens=cu_seqlens
    )
