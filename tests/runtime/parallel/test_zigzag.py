"""zigzag_ring_attn and data_parallel on real gloo groups against one process computing full attention in float64.

One spawn per world size (W = 1, 2, 3, 4); inside it every case runs: MHA 8/8 and GQA 8/2 heads; float64 with two
valid lengths (chunks of 3 and 5 tokens: not powers of two) and the plain (non-causal) ring; float32 causal; out, lse,
dq, dk, dv are compared shard by shard. Invalid inputs must raise the same one-line error on every rank, with no hang.
The communication layer (ring p2p, all-to-all forward and backward) is checked in the same processes.
"""

import pytest
import torch

from reference import reference
from seqpar_testing import error_messages, run_ranks, tolerances, world_ids


def _check_comm(rank, W):
    from seqpar.runtime.parallel.comm import RingComm, all_to_all

    ring = RingComm()
    got = ring.send_recv(torch.full((2, 3), float(rank))).wait()
    torch.testing.assert_close(got, torch.full((2, 3), float((rank - 1) % W)))
    # all-to-all (B, S/W, H, D) -> (B, S, H/W, D): compare with slicing the full tensor, and back again
    full = torch.arange(2 * 4 * W * 2 * W * 3, dtype=torch.float64).view(2, 4 * W, 2 * W, 3)
    local = full.chunk(W, 1)[rank].clone().requires_grad_()
    heads = all_to_all(local, 2, 1, None)
    torch.testing.assert_close(heads, full.chunk(W, 2)[rank])
    weight = torch.randn(heads.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    (heads * weight).sum().backward()  # the backward all-to-all sends each weight back to its sequence owner
    full_weight = torch.cat(run_all_gather(weight, W), dim=2)
    torch.testing.assert_close(local.grad, full_weight.chunk(W, 1)[rank])


def run_all_gather(t, W):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(W)]
    dist.all_gather(out, t.contiguous())
    return out


def _errors(rank, W):
    """Messages of the invalid-input errors on this rank (each must be raised before any transfer)."""
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    return error_messages(
        [
            lambda: shard(torch.zeros(1, 2 * W * 3 + 1, 8, 4), "zigzag_ring_attn", rank, W),
            lambda: attention(torch.zeros(1, 3, 8, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), "zigzag_ring_attn"),
            lambda: attention(torch.zeros(1, 4, 6, 4), torch.zeros(1, 4, 4, 4), torch.zeros(1, 4, 4, 4), "zigzag_ring_attn"),
            lambda: attention(torch.zeros(1, 4, 8, 4), torch.zeros(1, 6, 2, 4), torch.zeros(1, 6, 2, 4), "zigzag_ring_attn"),
        ]
    )


def _cases(rank, W):
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    results = []
    for mode in ("zigzag_ring_attn", "data_parallel"):
        for hq, hkv in ((8, 8), (8, 2)):
            for dtype in (torch.float64, torch.float32):
                for chunk in (3, 5) if dtype == torch.float64 else (5,):
                    for causal in (True, False) if chunk == 3 else (True,):
                        S = 2 * W * chunk
                        g = torch.Generator().manual_seed(1000 * hkv + 10 * chunk + causal)
                        q = torch.randn(2, S, hq, 8, generator=g, dtype=dtype)  # (B, S, Hq, D), the same on every rank
                        k = torch.randn(2, S, hkv, 8, generator=g, dtype=dtype)  # (B, S, Hkv, D)
                        v = torch.randn(2, S, hkv, 8, generator=g, dtype=dtype)
                        dout = torch.randn(2, S, hq, 8, generator=g, dtype=dtype)
                        ref = reference(q, k, v, dout, causal, 0.35)
                        lq, lk, lv = (shard(t, mode, rank, W).clone().requires_grad_() for t in (q, k, v))
                        out, lse = attention(lq, lk, lv, mode, causal=causal, softmax_scale=0.35)
                        out.backward(shard(dout, mode, rank, W))
                        tol = tolerances(dtype)
                        mine = (out, lse, lq.grad, lk.grad, lv.grad)
                        for name, a, r, dim in zip(("out", "lse", "dq", "dk", "dv"), mine, ref, (1, 2, 1, 1, 1)):
                            expected = shard(r, mode, rank, W, dim=dim)
                            assert a.shape == expected.shape, (name, a.shape, expected.shape)
                            torch.testing.assert_close(
                                a.double(),
                                expected,
                                **tol,
                                msg=lambda m: f"{mode} {name} {hq}/{hkv} {dtype} S={S} causal={causal}: {m}",
                            )
                        assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
                        results.append((mode, hq, hkv, str(dtype), S, causal))
    return results


def _all(rank, W):
    _check_comm(rank, W)
    msgs = _errors(rank, W)
    import torch.distributed as dist

    dist.barrier()  # every rank got past its errors: nobody is stuck in a transfer
    return _cases(rank, W), msgs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=world_ids([1, 2, 3, 4]))
def test_zigzag_and_data_parallel_match_single_process(world_size):
    results = run_ranks(_all, world_size, timeout=90)
    cases = [r[0] for r in results]
    assert all(c == cases[0] for c in cases) and len(cases[0]) == 2 * 2 * (3 + 1)
    msgs = [r[1] for r in results]
    assert all(m == msgs[0] for m in msgs), msgs  # the same error on every rank
    S = 2 * world_size * 3 + 1
    below, above = S - 1, S - 1 + 2 * world_size
    assert f"seq_len {S} is not divisible by 2*sp_degree = {2 * world_size}" in msgs[0][0]
    assert f"nearest valid: {below} or {above}" in msgs[0][0]
    assert "seq_len" in msgs[0][1] and "zigzag_ring_attn" in msgs[0][1]
    assert "6 query heads are not a multiple of 4 KV heads" in msgs[0][2]
    assert "same local length, got 4 and 6" in msgs[0][3]
