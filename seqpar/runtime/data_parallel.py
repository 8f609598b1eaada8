"""data_parallel mode: every rank holds whole sequences, so attention is one local kernel call (no communication).

Same protocol as the sequence-parallel modes (seqpar.runtime.attention), so the registry treats all five alike; the group
is accepted and ignored. It is also the inner attention of the Ulysses head split, and ``local_attention`` (whole local
sequences, no group) is this mode. Layout: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D) (Sq == Sk when causal); out like q;
lse (B, Hq, Sq).
"""

from __future__ import annotations

from torch import Tensor

from seqpar.runtime import kernels
from seqpar.runtime.attention import attention


def forward(q, k, v, *, group=None, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    """One kernel call: out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq)."""
    return kernels.attn_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend)


def backward(dout, q, k, v, out, lse, *, group=None, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.attn_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend)


def data_parallel_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None) -> tuple[Tensor, Tensor]:
    """Attention over the whole local sequence; returns (out, lse), out differentiable in q, k, v."""
    return attention(q, k, v, "data_parallel", group=group, causal=causal, softmax_scale=softmax_scale, backend=backend)


def local_attention(q, k, v, *, causal=True, softmax_scale=None, backend=None) -> tuple[Tensor, Tensor]:
    """Attention over whole (local) sequences, differentiable in q, k, v; lse is returned but carries no gradient."""
    return data_parallel_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend)
