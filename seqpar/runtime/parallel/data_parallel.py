"""data_parallel mode: every rank holds whole sequences, so attention is one local kernel call (no communication).

Same protocol as the sequence-parallel modes (seqpar.runtime.parallel.attention), so the registry treats all five alike; the group
is accepted and ignored. It is also the inner attention of the Ulysses head split, and ``local_attention`` (whole local
sequences, no group) is this mode. With packed documents (``docs``) the one call is per-document causal attention over
the whole sequence (seqpar.runtime.parallel.varlen through seqpar.runtime.parallel.blocks). Layout: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D)
(Sq == Sk when causal); out like q; lse (B, Hq, Sq).
"""

from __future__ import annotations

from torch import Tensor

from seqpar.runtime.parallel import blocks, kernels
from seqpar.runtime.parallel.attention import attention


def _whole(q: Tensor) -> blocks.Segments:
    return ((0, q.shape[1]),)


def forward(q, k, v, *, group=None, causal: bool, scale: float, backend: str, docs=None) -> tuple[Tensor, Tensor]:
    """One kernel call: out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq)."""
    if docs is not None:
        out, lse = blocks.attend(q, k, v, _whole(q), _whole(q), docs, scale=scale, backend=backend)
        return out.to(q.dtype), lse
    return kernels.attn_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend)


def backward(
    dout, q, k, v, out, lse, *, group=None, causal: bool, scale: float, backend: str, docs=None
) -> tuple[Tensor, Tensor, Tensor]:
    if docs is not None:
        g = blocks.attend_backward(dout, q, k, v, out, lse, _whole(q), _whole(q), docs, scale=scale, backend=backend)
        return tuple(x.to(like.dtype) for x, like in zip(g, (q, k, v)))
    return kernels.attn_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend)


def data_parallel_attention(
    q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None, cu_seqlens=None
) -> tuple[Tensor, Tensor]:
    """Attention over the whole local sequence; returns (out, lse), out differentiable in q, k, v. cu_seqlens: the
    documents of the local rows (seqpar.runtime.parallel.attention)."""
    return attention(
        q, k, v, "data_parallel", group=group, causal=causal, softmax_scale=softmax_scale, backend=backend, cu_seqlens=cu_seqlens
    )


def local_attention(q, k, v, *, causal=True, softmax_scale=None, backend=None, cu_seqlens=None) -> tuple[Tensor, Tensor]:
    """Attention over whole (local) sequences, differentiable in q, k, v; lse is returned but carries no gradient."""
    return data_parallel_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend, cu_seqlens=cu_seqlens)
