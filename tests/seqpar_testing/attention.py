"""The attention tests' cases: one rank's q, k, v and dout against the float64 reference of the whole sequence, shard by
shard, and one spawn of 4 ranks serving every world size on sub-groups. Shared by the dist_flash_attn, Ulysses, USP and
packed-document tests."""

from __future__ import annotations

import torch

from reference import reference
from seqpar_testing import tolerances


def check_cases(rank, W, mode, heads, chunks, ulysses_degree=None, group=None):
    """Every case of this rank against the float64 reference; returns the list of cases run (equal on every rank).

    heads: [(Hq, Hkv)]; chunks: local lengths per rank (S = W * chunk). float64 runs every chunk causal plus the first
    chunk non-causal; float32 (the tolerance check of the fp32 accumulation) runs the first chunk causal.
    """
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    results = []
    for hq, hkv in heads:
        runs = [(torch.float64, c, True) for c in chunks] + [(torch.float64, chunks[0], False), (torch.float32, chunks[0], True)]
        for dtype, chunk, causal in runs:
            S = W * chunk
            g = torch.Generator().manual_seed(1000 * hkv + 10 * chunk + causal)
            q = torch.randn(2, S, hq, 8, generator=g, dtype=dtype)  # (B, S, Hq, D), the same on every rank
            k = torch.randn(2, S, hkv, 8, generator=g, dtype=dtype)  # (B, S, Hkv, D)
            v = torch.randn(2, S, hkv, 8, generator=g, dtype=dtype)
            dout = torch.randn(2, S, hq, 8, generator=g, dtype=dtype)
            ref = reference(q, k, v, dout, causal, 0.35)
            part = lambda t, dim=1: shard(t, mode, rank, W, dim=dim, ulysses_degree=ulysses_degree)  # noqa: E731
            lq, lk, lv = (part(t).clone().requires_grad_() for t in (q, k, v))
            out, lse = attention(lq, lk, lv, mode, group=group, causal=causal, softmax_scale=0.35, ulysses_degree=ulysses_degree)
            out.backward(part(dout))
            case = f"{mode} W={W} U={ulysses_degree} {hq}/{hkv} {dtype} S={S} causal={causal}"
            mine = (out, lse, lq.grad, lk.grad, lv.grad)
            for name, a, r, dim in zip(("out", "lse", "dq", "dk", "dv"), mine, ref, (1, 2, 1, 1, 1)):
                expected = part(r, dim)
                assert a.shape == expected.shape, (case, name, a.shape, expected.shape)
                torch.testing.assert_close(a.double(), expected, **tolerances(dtype), msg=lambda m: f"{case} {name}: {m}")
            assert out.dtype == dtype, case
            assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), case
            results.append(case)
    return results


def n_cases(heads, chunks) -> int:
    return len(heads) * (len(chunks) + 2)


def on_subgroups(rank, world, fn, sizes=(2, 3, 4)):
    """{W: fn(group_rank, W, group)} for every W in sizes, on consecutive-rank sub-groups of the spawned world (W = 2 runs
    on ranks 0-1 and 2-3 at once; rank 3 sits out W = 3). One spawn serves every world size: starting a process that
    imports torch costs seconds, a gloo sub-group milliseconds. new_group is collective: every rank creates every group."""
    import torch.distributed as dist

    results = {}
    for W in sizes:
        starts = range(0, world - W + 1, W)
        groups = [dist.new_group(list(range(s, s + W))) for s in starts]
        for s, g in zip(starts, groups):
            if s <= rank < s + W:
                results[W] = fn(rank - s, W, g)
                dist.barrier(group=g)  # every rank of the group got here: nobody is stuck in a transfer
    return results


def gather_by_size(results):
    """[{W: result}] per spawned rank -> {W: [result of every rank that ran W]}."""
    by_size = {}
    for per_rank in results:
        for W, r in per_rank.items():
            by_size.setdefault(W, []).append(r)
    return by_size
