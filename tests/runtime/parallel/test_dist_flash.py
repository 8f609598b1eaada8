"""dist_flash_attn on real gloo groups against one process computing full attention in float64; its schedule in pure Python.

W = 1 runs in the test process without a process group; W = 2, 3, 4 run on sub-groups of one 4-process gloo spawn (the
balanced schedule is exact for odd W too). Every case: MHA 8/8 and GQA 8/2 heads, float64 with local chunks of 3, 2 and 1
tokens (not multiples of any kernel tile; 1 cannot be split in half), causal and the plain rotation (non-causal), float32
causal; out, lse, dq, dk, dv are compared shard by shard. Lengths that do not split over W and malformed inputs must raise
the same one-line error on every rank, with no hang. ``check_cases`` and ``on_subgroups`` (seqpar_testing.attention) are
shared with the Ulysses, USP and packed-document tests.
"""

import pytest
import torch

from seqpar_testing import error_messages, run_ranks, world_ids
from seqpar_testing.attention import check_cases, gather_by_size, n_cases, on_subgroups

# MHA and GQA; local lengths: 3 (the split last step gets unequal halves of 1 and 2 rows), 2, and 1 (too short to split)
HEADS, CHUNKS = [(8, 8), (8, 2)], (3, 2, 1)


def _mode_cases(rank, W, group):
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    z = torch.zeros
    msgs = error_messages(
        [  # all local checks: raised before any transfer
            lambda: shard(z(1, W * 3 + 1, 8, 4), "dist_flash_attn", rank, W),
            lambda: attention(z(1, 4, 6, 4), z(1, 4, 4, 4), z(1, 4, 4, 4), "dist_flash_attn", group=group),
            lambda: attention(z(1, 4, 8, 4), z(1, 6, 2, 4), z(1, 6, 2, 4), "dist_flash_attn", group=group),
        ]
    )
    return check_cases(rank, W, "dist_flash_attn", HEADS, CHUNKS, group=group), msgs


def _spawned(rank, world):
    return on_subgroups(rank, world, _mode_cases)


def _check(W, results):
    cases = [r[0] for r in results]
    assert all(c == cases[0] for c in cases) and len(cases[0]) == n_cases(HEADS, CHUNKS)
    msgs = [r[1] for r in results]
    assert all(m == msgs[0] for m in msgs), msgs  # the same error on every rank
    S = W * 3 + 1
    if W > 1:  # every length splits over one rank
        assert f"seq_len {S} is not divisible by sp_degree = {W}, which dist_flash_attn needs" in msgs[0][0]
        assert f"nearest valid: {S - 1} or {S - 1 + W}" in msgs[0][0]
    assert "6 query heads are not a multiple of 4 KV heads" in msgs[0][1]
    assert "same local length, got 4 and 6" in msgs[0][2]


def test_dist_flash_one_rank_without_process_group():
    _check(1, [_mode_cases(0, 1, None)])


def test_dist_flash_matches_single_process_on_2_3_4_ranks():
    by_size = gather_by_size(run_ranks(_spawned, 4, timeout=150))
    assert {W: len(r) for W, r in by_size.items()} == {2: 4, 3: 3, 4: 4}  # odd W = 3 runs too: the schedule is exact
    for W, results in by_size.items():
        _check(W, results)


@pytest.mark.parametrize("P", range(1, 10), ids=world_ids(range(1, 10)))
@pytest.mark.parametrize(
    "causal,split", [(True, True), (True, False), (False, False)], ids=["causal-split_last", "causal-lightseq", "non_causal"]
)
def test_schedule_covers_every_block_once_and_balances(P, causal, split):
    from seqpar.runtime.parallel.dist_flash_attn import schedule

    steps = schedule(P, causal, split_last=split)
    blocks = [b for step in steps for b in step if b is not None]
    covered = {}  # (q, kv) -> share of its query rows computed
    for b in blocks:
        covered[(b.q, b.kv)] = covered.get((b.q, b.kv), 0) + (1 if b.half is None else 0.5)
    halves = sorted((b.q, b.kv, b.half) for b in blocks if b.half is not None)
    assert halves == sorted({(q, kv, h) for q, kv, _ in halves for h in (0, 1)})  # both halves, each once
    expected = {(i, j): 1 for i in range(P) for j in range(P) if j <= i or not causal}
    assert covered == expected  # each needed block exactly once
    assert all(b.causal == (causal and b.q == b.kv) for b in blocks)  # only the diagonal is masked
    for r in range(P):  # a rank computes with its own query or its own K,V: one transfer in, one partial out
        assert all(step[r] is None or r in (step[r].q, step[r].kv) for step in steps)
    if causal:
        assert len(steps) == P // 2 + 1  # LightSeq's P/2 + 1 steps
        work = [
            sum(0 if b is None else 0.5 if (b.causal or b.half is not None) else 1 for b in (s[r] for s in steps))
            for r in range(P)
        ]  # in full-block units: the diagonal and a half block are 1/2
        if split or P % 2:
            assert work == [P / 2] * P  # every rank the same work: the average
        else:
            assert max(work) == P / 2 + 0.5  # LightSeq's even-P schedule: the busiest rank does half a block more
