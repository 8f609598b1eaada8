"""The float64 reference every attention test compares with: whole-sequence softmax attention on one process."""

from __future__ import annotations

import torch


def reference(q, k, v, dout, causal, scale):
    """Whole-sequence attention in float64 by torch autograd, K,V heads repeated for GQA: out, lse, dq, dk, dv."""
    G = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(G, 2)) * scale  # (B, H, S, S)
    if causal:
        s = s.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vd.repeat_interleave(G, 2))  # (B, S, Hq, D)
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), qd.grad, kd.grad, vd.grad
