"""The page-locked host budget (ClusterSpec.pinned_host_gib, --pinned-host-gib): one figure the cost model prices and the
runtime pins within. Stated, the plan carries it and seqpar launch / seqpar.apply / SeqparArguments.from_plan pin exactly
its per-rank share; unstated, the cost model takes 40% of the declared host RAM and the runtime 40% of the machine's.
The search's host-kept layer count (a pinned kept_host_layers is a most) is checked against every count and split."""

import json

import pytest

from seqpar.advisor.cluster import with_pinned_host
from seqpar.advisor.cost.memory import estimate_memory, kept_host_matmuls, offloaded_inputs
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.options import PINNED_FRACTION
from seqpar.plan.specs import ClusterSpec

from seqpar_testing.advisor import L7, M7, C, dp, h200, work
from seqpar_testing.cli import run

S = 65536
LAYER_MM_GIB = 4.6875  # Llama-2-7B's q, k, v, o, gate, up outputs at 64K, bf16 (tests/advisor/test_kept_matmuls_advisor.py)


def pinned(gib, host_gib=125.0):
    return with_pinned_host(h200(host_gib), gib)


def test_the_budget_is_the_stated_figure_or_the_default_share_per_rank():
    default, stated = h200(), pinned(75.0)
    assert default.pinned_host_gib is None and default.pinned_gib_per_rank == pytest.approx(PINNED_FRACTION * 125)
    assert default.stated_pinned_gib_per_rank is None  # the runtime keeps its own default (the machine's RAM)
    assert stated.pinned_gib_per_rank == stated.stated_pinned_gib_per_rank == 75.0
    eight = ClusterSpec.model_validate({**stated.model_dump(), "gpus_per_node": 8})
    assert eight.pinned_gib_per_rank == eight.stated_pinned_gib_per_rank == 75.0 / 8  # the node's ranks share it


@pytest.mark.parametrize(
    "gib, words",
    [
        (126.0, "--pinned-host-gib 126: pinned_host_gib 126 is more than the node's host_ram_gib 125: .* pin at most 125"),
        (0.0, "--pinned-host-gib 0: pinned_host_gib: Input should be greater than 0; give a positive, finite amount"),
        (float("nan"), "--pinned-host-gib nan: pinned_host_gib: Input should be a finite number; give a positive"),
    ],
)
def test_a_budget_beyond_the_host_or_not_positive_is_refused(gib, words):
    with pytest.raises(SeqparError, match=words):
        pinned(gib)
    with pytest.raises(ValueError):  # the rule's one home: the plan refuses it too
        ClusterSpec.model_validate({**h200().model_dump(), "pinned_host_gib": gib})


def test_the_cost_model_pins_within_the_stated_budget():
    sel = dp(checkpointing="selective", checkpoint_layers=0, kept_saves="matmuls", kept_host_layers=32, fused_ops="liger")
    assert kept_host_matmuls(work(), h200(), sel)[2] == int(PINNED_FRACTION * 125 // LAYER_MM_GIB) == 10
    assert kept_host_matmuls(work(), pinned(75.0), sel)[2] == int(75 // LAYER_MM_GIB) == 16
    off = dp(checkpointing="offload", fused_ops="liger")  # 384K: 3 GiB layer inputs in 4 GiB pinned blocks
    assert offloaded_inputs(work(seq_len=384 * 1024), h200(), off)[2] == 12
    assert offloaded_inputs(work(seq_len=384 * 1024), pinned(100.0), off)[2] == 25
    # more of it pinned: fewer copies priced as pageable
    slow, fast = (estimate_time(work(seq_len=384 * 1024), cl, off, C) for cl in (h200(), pinned(100.0)))
    assert fast.breakdown_s["offload"] < slow.breakdown_s["offload"]


def _req(cluster, **pins):
    base = {"mode": "data_parallel", "sharding": "ddp", "fused_ops": "liger", "optimizer": "none", "kept_saves": "matmuls"}
    return AdviseRequest(model=M7, seq_len=S, cluster=cluster, **{**base, **pins})


@pytest.mark.parametrize("gib", [50.0, 75.0, 100.0])
def test_the_host_count_is_the_fastest_of_every_count_and_split_that_fits(gib):
    """A pinned kept_host_layers 32 is a most: the plan's host count and split are the fastest of all (host, checkpointed)
    pairs within the budget that fit the GPU and the host's RAM. At 100 GiB pinning every layer the budget holds (21)
    overflows the 125 GiB host, which the old rule (the most the budget allows) ran into."""
    cl = pinned(gib)
    plan = advise_by_cost(_req(cl, kept_host_layers=32, checkpointing="selective"))
    assert not plan.prediction.oom_risk
    best = 0.0
    for n in range(L7 + 1):
        for host in range(L7 - n + 1):
            s = dp(checkpointing="selective", checkpoint_layers=n, kept_saves="matmuls", kept_host_layers=host, fused_ops="liger")
            if host and kept_host_matmuls(work(), cl, s)[2] < host:
                continue  # beyond the budget: the runtime recomputes those, never planned
            if estimate_memory(work(), cl, s, C).fits:
                best = max(best, estimate_time(work(), cl, s, C).tokens_per_s)
    assert estimate_time(work(), cl, plan.strategy, C).tokens_per_s == pytest.approx(best, rel=1e-12)
    assert plan.strategy.kept_host_layers <= int(gib // LAYER_MM_GIB)
    assert plan.prediction.host_memory_gib <= 125 * C.host_ram_usable_fraction


ADVISE = ["advise", "--model", "llama-2-7b", "--gpu", "h200", "--gpus", "1", "--seq-len", "64k", "--host-ram-gib", "125"]


def _advise_75(out):
    """The 64K kept-matmuls plan with 75 GiB of the 125 GiB host page-lockable, written to ``out``."""
    pins = ["--mode", "data_parallel", "--sharding", "ddp", "--fused-ops", "liger", "--optimizer", "none"]
    r = run(*ADVISE, *pins, "--kept-saves", "matmuls", "--kept-host-layers", "32", "--pinned-host-gib", "75", "-o", out)
    assert r.exit_code == 0, r.output


def test_cli_writes_the_budget_into_the_plan_and_refuses_one_beyond_the_host(tmp_path):
    out = tmp_path / "plan.json"
    _advise_75(out)
    plan = LaunchPlan.load(out)
    assert plan.cluster.pinned_host_gib == 75.0 and plan.strategy.kept_host_layers > 10  # past the default's 10
    r = run("explain", out)
    assert "75 GiB per node (stated)" in r.output
    bad = tmp_path / "bad.json"
    r = run(*ADVISE, "--pinned-host-gib", "200", "-o", bad)
    assert r.exit_code == 2 and "--pinned-host-gib 200: pinned_host_gib 200 is more than the node's host_ram_gib 125" in r.output
    assert not bad.exists()
    # seqpar check re-judges the plan on a smaller budget: the host-kept layers beyond 40 GiB keep nothing on the host
    # (their matmuls run again), so the host holds 8 layers' outputs, not all of them, and the step is priced slower
    wide, tight = (json.loads(run("check", out, *extra, "--json").stdout) for extra in ((), ("--pinned-host-gib", "40")))
    assert wide["fits"] and tight["fits"]
    held = plan.strategy.kept_host_layers
    host = tight["prediction"]["host_memory_gib"]
    assert host == pytest.approx(C.host_process_gib + int(40 // LAYER_MM_GIB) * LAYER_MM_GIB, abs=0.01)
    assert wide["prediction"]["host_memory_gib"] == pytest.approx(C.host_process_gib + held * LAYER_MM_GIB, abs=0.01)
    assert tight["prediction"]["tokens_per_s"] < wide["prediction"]["tokens_per_s"]


def test_with_the_split_pinned_the_host_count_is_still_a_most():
    """--recompute-layers 0 --kept-host-layers 32 with 100 GiB pinnable: the budget holds 21 layers, whose 98 GiB and the
    process's 14.5 overflow the 125 GiB host; a smaller count fits, and the fastest of those is the plan."""
    cl = pinned(100.0)
    plan = advise_by_cost(_req(cl, kept_host_layers=32, checkpoint_layers=0, checkpointing="selective"))
    assert not plan.prediction.oom_risk and plan.strategy.checkpoint_layers == 0
    best = max(
        estimate_time(work(), cl, s, C).tokens_per_s
        for s in (
            dp(checkpointing="selective", checkpoint_layers=0, kept_saves="matmuls", kept_host_layers=h, fused_ops="liger")
            for h in range(int(100 // LAYER_MM_GIB) + 1)
        )
        if estimate_memory(work(), cl, s, C).fits
    )
    assert estimate_time(work(), cl, plan.strategy, C).tokens_per_s == pytest.approx(best, rel=1e-12)


def test_when_no_host_count_fits_the_host_the_split_with_the_fewest_is_kept():
    """A 15 GiB host cannot hold even the training process (14.5 GiB of 13.5 usable): every host count overflows it, and
    the variant handed back for the OOM report is the one needing the least host RAM."""
    from seqpar.advisor.search import layer_split_variant

    cl = h200(15.0)
    whole = dp(checkpointing="selective", fused_ops="liger")
    v = layer_split_variant(work(), cl, whole, C, _req(cl, kept_host_layers=32))
    assert v is not None and v.kept_host_layers == 0 and not estimate_memory(work(), cl, v, C).fits


def test_check_of_a_plan_keeps_its_stated_budget_and_names_it_when_the_host_shrinks(tmp_path):
    out = tmp_path / "plan.json"
    _advise_75(out)
    held = LaunchPlan.load(out).strategy.kept_host_layers
    # re-declared cluster flags: the plan's 75 GiB still holds every host-kept layer (what seqpar launch would pin)
    got = json.loads(run("check", out, "--gpu", "h200", "--host-ram-gib", "125", "--json").stdout)
    assert got["prediction"]["host_memory_gib"] == pytest.approx(C.host_process_gib + held * LAYER_MM_GIB, abs=0.01)
    r = run("check", out, "--host-ram-gib", "64")
    assert (
        r.exit_code == 2
        and "the plan's pinned_host_gib 75: pinned_host_gib 75 is more than the node's host_ram_gib 64" in r.output
    )
