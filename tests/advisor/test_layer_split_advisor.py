"""The advisor's side of the per-layer checkpointing split (strategy.checkpoint_layers / offload_layers): the memory and
time models at the split's ends equal the whole-model policies they become, move monotonically in between, price pageable
copies beyond the pinned budget, and the search and the OOM gate pick the split memory allows. No torch."""

import pytest

from seqpar.advisor.cost.memory import estimate_memory, host_bytes
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.advisor.gate import check
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost, layer_split_variant, max_seq_len
from seqpar.plan.options import LayerSplit, layer_split, pinned_block
from seqpar.plan.units import GIB

from seqpar_testing.advisor import L7, M1, M7, C, both, dp, h200, work


def test_layer_split_counts():
    assert layer_split("none", 32) == LayerSplit(0, 0, 32)
    assert layer_split("full", 32) == LayerSplit(0, 32, 0)
    assert layer_split("selective", 32, 20) == LayerSplit(0, 20, 12)
    assert layer_split("offload", 32) == LayerSplit(32, 0, 0)
    assert layer_split("offload", 32, None, 18) == LayerSplit(18, 14, 0)
    assert layer_split("offload", 32, 24, 10) == LayerSplit(10, 14, 8)
    assert layer_split("offload", 32, 24).checkpointed == 24
    assert pinned_block(3 * GIB) == 4 * GIB and pinned_block(2 * GIB) == 2 * GIB


@pytest.mark.parametrize("model,optimizer", [(M7, "none"), (M1, "adamw")])
@pytest.mark.parametrize("fused", ["none", "liger"])
def test_the_ends_of_a_split_are_the_whole_model_policies(model, optimizer, fused):
    """No layer checkpointed is `none`, every layer is the policy itself, no layer offloaded is `full`: memory and time
    agree to the byte and the microsecond, so the split adds no term of its own."""
    w, cl, L = work(model, 32768, optimizer), h200(), model.num_layers
    none = both(w, cl, dp(checkpointing="none", fused_ops=fused))
    for ck in ("full", "selective"):
        zero = both(w, cl, dp(checkpointing=ck, checkpoint_layers=0, fused_ops=fused))
        assert zero[0].peak_bytes == pytest.approx(none[0].peak_bytes, rel=1e-12)
        assert zero[1].step_time_s == pytest.approx(none[1].step_time_s, rel=1e-12)
        whole = both(w, cl, dp(checkpointing=ck, fused_ops=fused))
        every = both(w, cl, dp(checkpointing=ck, checkpoint_layers=L, fused_ops=fused))
        assert every[0].peak_bytes == whole[0].peak_bytes and every[1].step_time_s == whole[1].step_time_s
    full = both(w, cl, dp(checkpointing="full", fused_ops=fused))
    kept = both(w, cl, dp(checkpointing="offload", offload_layers=0, fused_ops=fused))
    assert kept[0].peak_bytes == pytest.approx(full[0].peak_bytes, rel=1e-12)
    assert kept[1].step_time_s == pytest.approx(full[1].step_time_s, rel=1e-12)
    assert host_bytes(w, cl, dp(checkpointing="offload", offload_layers=0), C) == host_bytes(w, cl, dp(checkpointing="full"), C)


@pytest.mark.parametrize("ck", ["full", "selective"])
def test_fewer_layers_checkpointed_cost_memory_and_buy_speed(ck):
    w, cl = work(), h200()
    rows = [both(w, cl, dp(checkpointing=ck, checkpoint_layers=n, fused_ops="liger")) for n in range(L7, -1, -4)]
    peaks = [m.peak_bytes for m, _ in rows]
    speeds = [t.tokens_per_s for _, t in rows]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)


def test_offloading_layers_moves_memory_from_gpu_to_host():
    w, cl = work(seq_len=262144), h200()
    rows = [dp(checkpointing="offload", offload_layers=n, fused_ops="liger") for n in range(0, L7 + 1, 4)]
    peaks = [estimate_memory(w, cl, s, C).peak_bytes for s in rows]
    hosts = [host_bytes(w, cl, s, C) for s in rows]
    # non-increasing: with few inputs left on the GPU the peak moves to the first layer's backward (every layer's
    # gradient present, no input kept below it), where the split no longer changes it
    assert peaks == sorted(peaks, reverse=True) and peaks[0] - peaks[-1] > 20 * GIB
    layer = 2 * M7.hidden_size * 262144  # one layer input, bf16 (optimizer none keeps bf16 parameters)
    assert [h - hosts[0] for h in hosts] == [pytest.approx(n * layer) for n in range(0, L7 + 1, 4)]


def test_pageable_copies_beyond_the_pinned_budget_are_exposed():
    """384K: a 3 GiB layer input takes a 4 GiB pinned block; 40% of a 125 GiB host pins 12 of them, the other 20 layers
    copy through pageable memory, synchronously. A 1 TB host pins all 32 (hidden under compute but for the overlap)."""
    w, s = work(seq_len=393216), dp(checkpointing="offload", fused_ops="liger", tiled_mlp=True)
    small, big = estimate_time(w, h200(125), s, C), estimate_time(w, h200(1000), s, C)
    layer = 2 * M7.hidden_size * 393216
    pinned_small = int(0.4 * 125 * GIB // pinned_block(layer))
    assert pinned_small == 12
    pageable = 2 * (L7 - pinned_small) * layer / (C.pageable_bandwidth_gb_s * 1e9)
    # both hide pinned copies under compute but for (1 - overlap) of them: the difference is the pageable time minus the
    # exposed share of the 20 layers the big host pins
    hidden_share = (1 - C.grad_comm_overlap) * 2 * (L7 - pinned_small) * layer / (C.pinned_copy_gb_s * 1e9)
    assert small.breakdown_s["offload"] - big.breakdown_s["offload"] == pytest.approx(pageable - hidden_share, rel=1e-9)


def test_the_search_keeps_layer_inputs_on_the_gpu_when_they_fit():
    """Llama-2-7B, 384K, one H200, optimizer none, Liger: every layer offloaded (the plan measured at 846 tokens/s)
    fits, but the GPU holds 14 more layer inputs: the search offloads only the rest and predicts it faster. The split it
    picks is the fastest of all 33 (checked one by one)."""
    req = AdviseRequest(
        model=M7, seq_len=393216, cluster=h200(), optimizer="none", fused_ops="liger", mode="data_parallel", sharding="ddp"
    )
    plan = advise_by_cost(req)
    s, w = plan.strategy, req.workload()
    assert s.checkpointing == "offload" and 0 < s.offload_layers < L7 and not plan.prediction.oom_risk
    every = [s.model_copy(update={"offload_layers": n}) for n in range(L7 + 1)]
    fitting = [x for x in every if estimate_memory(w, req.cluster, x, C).fits]
    best = max(fitting, key=lambda x: estimate_time(w, req.cluster, x, C).tokens_per_s)
    assert best == s
    all_host = s.model_copy(update={"offload_layers": None})
    assert estimate_time(w, req.cluster, all_host, C).tokens_per_s < plan.prediction.tokens_per_s
    assert any("offloaded" in r for r in plan.rationale.reasons[:1])


def test_512k_fits_one_h200_only_with_part_of_the_layers_offloaded():
    cl = h200()
    w = work(seq_len=524288)
    all_host = dp(checkpointing="offload", fused_ops="liger", tiled_mlp=True)
    mem = estimate_memory(w, cl, all_host, C)
    assert not mem.fits and mem.reason.startswith("host RAM")
    partial = layer_split_variant(w, cl, all_host, C)
    assert partial is not None and estimate_memory(w, cl, partial, C).fits
    n, strategy = max_seq_len(M7, cl, ["data_parallel"], optimizer="none", fused_ops="liger")["data_parallel"]
    assert n >= 524288 and strategy.checkpointing == "offload" and strategy.offload_layers < L7


def test_check_names_a_layer_split_as_the_fix():
    """A plan that keeps too many layers un-recomputed risks OOM; the gate's cheapest fix recomputes some of them."""
    req = AdviseRequest(
        model=M7,
        seq_len=131072,
        cluster=h200(),
        optimizer="none",
        mode="data_parallel",
        sharding="ddp",
        checkpointing="selective",
        checkpoint_layers=4,
        loss_impl="chunked",
        tiled_mlp=False,
    )
    res = check(req)
    assert not res.fits and res.exit_code == 1
    assert res.fix_strategy is not None and res.fix_strategy.checkpointing == "selective"
    assert 4 < res.fix_strategy.checkpoint_layers < L7 and "checkpointed; layers" in res.fix and "not checkpointed" in res.fix
