"""Per-rank work of packed windows (seqpar.runtime.parallel.balance) and the balancing order, on one process.

- rank_work (closed forms) equals two independent counts: the pieces seqpar.runtime.parallel.blocks cuts each computed block
  into (zigzag ring, dist_flash's packed schedule, usp's ring), and for the zigzag layouts a dense document mask;
- balanced_order is a deterministic permutation that never makes the busiest rank busier, and brings a window of many
  short documents from well above to within 1.10 of the mean (zigzag_ring_attn, usp_attn), measured exactly;
- prepare_inputs(balance=True) moves whole documents: every document's tokens, targets and positions stay together.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from packed_kernels import long_tail_lengths  # noqa: E402

from seqpar.runtime.parallel.balance import balanced_order, imbalance, rank_work  # noqa: E402

CASES = [("zigzag_ring_attn", 4, None), ("zigzag_ring_attn", 3, None), ("dist_flash_attn", 4, None), ("dist_flash_attn", 3, None)]
CASES += [("usp_attn", 4, 2), ("ulysses_attn", 4, None)]


def _bounds(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def by_blocks(lengths, mode, W, U):
    """Each rank's work summed over the pieces of the blocks it computes (seqpar.runtime.parallel.blocks)."""
    from seqpar.runtime.parallel import blocks
    from seqpar.runtime.parallel.dist_flash_attn import block_segments, packed_schedule
    from seqpar.runtime.parallel.documents import Documents

    S = sum(lengths)
    docs = Documents(S, ((None, _bounds(lengths)),))
    if mode == "ulysses_attn":
        return [blocks.area(((0, S),), ((0, S),), docs) / W] * W
    if mode == "dist_flash_attn":
        n, work = S // W, [0] * W
        for step in packed_schedule(W, n, docs):
            for r, b in enumerate(step):
                if b is not None:
                    work[r] += blocks.area(*block_segments(b, n), docs)
        return work
    R = W // (U or 1)
    segs = [blocks.zigzag_segments(i, R, S) for i in range(R)]
    ring = [sum(blocks.area(segs[i], segs[j], docs) for j in range(R)) / (U or 1) for i in range(R)]
    return [ring[r // (U or 1)] for r in range(W)]


def by_mask(lengths, mode, W, U):
    """zigzag layouts: pairs (query of the rank, earlier key of its document) counted on a dense mask."""
    from seqpar.runtime.parallel.layout import shard

    S = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sees = ((doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()).sum(1)  # (S,) keys per query
    R = W // (U or 1)
    per_ring = [float(shard(sees[None], "zigzag_ring_attn", i, R)[0].sum()) / (U or 1) for i in range(R)]
    return [per_ring[r // (U or 1)] for r in range(W)]


@pytest.mark.parametrize("mode,W,U", CASES, ids=[f"{m}-W{w}" + (f"-U{u}" if u else "") for m, w, u in CASES])
def test_rank_work_equals_the_blocks_and_the_dense_mask(mode, W, U):
    for seed in range(6):
        S = 2 * W * 5 * (1 + seed % 3)
        lengths = long_tail_lengths(S, seed=seed, median=6.0, sigma=1.0, shortest=1)
        got = rank_work(lengths, mode, W, U)
        assert got == pytest.approx(by_blocks(lengths, mode, W, U), abs=0), (seed, lengths)
        if mode in ("zigzag_ring_attn", "usp_attn"):
            assert got == pytest.approx(by_mask(lengths, mode, W, U), abs=0), (seed, lengths)


@pytest.mark.parametrize("mode,U", [("zigzag_ring_attn", None), ("usp_attn", 2)])
def test_balanced_order_evens_many_short_documents(mode, U):
    lengths = long_tail_lengths(4096, seed=3, median=64.0, sigma=1.0)  # 47 documents, the longest 276 tokens
    before = imbalance(rank_work(lengths, mode, 8, U))
    order = balanced_order(lengths, mode, 8, U)
    assert sorted(order) == list(range(len(lengths))) and order == balanced_order(lengths, mode, 8, U)
    after = imbalance(rank_work([lengths[i] for i in order], mode, 8, U))
    assert before > 1.3 and after <= 1.10, (before, after)


def test_balanced_order_never_makes_the_busiest_rank_busier():
    for seed in range(4):
        lengths = long_tail_lengths(16384, seed=seed, median=512.0, sigma=1.6)
        for mode, U in (("zigzag_ring_attn", None), ("dist_flash_attn", None), ("usp_attn", 2)):
            order = balanced_order(lengths, mode, 8, U, rounds=5)
            assert sorted(order) == list(range(len(lengths)))
            assert max(rank_work([lengths[i] for i in order], mode, 8, U)) <= max(rank_work(lengths, mode, 8, U))
    assert balanced_order([5, 7, 9], "ulysses_attn", 4) == [0, 1, 2]  # balanced whatever the order


def test_prepare_inputs_balance_moves_whole_documents():
    import seqpar
    from seqpar.runtime.parallel.layout import unshard

    lengths = [3, 1, 9, 2, 5, 4, 8]  # S = 32
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.arange(100, 132)[None]
    parts = [seqpar.prepare_inputs(ids, "zigzag_ring_attn", r, 4, position_ids=pos, balance=True) for r in range(4)]
    whole = {k: unshard([p[k] for p in parts], "zigzag_ring_attn") for k in ("input_ids", "position_ids", "labels")}
    cu = parts[0]["cu_seqlens"].tolist()
    assert all(torch.equal(p["cu_seqlens"], parts[0]["cu_seqlens"]) for p in parts)
    new_lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert sorted(new_lengths) == sorted(lengths) and new_lengths != lengths  # reordered
    order = balanced_order(lengths, "zigzag_ring_attn", 4)
    starts = _bounds(lengths)
    expected_ids = torch.cat([torch.arange(100 + starts[i], 100 + starts[i + 1]) for i in order])
    assert torch.equal(whole["input_ids"][0], expected_ids)
    for a, b in zip(cu, cu[1:]):  # each document: positions 0.., targets = its next token, -100 at its end
        assert whole["position_ids"][0, a:b].tolist() == list(range(b - a))
        assert whole["labels"][0, a : b - 1].tolist() == whole["input_ids"][0, a + 1 : b].tolist()
        assert int(whole["labels"][0, b - 1]) == -100
