"""usp_attn on real gloo groups against one process computing full attention in float64.

The hybrid proper is W = 4 with ulysses_degree 2 (two Ulysses pairs of consecutive ranks, two rings of every other rank, the
sub-groups built collectively with new_group): MHA 8/8, GQA 8/2 (KV heads split) and 8/1 (the one KV head replicated inside
each pair). The degenerate degrees (U = 1: zigzag_ring_attn; U = W: ulysses_attn) run at W = 1..4 as far as heads allow.
W = 1 runs in the test process without a process group; W = 2, 3, 4 on sub-groups of one 4-process gloo spawn.
float64 with local chunks of 2 and 6 tokens (S must be a multiple of 2W), causal and non-causal, float32 causal; out, lse,
dq, dk, dv compared shard by shard. Bad degrees, heads and lengths raise the same one-line error on every rank, before any
transfer. On 6 processes, sp groups that do not span the job (dp x sp): sub-groups made from inside a group, the clear error
where that would hang, and create_subgroups, its fix.
"""

import torch

from seqpar_testing import error_messages, run_ranks
from seqpar_testing.attention import check_cases, gather_by_size, n_cases, on_subgroups

MHA_GQA = [(8, 8), (8, 2)]
PLAN = {  # W -> [(ulysses_degree, heads, local chunk lengths)]
    1: [(1, MHA_GQA, (2, 6))],
    2: [(2, MHA_GQA, (2, 6)), (1, MHA_GQA[1:], (2,))],
    3: [(1, MHA_GQA, (2, 6))],
    4: [(2, MHA_GQA + [(8, 1)], (2, 6)), (4, MHA_GQA[1:], (2,)), (1, MHA_GQA[1:], (2,))],
}


def _mode_cases(rank, W, group):
    from seqpar.runtime.parallel.attention import attention
    from seqpar.runtime.parallel.layout import shard

    z = torch.zeros
    U = 2 if W % 2 == 0 else 1
    kw = dict(group=group)
    msgs = error_messages(
        [  # all local checks: raised before any transfer
            lambda: attention(z(1, 2, 8, 4), z(1, 2, 8, 4), z(1, 2, 8, 4), "usp_attn", **kw),  # no ulysses_degree
            lambda: attention(z(1, 2, 8, 4), z(1, 2, 8, 4), z(1, 2, 8, 4), "usp_attn", ulysses_degree=W + 1, **kw),
            lambda: shard(z(1, 2 * W + 1, 8, 4), "usp_attn", rank, W, ulysses_degree=U),
            lambda: attention(z(1, 3, 8, 4), z(1, 3, 8, 4), z(1, 3, 8, 4), "usp_attn", ulysses_degree=U, **kw),  # S = 3W
            lambda: attention(z(1, 2, 6, 4), z(1, 2, 6, 4), z(1, 2, 6, 4), "usp_attn", ulysses_degree=W, **kw),  # 6 heads / W
            lambda: attention(z(1, 2, 12, 4), z(1, 2, 3, 4), z(1, 2, 3, 4), "usp_attn", ulysses_degree=U, **kw),
        ]
    )
    cases = []
    for u, heads, chunks in PLAN[W]:
        cases += check_cases(rank, W, "usp_attn", heads, chunks, ulysses_degree=u, group=group)
    return cases, msgs


def _spawned(rank, world):
    return on_subgroups(rank, world, _mode_cases)


def _check(W, results):
    cases = [r[0] for r in results]
    assert all(c == cases[0] for c in cases) and len(cases[0]) == sum(n_cases(h, c) for _, h, c in PLAN[W])
    msgs = [r[1] for r in results]
    assert all(m == msgs[0] for m in msgs), msgs  # the same error on every rank
    divisors = [u for u in range(1, W + 1) if W % u == 0]
    assert msgs[0][0] == f"usp_attn needs ulysses_degree dividing world_size {W}, got None; pick one of {divisors}"
    assert msgs[0][1] == f"usp_attn needs ulysses_degree dividing world_size {W}, got {W + 1}; pick one of {divisors}"
    S = 2 * W + 1
    assert f"seq_len {S} is not divisible by 2*ring_degree*ulysses_degree = {2 * W}, which usp_attn needs" in msgs[0][2]
    assert f"nearest valid: {S - 1} or {S - 1 + 2 * W}" in msgs[0][2]
    assert f"seq_len {3 * W} is not divisible by 2*ring_degree*ulysses_degree = {2 * W}" in msgs[0][3]
    if W == 4:
        assert "usp_attn splits heads over 4 ranks but there are 6 query heads (6 % 4 != 0)" in msgs[0][4]
    else:
        assert msgs[0][4] == "no error"
    if W % 2 == 0:
        assert "usp_attn over 2 ranks can neither split nor replicate 3 KV heads" in msgs[0][5]
    else:
        assert msgs[0][5] == "no error"


def test_usp_one_rank_without_process_group():
    _check(1, [_mode_cases(0, 1, None)])


def test_usp_matches_single_process_on_2_3_4_ranks():
    by_size = gather_by_size(run_ranks(_spawned, 4, timeout=150))
    assert {W: len(r) for W, r in by_size.items()} == {2: 4, 3: 3, 4: 4}
    for W, results in by_size.items():
        _check(W, results)


def _dp_sp(rank, world):
    """Sequence-parallel groups that do not span the job (the dp x sp case), on 6 processes."""
    import torch.distributed as dist

    from seqpar.runtime.parallel.usp_attn import create_subgroups

    def cases(ranks, group):
        return check_cases(ranks.index(rank), len(ranks), "usp_attn", [(8, 2)], (2,), ulysses_degree=2, group=group)

    out = {}
    a, c = dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5])
    # members of a 4-rank group create its sub-groups by themselves (use_local_synchronization)
    out["local"] = cases([0, 1, 2, 3], a) if rank < 4 else cases([4, 5], c)
    dist.new_group([0, 1, 2])  # now ranks 0 and 1 know one group more than ranks 4 and 5
    d = dist.new_group([0, 1, 4, 5])
    if rank in (0, 1, 4, 5):  # creating sub-groups from inside d would hang: every member must raise instead
        out["error"] = error_messages([lambda: cases([0, 1, 4, 5], d)])[0]
    create_subgroups([[0, 1, 4, 5]], 2)  # the fix the message names: every process, up front
    if rank in (0, 1, 4, 5):
        out["created"] = cases([0, 1, 4, 5], d)
    return out


def test_usp_groups_that_do_not_span_the_job():
    results = run_ranks(_dp_sp, 6, timeout=150)
    assert all(len(r["local"]) == n_cases([(8, 2)], (2,)) for r in results)
    members = [results[r] for r in (0, 1, 4, 5)]
    assert all(m["error"] == members[0]["error"] for m in members)
    assert members[0]["error"].startswith("usp_attn cannot create the sub-groups of group [0, 1, 4, 5] from inside it")
    assert "create_subgroups" in members[0]["error"]
    assert all(len(m["created"]) == n_cases([(8, 2)], (2,)) for m in members)
