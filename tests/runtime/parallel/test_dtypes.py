"""dtype and layout edges of the runtime: autocast, mixed dtypes, strided inputs (found in review, 2026-12-02)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from seqpar.plan.errors import SeqparError

from seqpar_testing import run_ranks


def test_attention_refuses_mixed_dtypes():
    from seqpar.runtime.parallel.attention import attention

    q = torch.randn(1, 8, 2, 4)  # (B, S, H, D)
    with pytest.raises(SeqparError, match="must share one dtype"):
        attention(q, q.clone(), q.to(torch.bfloat16), "data_parallel")


def test_autocast_gives_the_kernels_one_dtype(monkeypatch):
    """fp32 weights under bf16 autocast: RoPE's fp32 cos/sin promote q and k; the kernels must still get one dtype
    (a mixed call fell back to the exact S x S kernel on the GPU)."""
    import transformers

    import seqpar

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    model = seqpar.apply(transformers.LlamaForCausalLM(cfg), "data_parallel")
    mod = importlib.import_module("seqpar.runtime.parallel.attention")
    seen, real = [], mod.attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(mod, "attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(0, 64, (1, 16)), use_cache=False)
    assert seen == [(torch.bfloat16,) * 3]


def test_chunked_loss_backward_follows_autocast():
    """Under autocast the forward's logits are bf16 products; the backward must differentiate that same function
    (the old backward recomputed in fp32: 2.6e-3 relative off in d_hidden)."""
    from seqpar.runtime.parallel.loss import loss_from_hidden

    torch.manual_seed(0)
    n, h, v = 256, 64, 512
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.1).requires_grad_()
    labels = torch.randint(0, v, (n,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="sum") / n
        ours = loss_from_hidden(hidden[None], weight, labels[None], chunk_size=64)
    ref_dh, ref_dw = torch.autograd.grad(ref, (hidden, weight))
    dh, dw = torch.autograd.grad(ours, (hidden, weight))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert float((dh - ref_dh).norm() / ref_dh.norm()) < 1e-4
    # d_weight: ours accumulates the chunks in fp32, autograd returns one bf16 product: bf16 rounding apart (2^-8)
    assert float((dw - ref_dw).norm() / ref_dw.norm()) < 2**-8


def _strided(rank, world):
    torch.manual_seed(0)
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    full = torch.randn(3, 1, 4, 16, 8, dtype=torch.float64)  # q, k, v as (B, H, S, D)
    local = shard(full.transpose(2, 3), "zigzag_ring_attn", rank, world, dim=2)  # (3, B, S/W, H, D)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in local]  # same values, (B, H, S, D) strides
    assert not strided[1].is_contiguous()
    out_s, _ = attention(*strided, "zigzag_ring_attn")
    out_c, _ = attention(*(t.contiguous() for t in local), "zigzag_ring_attn")
    return float((out_s - out_c).abs().max())


def test_zigzag_accepts_strided_inputs():
    assert run_ranks(_strided, 2) == [0.0, 0.0]
