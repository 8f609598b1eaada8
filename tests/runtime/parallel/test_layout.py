"""shard/unshard: exact round trips for every mode, the documented chunk placement, and clear errors for bad lengths."""

import pytest
import torch

from seqpar.plan.errors import SeqparError
from seqpar.plan.modes import names, split_multiple
from seqpar.runtime.parallel.layout import shard, unshard

from seqpar_testing import case_id

SETUPS = [(m, w, None) for m in names() if m != "usp_attn" for w in (1, 2, 3, 4)]
SETUPS += [("usp_attn", w, u) for w in (1, 2, 3, 4) for u in (1, 2) if w % u == 0]


@pytest.mark.parametrize("mode,w,u", SETUPS, ids=[case_id(*s) for s in SETUPS])
def test_round_trip(mode, w, u):
    mult = split_multiple(mode, w, u)  # the one rule the advisor, the schema and the runtime read
    for dim, shape in ((1, (2, 3 * mult, 4)), (0, (2 * mult, 3))):
        x = torch.randn(*shape, dtype=torch.float64)
        parts = [shard(x, mode, r, w, dim=dim, ulysses_degree=u) for r in range(w)]
        expected_len = shape[dim] if mode == "data_parallel" else shape[dim] // w
        assert all(p.shape[dim] == expected_len for p in parts)
        assert torch.equal(unshard(parts, mode, dim=dim, ulysses_degree=u), x)


def test_placement():
    x = torch.arange(16).view(1, 16)
    # zigzag over 4 ranks: 8 chunks of 2; rank 1 holds chunks 1 and 6
    assert shard(x, "zigzag_ring_attn", 1, 4).tolist() == [[2, 3, 12, 13]]
    assert shard(x, "dist_flash_attn", 1, 4).tolist() == [[4, 5, 6, 7]]
    assert shard(x, "ulysses_attn", 3, 4).tolist() == [[12, 13, 14, 15]]
    # usp, W=4, U=2: ring rank 0 holds chunks 0 and 3 of 4 ([0..3] + [12..15]); Ulysses rank 1 its second half
    assert shard(x, "usp_attn", 1, 4, ulysses_degree=2).tolist() == [[12, 13, 14, 15]]
    assert shard(x, "usp_attn", 2, 4, ulysses_degree=2).tolist() == [[4, 5, 6, 7]]
    assert shard(x, "data_parallel", 0, 4) is x


@pytest.mark.parametrize(
    "mode,seq,w,u,match",
    [
        ("zigzag_ring_attn", 100, 4, None, "seq_len 100 is not divisible by 2\\*sp_degree = 8.*nearest valid: 96 or 104"),
        ("dist_flash_attn", 10, 4, None, "seq_len 10 is not divisible by sp_degree = 4.*nearest valid: 8 or 12"),
        ("ulysses_attn", 7, 2, None, "nearest valid: 6 or 8"),
        ("usp_attn", 20, 4, 2, "2\\*ring_degree\\*ulysses_degree = 8.*nearest valid: 16 or 24"),
        ("usp_attn", 16, 4, 3, "ulysses_degree dividing world_size 4, got 3"),
        ("ring_attn", 16, 4, None, "mode 'ring_attn' is unknown"),
    ],
    ids=[
        "zigzag_ring_attn-W4-seq100",
        "dist_flash_attn-W4-seq10",
        "ulysses_attn-W2-seq7",
        "usp_attn-W4-U2-seq20",
        "usp_attn-W4-U3",
        "unknown_mode",
    ],
)
def test_bad_lengths_raise_with_nearest_valid(mode, seq, w, u, match):
    with pytest.raises(SeqparError, match=match):
        shard(torch.zeros(1, seq), mode, 0, w, ulysses_degree=u)


def test_bad_rank():
    with pytest.raises(SeqparError, match="rank 4 is outside 0..3"):
        shard(torch.zeros(1, 16), "zigzag_ring_attn", 4, 4)
