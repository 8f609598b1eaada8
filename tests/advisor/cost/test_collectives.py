"""NCCL bandwidth by message size (seqpar/advisor/cost/collectives.py, data: seqpar/profiles/nccl_tests.json) and the
ring's exposed transfers (throughput.ring_exposed_s): the curves against the published rows they are read from, and
the communication terms against hand-computed references."""

from __future__ import annotations

import json

import pytest

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost import collectives
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.throughput import _bw, ring_exposed_s
from seqpar.profiles import get_link

DATA = json.loads(collectives.NCCL_TESTS_PATH.read_text())


@pytest.mark.parametrize("row", DATA["rows"], ids=lambda r: f"{r['link']}-{r['op']}-{r['message_bytes']}")
def test_each_curve_reproduces_its_rows(row):
    """Every row lies within 5% of its link and operation's curve, but for rows the data marks off the curve (with why),
    and every row's source is cited."""
    assert row["source"] in DATA["sources"] and DATA["sources"][row["source"]]["url"].startswith("https://")
    link = get_link(row["link"]).bandwidth_gb_s if row["link"] != "nvlink5" else 900.0
    got = collectives.bus_bandwidth(row["link"], link, row["op"], row["message_bytes"], 0.75) / 1e9
    if "off_curve" in row:
        assert got > row["busbw_gb_s"]  # the curve is the optimistic side there, as the row's note says
    else:
        assert got == pytest.approx(row["busbw_gb_s"], rel=0.05)


def test_every_curve_names_rows_it_comes_from():
    for link, by_op in DATA["curves"].items():
        for op, c in by_op.items():
            assert op in collectives.OPS and c["from"] and all(s in DATA["sources"] for s in c["from"])
            assert any(r["source"] in c["from"] and r["link"] == link for r in DATA["rows"]), (link, op)


def test_small_messages_run_below_the_peak():
    """time(S) = latency + S / rate: a 4 MB call reaches (4 MB / (50 us + 4 MB / 360 GB/s)) on NVLink4's all-gather."""
    rate = 0.80 * 450e9
    assert collectives.bus_bandwidth("nvlink4", 450, "all_gather", 4e6, 0.75) == pytest.approx(4e6 / (50e-6 + 4e6 / rate))
    assert collectives.bus_bandwidth("nvlink4", 450, "all_gather", 8e9, 0.75) > 0.99 * rate


def test_a_link_without_rows_keeps_the_flat_efficiency():
    assert collectives.bus_bandwidth("pcie4", 32, "sendrecv", 1e8, 0.75) == 32e9 * 0.75
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collectives.bus_bandwidth("nvlink4", 450, "broadcast", 1e8, 0.75)


def test_bw_picks_the_nic_when_the_group_spans_nodes():
    c = load_coefficients()
    cl = cluster_from_flags("h100-sxm", 8, 2)
    inside = _bw(cl, 8, c, op="alltoall", message_bytes=1e9)
    across = _bw(cl, 16, c, op="alltoall", message_bytes=1e9)
    assert inside == pytest.approx(1e9 / (50e-6 + 1e9 / (0.80 * 450e9)))
    assert across == pytest.approx(1e9 / (50e-6 + 1e9 / (0.96 * 50e9)))
    assert _bw(cl, 8, c) == 450e9 * c.comm_bandwidth_efficiency  # no operation named: the flat efficiency


@pytest.mark.parametrize(
    "kv,dkv,compute,ranks,fwd,bwd",
    [
        (1.0, 2.0, 5.0, 4, 0.0, 2.0),  # compute hides every step: only backward's last dK,dV hop shows
        (3.0, 4.0, 2.0, 4, 3 * 1.0, 1.0 + 2.0 + 4.0 + 2 * 5.0),  # transfer-bound: max(0, comm - compute) per step
        (3.0, 4.0, 2.0, 2, 1.0, 1.0 + 2.0 + 4.0),  # two ranks: one K,V step, one dK,dV step, the hop home
        (3.0, 4.0, 2.0, 1, 0.0, 0.0),
    ],
)
def test_ring_exposes_what_its_step_cannot_hide(kv, dkv, compute, ranks, fwd, bwd):
    """zigzag_ring_attn (and ring-flash-attention's zigzag_ring_flash_attn.py): the send/recv of step i+1 is posted before
    step i's attention and waited after it; dK,dV follow one step behind and their last hop is waited after the loop."""
    assert ring_exposed_s(kv, dkv, compute, ranks) == (pytest.approx(fwd), pytest.approx(bwd))
