"""ulysses_attn: DeepSpeed-Ulysses sequence parallelism: trade the sequence split for a head split around local attention.

Layout: rank r of P holds contiguous chunk r of the sequence (seqpar.runtime.layout, ``ulysses_attn``).
q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D); out like q; lse (B, Hq, S/P).

One all-to-all per tensor turns (B, S/P, H, D) into (B, S, H/P, D): every rank then holds the whole sequence for H/P heads
and runs ordinary local attention on it (any kernel, causal or not, no ring); one all-to-all brings out (and lse) back to the
sequence split (Jacobs et al., "DeepSpeed Ulysses", arXiv:2309.14509). Each all-to-all moves (P-1)/P of a tensor per rank,
independent of the causal mask. The backward is autograd's: the all-to-alls are differentiable (their gradient is the inverse
all-to-all) and local attention is an autograd Function.

Heads decide whether Ulysses applies: Hq must split over P; KV heads split when Hkv % P == 0, and when Hkv < P with
P % Hkv == 0 each KV head is replicated P/Hkv times before the all-to-all (as DeepSpeed and ALST do), so every rank receives
the one KV head its query heads use; autograd sums the replicas' gradients back. Anything else raises SeqparError before any
transfer, naming the numbers and the modes that do apply (usp_attn with a smaller Ulysses degree, or zigzag_ring_attn).
"""

from __future__ import annotations

from torch import Tensor

from seqpar.errors import SeqparError
from seqpar.modes import check_heads
from seqpar.runtime import kernels
from seqpar.runtime.comm import all_to_all, group_size


def replicate_kv(x: Tensor, degree: int) -> Tensor:
    """(B, s, Hkv, D) -> (B, s, degree, D) when Hkv < degree: head i of the result is KV head i // (degree / Hkv), which is
    exactly the KV head of the query heads rank i receives. A copy (autograd sums its gradient back); else x itself."""
    hkv = x.shape[2]
    return x if hkv >= degree else x.repeat_interleave(degree // hkv, dim=2)


def heads_to_seq(x: Tensor, group) -> Tensor:
    """(B, S/P, H, D) sequence-split -> (B, S, H/P, D) head-split (differentiable)."""
    return all_to_all(x, scatter_dim=2, gather_dim=1, group=group)


def seq_to_heads(x: Tensor, group) -> Tensor:
    """(B, S, H/P, D) head-split -> (B, S/P, H, D) sequence-split (differentiable)."""
    return all_to_all(x, scatter_dim=1, gather_dim=2, group=group)


def lse_to_seq_split(lse: Tensor, group) -> Tensor:
    """(B, H/P, S) -> (B, H, S/P): lse follows out back to the sequence split (no gradient)."""
    return all_to_all(lse.detach(), scatter_dim=2, gather_dim=1, group=group)


def ulysses_attn_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None) -> tuple[Tensor, Tensor]:
    """Exact attention over contiguous sequence chunks by all-to-all head exchange; returns (out, lse) in this rank's layout.

    q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D) -> out (B, S/P, Hq, D), lse (B, Hq, S/P).
    """
    P = group_size(group)
    kernels._check(q, k, v, causal=False)  # every rank holds the same shapes, so every rank raises the same error
    if q.shape[1] != k.shape[1]:
        raise SeqparError(
            f"ulysses_attn needs q and k,v chunks of the same length, got {q.shape[1]} and {k.shape[1]}; shard q, k, v alike"
        )
    check_heads("ulysses_attn", q.shape[2], k.shape[2], P)
    if P == 1:
        return kernels.local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend)
    qh = heads_to_seq(q, group)  # (B, S, Hq/P, D)
    kh = heads_to_seq(replicate_kv(k, P), group)  # (B, S, max(Hkv/P, 1), D)
    vh = heads_to_seq(replicate_kv(v, P), group)
    out, lse = kernels.local_attention(qh, kh, vh, causal=causal, softmax_scale=softmax_scale, backend=backend)
    return seq_to_heads(out, group), lse_to_seq_split(lse, group)  # (B, S/P, Hq, D), (B, Hq, S/P)
