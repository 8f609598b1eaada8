"""ulysses_attn: DeepSpeed-Ulysses sequence parallelism: trade the sequence split for a head split around local attention.

Layout: rank r of P holds contiguous chunk r of the sequence (seqpar.runtime.parallel.layout, ``ulysses_attn``).
q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D); out like q; lse (B, Hq, S/P).

One all-to-all per tensor turns (B, S/P, H, D) into (B, S, H/P, D): every rank then holds the whole sequence for H/P heads
and runs an inner attention on it (local attention here, any kernel, causal or not; a zigzag ring for usp_attn); one
all-to-all brings out (and lse) back to the sequence split (Jacobs et al., "DeepSpeed Ulysses", arXiv:2309.14509). Each
all-to-all moves (P-1)/P of a tensor per rank, independent of the causal mask.

``head_split`` is that forward, written once for both paths (seqpar.runtime.parallel.attention): ``attend=differentiable`` runs the
inner mode in the autograd Function and the all-to-alls are differentiable (their gradient is the inverse all-to-all), so
backward sends dout and dq, dk, dv only; ``attend=plain`` is the plain forward, and ``head_split_backward`` its backward,
which sends q, k, v, dout and out across again (selective checkpointing keeps nothing head-split).

Heads decide whether Ulysses applies: Hq must split over P; KV heads split when Hkv % P == 0, and when Hkv < P with
P % Hkv == 0 each KV head is replicated P/Hkv times before the all-to-all (as DeepSpeed and ALST do), so every rank receives
the one KV head its query heads use; the replicas' gradients are summed back. Anything else is refused (seqpar.plan.modes.check_heads)
before any transfer, naming the numbers and the modes that do apply.
"""

from __future__ import annotations

from torch import Tensor

from seqpar.runtime.parallel.attention import Functions, attention, functions, plain
from seqpar.runtime.parallel.comm import all_to_all, group_size


def replicate_kv(x: Tensor, degree: int) -> Tensor:
    """(B, s, Hkv, D) -> (B, s, degree, D) when Hkv < degree: head i of the result is KV head i // (degree / Hkv), which is
    exactly the KV head of the query heads rank i receives. A copy (autograd sums its gradient back); else x itself."""
    hkv = x.shape[2]
    return x if hkv >= degree else x.repeat_interleave(degree // hkv, dim=2)


def _fold_replicas(dx: Tensor, hkv: int) -> Tensor:
    """Gradient of replicate_kv: (B, s, P, D) with P/hkv replicas of each KV head -> (B, s, hkv, D) summed over them."""
    B, s, P, D = dx.shape
    return dx if P == hkv else dx.view(B, s, hkv, P // hkv, D).sum(3)


def heads_to_seq(x: Tensor, group) -> Tensor:
    """(B, S/P, H, D) sequence-split -> (B, S, H/P, D) head-split (differentiable)."""
    return all_to_all(x, scatter_dim=2, gather_dim=1, group=group)


def seq_to_heads(x: Tensor, group) -> Tensor:
    """(B, S, H/P, D) head-split -> (B, S/P, H, D) sequence-split (differentiable)."""
    return all_to_all(x, scatter_dim=1, gather_dim=2, group=group)


def lse_to_seq_split(lse: Tensor, group) -> Tensor:
    """(B, H/P, S) -> (B, H, S/P): lse follows out back to the sequence split (no gradient)."""
    return all_to_all(lse.detach(), scatter_dim=2, gather_dim=1, group=group)


def _split_qkv(q: Tensor, k: Tensor, v: Tensor, group) -> tuple[Tensor, Tensor, Tensor]:
    P = group_size(group)
    return heads_to_seq(q, group), heads_to_seq(replicate_kv(k, P), group), heads_to_seq(replicate_kv(v, P), group)


def head_split(q: Tensor, k: Tensor, v: Tensor, group, inner: Functions, attend=plain) -> tuple[Tensor, Tensor]:
    """Ulysses over ``group`` around ``inner`` (run as ``attend(inner)``): (B, s, H, D) in, (out, lse) sequence-split out."""
    qh, kh, vh = _split_qkv(q, k, v, group)  # (B, S_inner, Hq/P, D), (B, S_inner, max(Hkv/P, 1), D) x 2
    out, lse = attend(inner)(qh, kh, vh)  # (B, S_inner, Hq/P, D), (B, Hq/P, S_inner)
    return seq_to_heads(out, group), lse_to_seq_split(lse, group)  # (B, s, Hq, D), (B, Hq, s)


def head_split_backward(dout, q, k, v, out, lse, group, inner: Functions) -> tuple[Tensor, Tensor, Tensor]:
    """The plain backward of ``head_split``: the inputs cross to the head split again, the gradients come back."""
    qh, kh, vh = _split_qkv(q, k, v, group)
    doh, oh = heads_to_seq(dout, group), heads_to_seq(out, group)
    lh = all_to_all(lse, scatter_dim=1, gather_dim=2, group=group)  # (B, Hq, s) -> (B, Hq/P, S_inner)
    dq, dk, dv = inner.backward(doh, qh, kh, vh, oh, lh)
    dk, dv = (_fold_replicas(seq_to_heads(x, group), k.shape[2]) for x in (dk, dv))
    return seq_to_heads(dq, group), dk, dv


def _local(causal: bool, scale: float, backend: str, docs) -> Functions:
    # packed documents: the head-split ranks hold the whole sequence, so the global boundaries apply as they are
    kw = {} if docs is None else {"docs": docs}
    return functions("data_parallel", causal=causal, scale=scale, backend=backend, **kw)


def forward(q, k, v, *, group, causal: bool, scale: float, backend: str, docs=None, attend=plain) -> tuple[Tensor, Tensor]:
    """Ulysses around local attention: out (B, S/P, Hq, D) in q's dtype, lse (B, Hq, S/P)."""
    return head_split(q, k, v, group, _local(causal, scale, backend, docs), attend)


def backward(
    dout, q, k, v, out, lse, *, group, causal: bool, scale: float, backend: str, docs=None
) -> tuple[Tensor, Tensor, Tensor]:
    return head_split_backward(dout, q, k, v, out, lse, group, _local(causal, scale, backend, docs))


def ulysses_attn_attention(
    q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, cu_seqlens=None
) -> tuple[Tensor, Tensor]:
    """Exact attention over contiguous sequence chunks by all-to-all head exchange; returns (out, lse) in this rank's layout.

    q (B, S/P, Hq, D); k, v (B, S/P, Hkv, D) -> out (B, S/P, Hq, D), lse (B, Hq, S/P); out differentiable.
    cu_seqlens: global document boundaries (seqpar.runtime.parallel.attention).
    """
    return attention(
        q, k, v, "ulysses_attn", group=group, causal=causal, softmax_scale=softmax_scale, backend=backend, cu_seqlens=cu_seqlens
    )
