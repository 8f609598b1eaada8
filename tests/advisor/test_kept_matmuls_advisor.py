"""The advisor's side of kept_saves matmuls and kept_host_layers (seqpar.runtime.memory.matmul_keep): the memory model holds
each kept layer's matmul outputs instead of everything it saves, the time model drops their matmuls' recomputation but
not the elementwise one, host-kept layers move those bytes to the host and back (priced as pinned copies, the ones
beyond the pinned budget recomputed), and the search uses it only when pinned, saying so when it would be faster.
No torch (the runtime's side, against a real model: tests/runtime/memory/test_matmul_keep.py)."""

import pytest

from seqpar.advisor.cost.memory import (
    estimate_memory,
    host_bytes,
    kept_by_layer,
    kept_bytes_per_token,
    kept_host_matmuls,
    matmul_bytes_per_token,
    saved_bytes_per_token,
)
from seqpar.advisor.cost.throughput import elementwise_bytes_per_token, estimate_time
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.options import PINNED_FRACTION, layer_split
from seqpar.plan.units import GIB

from seqpar_testing.advisor import L7, M7, C, dp, h200, work

S = 65536


def sel(ck, saves="all", host=0, **kw):
    return dp(checkpointing="selective", checkpoint_layers=ck, kept_saves=saves, kept_host_layers=host, fused_ops="liger", **kw)


def test_the_split_orders_checkpointed_then_kept_layers_with_the_host_kept_spread_among_them():
    cut = layer_split("selective", 32, 15, None, "matmuls", 10)
    assert (cut.checkpointed, cut.kept, cut.kept_host, cut.kept_gpu, cut.matmuls) == (15, 17, 10, 7, True)
    # floor(j * 17 / 10) past the 15 checkpointed layers: the first kept layer first, the top one on the GPU
    assert cut.host_kept == (15, 16, 18, 20, 21, 23, 25, 26, 28, 30)
    assert layer_split("full", 32, 0, None, "matmuls", 15).host_kept == (0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29)
    assert layer_split("full", 32, 0, None, "matmuls", 32).host_kept == tuple(range(32))  # all of them
    assert layer_split("full", 32, 0, None, "matmuls", 31).host_kept == tuple(range(31))  # the top one stays
    assert layer_split("full", 32, 28, None, "matmuls", 1).host_kept == (28,)
    assert layer_split("full", 32, 28, None, "matmuls", 0).host_kept == ()
    assert layer_split("selective", 32, 32, None, "matmuls", 3).matmuls is False  # no kept layer: nothing to keep
    assert layer_split("full", 32, 30, None, "matmuls", 9).kept_host == 2  # clipped to the kept layers


def test_a_matmul_kept_layer_holds_its_projections_instead_of_everything():
    w, s_all, s_mm, s_host = work(), sel(15), sel(15, "matmuls"), sel(15, "matmuls", 10)
    p = 2
    mm = matmul_bytes_per_token(M7, "bf16")
    h, a, d, i = M7.hidden_size, M7.num_attention_heads, M7.head_dim, M7.intermediate_size
    assert mm == p * (3 * a * d + h + 2 * i)  # q, k, v (MHA), o, gate, up: 4.69 GiB at 64K for Llama-2-7B
    assert abs(mm * S / GIB - 4.6875) < 1e-9
    around = kept_bytes_per_token(M7, "bf16", s_mm, p, "selective")
    full = kept_bytes_per_token(M7, "bf16", s_all, p, "none")
    assert full == saved_bytes_per_token(M7, "bf16", p, "liger") + p * h
    assert kept_by_layer(M7, "bf16", s_all, p)[15:] == [full] * 17
    assert kept_by_layer(M7, "bf16", s_mm, p)[15:] == [around + mm] * 17
    on_host = layer_split("selective", 32, 15, None, "matmuls", 10).host_kept
    assert kept_by_layer(M7, "bf16", s_host, p)[15:] == [around if j in on_host else around + mm for j in range(15, 32)]
    mems = [estimate_memory(w, h200(), s, C) for s in (s_all, s_mm, s_host)]
    held = [m.phase_terms["forward"]["checkpointed_activations"] for m in mems]
    assert held[0] - held[1] == 17 * (full - around - mm) * S
    assert held[1] - held[2] == 10 * mm * S
    assert mems[0].peak_bytes > mems[1].peak_bytes > mems[2].peak_bytes
    # the host holds 10 layers' matmul outputs more
    assert host_bytes(w, h200(), s_host, C) - host_bytes(w, h200(), s_mm, C) == pytest.approx(10 * mm * S)


def test_kept_matmuls_are_not_recomputed_but_their_elementwise_ops_are():
    w = work()
    t_all, t_mm = estimate_time(w, h200(), sel(15), C), estimate_time(w, h200(), sel(15, "matmuls"), C)
    assert t_all.parts_s["linear_ideal"] == t_mm.parts_s["linear_ideal"]  # the same 15 layers recompute their matmuls
    total, _ = elementwise_bytes_per_token(M7, "liger")
    extra = 17 * total * S / (h200().gpu.hbm_bandwidth_gb_s * 1e9 * C.elementwise_efficiency)
    assert t_mm.parts_s["elementwise"] - t_all.parts_s["elementwise"] == pytest.approx(extra)
    # fewer layers recomputed: faster
    assert estimate_time(w, h200(), sel(10, "matmuls"), C).tokens_per_s > t_mm.tokens_per_s


def test_host_kept_layers_beyond_the_pinned_budget_are_recomputed():
    w, small = work(), h200(host_gib=40.0)  # 40% of 40 GiB: 3 layers of 4.69 GiB
    kept, layer, fit = kept_host_matmuls(w, small, sel(5, "matmuls", 10))
    assert (kept, layer, fit) == (10, pytest.approx(4.6875 * GIB), int(PINNED_FRACTION * 40 // 4.6875))
    roomy = estimate_time(w, h200(), sel(5, "matmuls", 10), C)
    tight = estimate_time(w, small, sel(5, "matmuls", 10), C)
    assert tight.parts_s["linear_ideal"] > roomy.parts_s["linear_ideal"]  # 7 layers' matmuls run again
    assert roomy.breakdown_s["offload"] > 0


def _req(seq_len=S, **pins):
    base = {"mode": "data_parallel", "sharding": "ddp", "fused_ops": "liger", "optimizer": "none"}
    return AdviseRequest(model=M7, seq_len=seq_len, cluster=h200(), **{**base, **pins})


def test_the_search_uses_kept_matmuls_only_when_pinned_and_says_when_it_would_be_faster():
    plain = advise_by_cost(_req())
    assert plain.strategy.kept_saves == "all"
    note = [r for r in plain.rationale.reasons if r.startswith("kept_saves matmuls")]
    assert len(note) == 2 and note[0].endswith(": pin --kept-saves matmuls to use it (the search uses it only when pinned)")
    pinned = advise_by_cost(_req(kept_saves="matmuls"))
    s = pinned.strategy
    assert s.kept_saves == "matmuls" and s.kept_host_layers == 0
    assert s.checkpoint_layers < plain.strategy.checkpoint_layers  # the memory freed keeps more layers
    assert pinned.prediction.tokens_per_s > plain.prediction.tokens_per_s
    assert f"{pinned.prediction.tokens_per_s:,.0f} tokens/s" in note[0] and f"{s.checkpoint_layers} of 32 layers" in note[0]
    gain = pinned.prediction.tokens_per_s / plain.prediction.tokens_per_s - 1
    assert f"({gain:+.1%})" in note[0] and f"at a peak of {pinned.prediction.peak_memory_gib:.1f} GiB" in note[0]
    assert not pinned.prediction.oom_risk
    LaunchPlan.model_validate(pinned.model_dump())  # a valid plan
    # faster still with host-kept layers: the second note is the plan its own pins give, the count the pinned budget's
    host = advise_by_cost(_req(kept_saves="matmuls", kept_host_layers=L7))
    h = host.strategy
    budget = int(PINNED_FRACTION * 125 // 4.6875)  # 10 layers' 4.69 GiB in 40% of the 125 GiB host
    assert h.kept_host_layers == budget and h.checkpoint_layers < s.checkpoint_layers
    assert host.prediction.tokens_per_s > pinned.prediction.tokens_per_s and not host.prediction.oom_risk
    assert (
        f"with {budget} kept layers' matmul outputs in pinned host memory ({budget * 4.6875:.1f} GiB; the pinned budget"
        in note[1]
    )
    assert f"{host.prediction.tokens_per_s:,.0f} tokens/s" in note[1] and f"{h.checkpoint_layers} of 32 layers" in note[1]
    gain = host.prediction.tokens_per_s / plain.prediction.tokens_per_s - 1
    assert f"({gain:+.1%})" in note[1] and f"at a peak of {host.prediction.peak_memory_gib:.1f} GiB" in note[1]
    assert note[1].endswith(": pin --kept-saves matmuls --kept-host-layers 32 to use it (the search uses it only when pinned)")
    # kept_saves pinned: no note of either kind
    assert not [r for r in pinned.rationale.reasons if r.startswith("kept_saves matmuls")]
    assert not [r for r in host.rationale.reasons if r.startswith("kept_saves matmuls")]


def test_the_host_kept_note_stands_alone_and_says_when_the_budget_is_not_what_bounds_it():
    """The host-kept note reads on its own and gives the plan its own pins give: with 50 GiB pinned the budget caps the
    count (10 layers' 46.9 GiB, an 11th would not fit) and the note says so; with 75 GiB the search's own choice (14
    host-kept layers, 65.6 GiB, none recomputed: a 15th would only add copies) is not the budget's, and the note names no
    bound."""
    for pinned_gib, bound in ((50.0, True), (75.0, False)):
        cl = h200().model_copy(update={"pinned_host_gib": pinned_gib})
        req = AdviseRequest(
            model=M7, seq_len=S, cluster=cl, mode="data_parallel", sharding="ddp", fused_ops="liger", optimizer="none"
        )
        notes = [r for r in advise_by_cost(req).rationale.reasons if r.startswith("kept_saves matmuls with")]
        host = advise_by_cost(req.model_copy(update={"kept_saves": "matmuls", "kept_host_layers": L7}))
        h = host.strategy
        assert len(notes) == 1 and not host.prediction.oom_risk and h.kept_host_layers == (10 if bound else 14)
        assert f"with {h.kept_host_layers} kept layers' matmul outputs" in notes[0]
        assert f"{host.prediction.tokens_per_s:,.0f} tokens/s" in notes[0]
        assert ("the pinned budget" in notes[0]) is bound


def test_a_pinned_host_count_is_capped_by_the_pinned_budget_and_the_kept_layers():
    plan = advise_by_cost(_req(kept_saves="matmuls", kept_host_layers=40))
    s = plan.strategy
    budget = int(PINNED_FRACTION * 125 // 4.6875)  # 10 layers' 4.69 GiB in 40% of the 125 GiB host
    assert s.kept_host_layers == budget < L7 - s.checkpoint_layers
    # 2 kept layers: at most 2 on the host; with memory to spare, keeping them on the GPU (no copies) is the fastest
    few = advise_by_cost(_req(kept_saves="matmuls", kept_host_layers=3, checkpoint_layers=30)).strategy
    speeds = {h: estimate_time(work(), h200(), sel(30, "matmuls", h), C).tokens_per_s for h in range(3)}
    assert few.checkpoint_layers == 30 and few.kept_host_layers == max(speeds, key=speeds.get) == 0
    assert plan.prediction.host_memory_gib == pytest.approx(C.host_process_gib + budget * 4.6875)


@pytest.mark.parametrize(
    "pins, words",
    [
        ({"kept_host_layers": 3}, "only --kept-saves matmuls keeps"),
        ({"kept_saves": "matmuls", "tiled_mlp": True}, "drop one of them"),
        ({"kept_host_layers": 3, "kept_saves": "matmuls"}, None),
    ],
)
def test_request_refusals(pins, words):
    if words is None:
        _req(**pins)
        return
    with pytest.raises((SeqparError, ValueError), match=words):  # pydantic wraps the validator's SeqparError
        _req(**pins)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"kept_saves": "matmuls"}, "there are none"),
        ({"checkpoint_layers": 20, "kept_host_layers": 2}, "kept_saves is all"),
        ({"checkpoint_layers": 20, "kept_saves": "matmuls", "kept_host_layers": 13}, "at most 12"),
        ({"checkpoint_layers": 20, "kept_saves": "matmuls", "tiled_mlp": True}, "tiled_mlp"),
    ],
)
def test_plan_refusals(fields, words):
    plan = advise_by_cost(_req())
    data = plan.model_dump()
    data["strategy"] = {**data["strategy"], "checkpoint_layers": None, **fields}
    with pytest.raises(ValueError, match=words):
        LaunchPlan.model_validate(data)


@pytest.mark.parametrize("seq_len", [192 * 1024, 256 * 1024, 512 * 1024])
def test_pinned_matmuls_at_lengths_where_no_layer_is_kept_give_a_valid_plan_and_say_so(seq_len):
    """At long lengths the winner may tile its MLP or offload every layer: no layer keeps its matmul outputs then. The
    plan is valid (tiled + matmuls is never formed) and the rationale says the pin had no effect."""
    plan = advise_by_cost(_req(seq_len, kept_saves="matmuls"))
    LaunchPlan.model_validate(plan.model_dump())
    s = plan.strategy
    if s.kept_saves == "matmuls":
        assert not s.tiled_mlp and s.checkpoint_layers < L7
    else:
        assert any(r.startswith("kept_saves matmuls was pinned, but") for r in plan.rationale.reasons)
    for alt in plan.rationale.alternatives:
        LaunchPlan.model_validate({**plan.model_dump(), "strategy": alt.strategy.model_dump()})


def test_the_top_host_kept_layer_backward_counts_its_outputs_and_the_ones_below():
    """With one GPU-kept layer above the host-kept ones, that layer's backward holds the top host layer's prefetched
    outputs; the peak does not drop as a GPU-kept layer moves to the host."""
    w = work()
    peaks = [estimate_memory(w, h200(), sel(20, "matmuls", kh), C).phase_terms["backward"] for kh in (10, 11, 12)]
    totals = [sum(p.values()) for p in peaks]
    assert totals[0] >= totals[1] >= totals[2]


def test_the_top_host_layers_fetch_is_exposed_when_no_gpu_kept_layer_starts_it():
    from seqpar_testing.advisor import both

    w = work()
    _, some_gpu = both(w, h200(), sel(22, "matmuls", 9))  # 9 host-kept layers, one GPU-kept above them
    _, none_gpu = both(w, h200(), sel(22, "matmuls", 10))  # all 10 kept layers on the host
    extra = none_gpu.breakdown_s["offload"] - some_gpu.breakdown_s["offload"]
    one_way = 4.6875 * GIB / (C.pinned_copy_gb_s * 1e9)
    # one more layer's round trip, partly hidden, plus the top layer's copy back in full
    assert extra == pytest.approx(one_way + 2 * one_way * (1 - C.side_copy_overlap), rel=1e-6)
