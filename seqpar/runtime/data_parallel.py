"""data_parallel mode: every rank holds whole sequences, so attention is local attention (no communication).

Same signature as the sequence-parallel modes so the registry can treat all five alike; the group is accepted and
ignored. Layout: q (B, S, Hq, D); k, v (B, S, Hkv, D); out like q; lse (B, Hq, S).
"""

from __future__ import annotations

from torch import Tensor

from seqpar.runtime.kernels import local_attention


def data_parallel_attention(q, k, v, *, group=None, causal=True, softmax_scale=None, backend=None) -> tuple[Tensor, Tensor]:
    """Attention over the whole local sequence (an autograd Function over the chosen kernel)."""
    return local_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, backend=backend)
