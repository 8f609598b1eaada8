"""Packed documents (cu_seqlens) in every mode on real gloo groups, against every document run alone in float64.

One 4-process spawn serves W = 2, 3 and 4 (sub-groups, as tests/runtime/parallel/test_dist_flash.py does); W = 1 runs in the test process.
Every mode the world size allows (Ulysses needs the heads to split: 6/6 and 6/3 heads at W = 3, 8/8 and 8/2 elsewhere;
usp_attn with U = 2 at W = 2, 4 and U = 1 at W = 3), MHA and GQA, float64: out, lse, dq, dk, dv equal each document
computed alone (tests/reference.py per document, concatenated) within 1e-10, shard by shard, for
- a document spanning every rank, many 1-token documents, a boundary at every zigzag chunk edge (so at every shard edge
  of every layout), seeded random boundaries, and different boundaries per batch row ((B, n+1) cu_seqlens);
- skipping (zigzag_ring_attn, dist_flash_attn): the blocks computed and the tensors sent per rank equal what a dense
  document mask predicts (brute force here, independent of seqpar.runtime.parallel.blocks); with a boundary at every chunk edge
  nothing is sent at all.
Bad cu_seqlens raise the same one-line SeqparError on every rank before any transfer (no hang), including boundaries
that differ across ranks.
"""

from __future__ import annotations

import pytest
import torch

from reference import reference
from seqpar_testing import error_messages, run_ranks, tolerances
from seqpar_testing.attention import gather_by_size, on_subgroups

CHUNK = 3  # tokens per zigzag chunk: S = 2 * W * CHUNK


def doc_reference(q, k, v, dout, rows, scale):
    """out, lse, dq, dk, dv with every document of every row computed alone (rows: per batch row boundaries)."""
    res = [torch.zeros_like(q, dtype=torch.float64), None, None, None, None]
    outs = [[] for _ in range(5)]
    for b, bounds in enumerate(rows):
        per_row = [[] for _ in range(5)]
        for a, e in zip(bounds, bounds[1:]):
            r = reference(q[b : b + 1, a:e], k[b : b + 1, a:e], v[b : b + 1, a:e], dout[b : b + 1, a:e], True, scale)
            for i in range(5):
                per_row[i].append(r[i])
        for i in range(5):
            outs[i].append(torch.cat(per_row[i], dim=2 if i == 1 else 1))
    res = [torch.cat(o, dim=0) for o in outs]
    return res


def boundaries(S: int, W: int) -> dict[str, list[list[int]]]:
    """case -> per-row boundaries (two rows; equal rows except 'rows')."""
    c = S // (2 * W)
    g = torch.Generator().manual_seed(S)
    cuts = sorted(set(torch.randint(1, S, (S // 4,), generator=g).tolist()))
    cases = {
        "spanning": [0, 2, S - 3, S],  # the middle document covers part of every rank
        "ones": list(range(S + 1)),  # S documents of one token
        "ones_then_long": list(range(S // 2)) + [S],
        "chunk_edges": list(range(0, S + 1, c)),  # a boundary at every zigzag chunk edge (every layout's shard edges)
        "random": [0, *cuts, S],
    }
    out = {name: [b, b] for name, b in cases.items()}
    out["rows"] = [cases["random"], cases["spanning"]]
    return out


def plans(W: int) -> list[tuple[str, int | None, list[tuple[int, int]]]]:
    """(mode, ulysses_degree, heads) this world size allows."""
    heads = [(6, 6), (6, 3)] if W == 3 else [(8, 8), (8, 2)]
    return [
        ("data_parallel", None, heads),
        ("zigzag_ring_attn", None, heads),
        ("dist_flash_attn", None, heads),
        ("ulysses_attn", None, heads),
        ("usp_attn", 1 if W % 2 else 2, heads),
    ]


def _exact_cases(rank, W, group) -> list[str]:
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    S, done = 2 * W * CHUNK, []
    heads = plans(W)[0][2]
    for name, rows in boundaries(S, W).items():
        cu = torch.tensor(rows[0]) if rows[0] == rows[1] else torch.tensor([r + [S] * (S + 1 - len(r)) for r in rows])
        for hq, hkv in heads:
            g = torch.Generator().manual_seed(hq * 10 + hkv)
            q, dout = (torch.randn(2, S, hq, 4, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(2, S, hkv, 4, generator=g, dtype=torch.float64) for _ in range(2))
            ref = doc_reference(q, k, v, dout, rows, 0.4)  # once per case: every mode must reproduce it
            for mode, uly, _ in plans(W):
                part = lambda t, dim=1: shard(t, mode, rank, W, dim=dim, ulysses_degree=uly)  # noqa: E731, B023
                lq, lk, lv = (part(t).clone().requires_grad_() for t in (q, k, v))
                out, lse = attention(lq, lk, lv, mode, group=group, softmax_scale=0.4, ulysses_degree=uly, cu_seqlens=cu)
                out.backward(part(dout))
                case = f"{mode} W={W} {hq}/{hkv} {name}"
                for what, a, r, dim in zip(
                    ("out", "lse", "dq", "dk", "dv"), (out, lse, lq.grad, lk.grad, lv.grad), ref, (1, 2, 1, 1, 1)
                ):
                    torch.testing.assert_close(a, part(r, dim), **tolerances(torch.float64), msg=lambda m: f"{case} {what}: {m}")  # noqa: B023
                done.append(case)
    return done


# --------------------------------------------------------------------------------------------- skipping, by brute force


def _allowed(bounds: list[int], S: int) -> torch.Tensor:
    """(S, S) dense mask: query i sees key j."""
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    return (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()


def expected_zigzag(bounds, S, W, rank, backward: bool = False) -> tuple[int, int]:
    """(blocks computed, tensors sent) by this rank in one zigzag forward (or backward)."""
    from seqpar.runtime.parallel.layout import shard

    m = _allowed(bounds, S)
    pos = [shard(torch.arange(S)[None], "zigzag_ring_attn", r, W)[0] for r in range(W)]
    need = [[bool(m[pos[d]][:, pos[s]].any()) for d in range(W)] for s in range(W)]
    reach = [max(t for t in range(W) if t == 0 or need[s][(s + t) % W]) for s in range(W)]
    computed = sum(need[(rank - t) % W][rank] for t in range(W))
    sent = sum(2 for t in range(W - 1) if t < reach[(rank - t) % W])  # k and v travel as far as they are used
    if backward:  # dk, dv of every block held travel on with it, then straight home (none when it never left)
        held = [t for t in range(W) if t <= reach[(rank - t) % W]]
        sent += sum(2 for t in held if not (t == 0 and reach[rank] == 0))
    return computed, sent


def expected_dist_flash(bounds, S, W, rank) -> tuple[int, int]:
    """(blocks computed, tensors sent) by this rank in one dist_flash_attn forward."""
    from seqpar.runtime.parallel.dist_flash_attn import rows, schedule

    m, n = _allowed(bounds, S), S // W
    computed = sent = 0
    for step in schedule(W, True, split_last=n >= 2):
        for r, b in enumerate(step):
            if b is None:
                continue
            q_rows = torch.arange(b.q * n, (b.q + 1) * n)[rows(b.half, n)]
            if not m[q_rows][:, b.kv * n : (b.kv + 1) * n].any():
                continue
            computed += r == rank
            if b.q != b.kv:  # the computing rank receives K,V (2) or q (1) and returns out, lse (2)
                sent += 2 * (b.kv == rank) if r == b.q else (b.q == rank) + 2 * (r == rank)
    return computed, sent


def _skip_cases(rank, W, group) -> dict:
    import torch.distributed as dist

    from seqpar.runtime.parallel import blocks
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    S, got = 2 * W * CHUNK, {}
    counts = {"blocks": 0, "sent": 0}
    real_attend, real_batch = blocks.attend, dist.batch_isend_irecv

    def attend(*a, **kw):
        counts["blocks"] += 1
        return real_attend(*a, **kw)

    def batch(ops):
        counts["sent"] += sum(op.op is dist.isend for op in ops)
        return real_batch(ops)

    blocks.attend, dist.batch_isend_irecv = attend, batch
    try:
        for name in ("spanning", "chunk_edges", "random"):
            bounds = boundaries(S, W)[name][0]
            for mode, expect in (("zigzag_ring_attn", expected_zigzag), ("dist_flash_attn", expected_dist_flash)):
                q = shard(torch.randn(1, S, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), mode, rank, W)
                q.requires_grad_()
                counts.update(blocks=0, sent=0)
                out, _ = attention(q, q, q, mode, group=group, cu_seqlens=torch.tensor(bounds))
                got[(mode, name)] = ((counts["blocks"], counts["sent"]), expect(bounds, S, W, rank))
                counts.update(sent=0)
                out.sum().backward()
                if mode == "zigzag_ring_attn":
                    got[(mode, name, "backward")] = (counts["sent"], expect(bounds, S, W, rank, backward=True)[1])
    finally:
        blocks.attend, dist.batch_isend_irecv = real_attend, real_batch
    return got


def _errors(rank, W, group) -> list[str]:
    from seqpar.runtime.parallel.attention import attention

    S = 2 * W * CHUNK
    z = torch.zeros(2, S // W, 2, 4)
    bad = {
        "start": torch.tensor([1, S]),
        "end": torch.tensor([0, 5, S - 1]),
        "increase": torch.tensor([0, 5, 5, S]),
        "float": torch.tensor([0.0, S]),
        "rows": torch.tensor([[0, S]] * 3),
        "ranks": torch.tensor([0, 1 + (rank % 2), S]),  # differs across ranks
    }
    calls = [lambda cu=cu: attention(z, z, z, "zigzag_ring_attn", group=group, cu_seqlens=cu) for cu in bad.values()]
    calls.append(lambda: attention(z, z, z, "zigzag_ring_attn", group=group, causal=False, cu_seqlens=torch.tensor([0, 2, S])))
    return error_messages(calls)


def _spawned(rank, world):
    return on_subgroups(rank, world, lambda r, W, g: (_exact_cases(r, W, g), _skip_cases(r, W, g), _errors(r, W, g)))


def test_packed_every_mode_matches_each_document_alone_on_one_rank():
    assert len(_exact_cases(0, 1, None)) == 6 * 5 * 2


def test_packed_every_mode_exact_skips_and_refuses_on_2_3_4_ranks():
    by_size = gather_by_size(run_ranks(_spawned, 4, timeout=240))
    assert {W: len(r) for W, r in by_size.items()} == {2: 4, 3: 3, 4: 4}
    for W, results in by_size.items():
        assert all(len(r[0]) == 6 * 5 * 2 and r[0] == results[0][0] for r in results)
        for res in results:
            for key, (got, expected) in res[1].items():
                assert got == expected, (W, key, got, expected)
            assert res[1][("zigzag_ring_attn", "chunk_edges")][0] == (1, 0)  # the diagonal, nothing sent
            assert res[1][("dist_flash_attn", "chunk_edges")][0] == (1, 0)
        msgs = [r[2] for r in results]
        assert all(m == msgs[0] for m in msgs), msgs  # the same error on every rank
        S = 2 * W * CHUNK
        start, end, increase, floats, rows, ranks, causal = msgs[0]
        assert "cu_seqlens must start at 0, got 1" in start
        assert f"cu_seqlens ends at {S - 1} but the full sequence has S = {S} tokens" in end
        assert "cu_seqlens must increase (every document holds a token), got 5 then 5 at index 2" in increase
        assert "cu_seqlens must be an integer tensor" in floats
        assert "cu_seqlens has 3 rows but the batch has 2" in rows
        odd = [r for r in range(W) if r % 2]
        assert ranks == (
            f"ranks {odd} of the sequence-parallel group hold cu_seqlens other than rank 0's; pass the same global "
            "boundaries on every rank (seqpar.prepare_inputs returns them)"
        )
        assert "needs causal=True" in causal


@pytest.mark.parametrize("name", ["spanning", "chunk_edges", "random"])
def test_expected_counts_are_not_trivial(name):
    """The brute-force predictions the skip test compares with: packed blocks really are skipped somewhere."""
    S, W = 2 * 4 * CHUNK, 4
    bounds = boundaries(S, W)[name][0]
    zz = [expected_zigzag(bounds, S, W, r) for r in range(W)]
    df = [expected_dist_flash(bounds, S, W, r) for r in range(W)]
    dense_zz = sum(2 * (W - 1) for _ in range(W))  # today's ring sends K,V every step
    assert sum(s for _, s in zz) < dense_zz
    assert sum(c for c, _ in zz) < W * W and sum(c for c, _ in df) < W * (W + 1) // 2 + W // 2
