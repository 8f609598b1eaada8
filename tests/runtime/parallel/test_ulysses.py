"""ulysses_attn on real gloo groups against one process computing full attention in float64.

W = 1 runs in the test process without a process group; W = 2, 3, 4 run on sub-groups of one 4-process gloo spawn.
MHA 8/8 and GQA 8/2 heads at W = 1, 2, 4 (at W = 4 the two KV heads are replicated to four and their gradients summed
back); at W = 3 heads that split over three (6/6, 6/3), and 8 heads, which do not, must fail. float64 with local chunks of
3 and 5 tokens, causal and non-causal, float32 causal; out, lse, dq, dk, dv compared shard by shard. Invalid heads and
lengths raise the same one-line error on every rank, before any all-to-all.
"""

import torch

from seqpar_testing import error_messages, run_ranks
from seqpar_testing.attention import check_cases, gather_by_size, n_cases, on_subgroups

HEADS = {1: [(8, 8), (8, 2)], 2: [(8, 8), (8, 2)], 3: [(6, 6), (6, 3)], 4: [(8, 8), (8, 2)]}
CHUNKS = (3, 5)


def _mode_cases(rank, W, group):
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    z = torch.zeros
    msgs = error_messages(
        [  # all local checks: raised before any transfer
            lambda: shard(z(1, W * 3 + 1, 8, 4), "ulysses_attn", rank, W),
            lambda: attention(z(1, 3, 8, 4), z(1, 3, 8, 4), z(1, 3, 8, 4), "ulysses_attn", group=group),  # 8 heads over W
            lambda: attention(z(1, 3, 12, 4), z(1, 3, 3, 4), z(1, 3, 3, 4), "ulysses_attn", group=group),  # 3 KV heads
            lambda: attention(z(1, 4, 8, 4), z(1, 6, 2, 4), z(1, 6, 2, 4), "ulysses_attn", group=group),
        ]
    )
    return check_cases(rank, W, "ulysses_attn", HEADS[W], CHUNKS, group=group), msgs


def _spawned(rank, world):
    return on_subgroups(rank, world, _mode_cases)


def _check(W, results):
    cases = [r[0] for r in results]
    assert all(c == cases[0] for c in cases) and len(cases[0]) == n_cases(HEADS[W], CHUNKS)
    msgs = [r[1] for r in results]
    assert all(m == msgs[0] for m in msgs), msgs  # the same error on every rank
    if W > 1:
        S = W * 3 + 1
        assert f"seq_len {S} is not divisible by sp_degree = {W}, which ulysses_attn needs" in msgs[0][0]
        assert f"nearest valid: {S - 1} or {S - 1 + W}" in msgs[0][0]
    if W == 3:
        assert msgs[0][1] == (
            "ulysses_attn splits heads over 3 ranks but there are 8 query heads (8 % 3 != 0); "
            "use usp_attn with a ulysses_degree dividing 8, or zigzag_ring_attn"
        )
    else:
        assert msgs[0][1] == "no error"
    if W in (2, 4):  # 3 KV heads: neither split over nor replicated to 2 or 4 ranks
        assert f"ulysses_attn over {W} ranks can neither split nor replicate 3 KV heads" in msgs[0][2]
        assert "use usp_attn with a ulysses_degree dividing 3, or zigzag_ring_attn" in msgs[0][2]
    assert "same local length, got 4 and 6" in msgs[0][3]


def test_ulysses_one_rank_without_process_group():
    _check(1, [_mode_cases(0, 1, None)])


def test_ulysses_matches_single_process_on_2_3_4_ranks():
    by_size = gather_by_size(run_ranks(_spawned, 4, timeout=150))
    assert {W: len(r) for W, r in by_size.items()} == {2: 4, 3: 3, 4: 4}
    for W, results in by_size.items():
        _check(W, results)


def test_replicated_kv_heads_are_the_ones_each_rank_needs():
    """Hkv < P: after replication rank i's single KV head must be the one its query heads (i*Hq/P ...) use."""
    from seqpar.runtime.parallel.ulysses_attn import replicate_kv

    hq, hkv, P = 8, 2, 4
    k = torch.arange(hkv, dtype=torch.float64).view(1, 1, hkv, 1)  # head j holds the value j
    rep = replicate_kv(k, P)  # (1, 1, P, 1)
    for i in range(P):
        first_query_head = i * hq // P
        assert rep[0, 0, i, 0].item() == first_query_head // (hq // hkv)
    assert replicate_kv(k, 2) is k  # enough KV heads: split, no copy
