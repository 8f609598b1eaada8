"""The exact local-attention kernel and the log-sum-exp merge against a float64 reference built from torch autograd."""

import math

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.runtime import local_attention
from seqpar.runtime.parallel import kernels

from seqpar_testing import tolerances


def reference(q, k, v, causal, scale):
    """Plain softmax attention in float64 with K,V heads repeated (GQA), differentiated by torch autograd."""
    G = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    kr, vr = kd.repeat_interleave(G, 2), vd.repeat_interleave(G, 2)  # (B, Sk, Hq, D)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kr) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (B, H, Sq)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vr)
    return qd, kd, vd, out, lse


CASES = [  # (Hq, Hkv, Sq, Sk, causal)
    (8, 8, 13, 13, True),
    (8, 2, 13, 13, True),
    (8, 8, 7, 11, False),
    (8, 2, 16, 5, False),
    (4, 1, 9, 9, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("hq,hkv,sq,sk,causal", CASES)
def test_local_attention_matches_reference(dtype, hq, hkv, sq, sk, causal):
    g = torch.Generator().manual_seed(hq * 100 + sq + sk)
    q = torch.randn(2, sq, hq, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, sk, hkv, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, sk, hkv, 16, generator=g, dtype=dtype, requires_grad=True)
    dout = torch.randn(2, sq, hq, 16, generator=g, dtype=dtype)
    scale = 0.3
    out, lse = local_attention(q, k, v, causal=causal, softmax_scale=scale)
    out.backward(dout)
    qd, kd, vd, rout, rlse = reference(q, k, v, causal, scale)
    rout.backward(dout.double())
    tol = tolerances(dtype)
    assert lse.shape == (2, hq, sq) and not lse.requires_grad
    torch.testing.assert_close(out, rout.to(dtype), **tol)
    torch.testing.assert_close(lse.double(), rlse.detach(), **tol)
    for mine, ref in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref.to(dtype), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_merge_of_key_blocks_equals_whole(dtype):
    """Attention over keys split in three blocks, merged, equals attention over all keys; so does the backward
    of each block given the merged out/lse (what ring attention relies on)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, 8, 8, generator=g, dtype=dtype)
    k = torch.randn(1, 15, 2, 8, generator=g, dtype=dtype) * 3  # large scores: exercises the stable update
    v = torch.randn(1, 15, 2, 8, generator=g, dtype=dtype)
    dout = torch.randn(1, 6, 8, 8, generator=g, dtype=dtype)
    scale = 1 / math.sqrt(8)
    out = lse = None
    blocks = [slice(0, 4), slice(4, 11), slice(11, 15)]
    for b in blocks:
        bo, bl = kernels.attn_forward(q, k[:, b], v[:, b], causal=False, softmax_scale=scale, backend="exact")
        out, lse = kernels.merge(out, lse, bo, bl)
    assert out.dtype == torch.promote_types(dtype, torch.float32)
    qd, kd, vd, rout, rlse = reference(q, k, v, False, scale)
    rout.backward(dout.double())
    tol = tolerances(dtype)
    torch.testing.assert_close(out.double(), rout.detach(), **tol)
    torch.testing.assert_close(lse.double(), rlse.detach(), **tol)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for b in blocks:
        bdq, bdk, bdv = kernels.attn_backward(
            dout, q, k[:, b], v[:, b], out, lse, causal=False, softmax_scale=scale, backend="exact"
        )
        dq += bdq
        dk[:, b], dv[:, b] = bdk, bdv
    torch.testing.assert_close(dq.double(), qd.grad, **tol)
    torch.testing.assert_close(dk.double(), kd.grad, **tol)
    torch.testing.assert_close(dv.double(), vd.grad, **tol)


def test_backend_choice_and_bad_input():
    assert kernels.select_backend("cpu", torch.float32) == "exact"
    assert kernels.select_backend("cpu", torch.bfloat16) == "exact"
    with pytest.raises(SeqparError, match="'cudnn' needs a CUDA device"):
        kernels.select_backend("cpu", torch.float32, "cudnn")
    with pytest.raises(SeqparError, match="unknown"):
        kernels.select_backend("cpu", torch.float32, "xformers")
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(SeqparError, match="6 query heads are not a multiple of 4 KV heads"):
        local_attention(q, k, k)
    with pytest.raises(SeqparError, match="causal block must be square"):
        local_attention(q, k[:, :3, :3], k[:, :3, :3])
