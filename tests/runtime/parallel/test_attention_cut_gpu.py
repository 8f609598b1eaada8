"""GPU checks of the cuDNN backward cut over KV heads (seqpar.plan.attention_calls; skipped without a Hopper GPU).

- Exact: the cut backward gives the gradients of one call (heads are independent), causal diagonal blocks and full
  rectangles, batch 1 and 2, head_dim 128 and 64, with the cut forced to every divisor of the KV heads; and both match
  a float32 reference.
- Memory: what the backward allocates for itself beyond dq, dk, dv, measured by the caching allocator, against the
  memory model's term (seqpar.advisor.cost.memory.attention_backward_workspace), uncut and cut, at 64K and 128K tokens of
  the Llama-3.1-8B attention shape: the cut is what frees the memory the model says it frees.
Run on the GPU machine: python -m pytest -q -o addopts="" tests/runtime/parallel/test_attention_cut_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from seqpar.plan import attention_calls
from seqpar.runtime.parallel import kernels

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper (or newer) GPU: the cut applies to cuDNN's attention",
)

MIB = 2**20


def _inputs(b, sq, sk, hq, hkv, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    return r(b, sq, hq, d), r(b, sk, hkv, d), r(b, sk, hkv, d), r(b, sq, hq, d)


def _backward(q, k, v, dout, causal, budget, monkeypatch):
    monkeypatch.setattr(attention_calls, "WORKSPACE_BUDGET", budget)
    scale = q.shape[-1] ** -0.5
    out, lse = kernels.attn_forward(q, k, v, causal=causal, softmax_scale=scale, backend="cudnn")
    return kernels.attn_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend="cudnn")


def _reference(q, k, v, dout, causal):
    g = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf.repeat_interleave(g, 2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vf.repeat_interleave(g, 2))
    out.backward(dout.float())
    return qf.grad, kf.grad, vf.grad


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,causal",
    [(1, 2048, 2048, 32, 8, 128, True), (2, 1024, 1536, 16, 4, 64, False), (1, 1536, 1536, 8, 2, 128, True)],
)
def test_cut_backward_equals_one_call(b, sq, sk, hq, hkv, d, causal, monkeypatch):
    q, k, v, dout = _inputs(b, sq, sk, hq, hkv, d)
    whole = _backward(q, k, v, dout, causal, 1 << 62, monkeypatch)
    assert attention_calls.backward_calls(b * sq, b * sk, hq, hkv, d) == 1
    ref = _reference(q, k, v, dout, causal)
    for got, want in zip(whole, ref):
        assert _rel(got, want) < 1e-2
    seen = set()
    for n in [n for n in range(2, hkv + 1) if hkv % n == 0]:
        monkeypatch.setattr(attention_calls, "backward_calls", lambda *a, n=n, **k: n)  # force n calls
        monkeypatch.setattr(kernels, "backward_calls", lambda *a, n=n, **k: n)
        cut = _backward(q, k, v, dout, causal, 1 << 62, monkeypatch)
        for name, got, want, r in zip("dq dk dv".split(), cut, whole, ref):
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert _rel(got, want) < 1e-3, (n, name, _rel(got, want))  # the same kernel on fewer heads
            assert _rel(got, r) < 1e-2, (n, name)
        seen.add(n)
    assert seen, "the case must cut at least once"


def _extra_bytes(q, k, v, dout, budget, monkeypatch) -> int:
    """Peak allocated during the backward beyond its inputs and its returned dq, dk, dv."""
    monkeypatch.setattr(attention_calls, "WORKSPACE_BUDGET", budget)
    scale = q.shape[-1] ** -0.5
    out, lse = kernels.attn_forward(q, k, v, causal=True, softmax_scale=scale, backend="cudnn")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = kernels.attn_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale, backend="cudnn")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    held = sum(g.numel() * g.element_size() for g in grads)
    del grads, out, lse
    return peak - base - held


@pytest.mark.parametrize("tokens", [65536, 131072])
def test_cut_frees_what_the_memory_model_says(tokens, monkeypatch):
    from seqpar.advisor.cluster import cluster_from_flags
    from seqpar.advisor.cost.coefficients import load_coefficients
    from seqpar.advisor.cost.memory import attention_backward_workspace
    from seqpar.profiles import get_model

    m = get_model("llama-3.1-8b")  # 32 query heads, 8 KV heads, head_dim 128
    cluster, c = cluster_from_flags("h100", 1, 1), load_coefficients()
    q, k, v, dout = _inputs(1, tokens, tokens, m.num_attention_heads, m.num_key_value_heads, m.head_dim, seed=1)
    # one call: the cuDNN graph's workspace (the model's uncut term)
    uncut = _extra_bytes(q, k, v, dout, 1 << 62, monkeypatch)
    want_uncut = attention_backward_workspace(m, tokens, cluster, c, cut=False)
    # the cut as the runtime runs it with the shipped budget: one call's workspace, its copies and its gradients
    monkeypatch.setattr(attention_calls, "WORKSPACE_BUDGET", 1 << 30)
    calls = attention_calls.backward_calls(tokens, tokens, 32, 8, 128)
    assert calls > 1 and attention_calls.call_bytes(calls, tokens, tokens, 32, 8, 128) <= 1 << 30
    cut = _extra_bytes(q, k, v, dout, 1 << 30, monkeypatch)
    want_cut = attention_backward_workspace(m, tokens, cluster, c, cut=True)
    print(
        f"\n{tokens} tokens: one call {uncut / MIB:.0f} MiB (model {want_uncut / MIB:.0f}); "
        f"{calls} calls {cut / MIB:.0f} MiB (model {want_cut / MIB:.0f})"
    )
    assert abs(uncut - want_uncut) <= 0.05 * want_uncut + 64 * MIB
    assert abs(cut - want_cut) <= 0.05 * want_cut + 64 * MIB
    assert cut < uncut / 2  # what the cut is for
