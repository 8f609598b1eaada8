"""Search: the fastest fitting strategy, pins, the guide's choice and departures, max context, the OOM gate; no torch."""

import pytest

from seqpar.advisor.cluster import cluster_from_flags, default_cluster
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.memory import estimate_memory
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.gate import check
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost, enumerate_strategies, max_seq_len
from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import Strategy
from seqpar.profiles import get_model

M7 = get_model("llama-2-7b")
C = load_coefficients()


def every_split(strategies, num_layers):
    """Each strategy, and each of its layer splits: checkpoint_layers 0..L under full / selective, offload_layers 0..L
    under offload."""
    for s in strategies:
        yield s
        key = {"full": "checkpoint_layers", "selective": "checkpoint_layers", "offload": "offload_layers"}.get(s.checkpointing)
        if key:
            yield from (s.model_copy(update={key: n}) for n in range(num_layers + 1))


@pytest.mark.parametrize("seq_len,rules", [(32768, "data_parallel"), (131072, "dist_flash_attn"), (524288, "zigzag_ring_attn")])
def test_cost_search_picks_fastest_fitting(seq_len, rules):
    req = AdviseRequest(model=M7, seq_len=seq_len, cluster=default_cluster())
    plan = advise_by_cost(req)
    p = plan.prediction
    assert not p.oom_risk and plan.rationale.policy == "cost" and plan.rationale.rules_choice == rules
    assert any(r.startswith(f"rules: {rules}") for r in plan.rationale.reasons)
    # nothing that fits is faster (recompute over the whole search, and every layer split of each checkpointing policy:
    # the search bisects for the split, this tries them all)
    valid, _ = enumerate_strategies(req, req.workload())
    fitting = [predict(req.workload(), req.cluster, s) for s in every_split(valid, M7.num_layers)]
    assert max(x.tokens_per_s for x in fitting if not x.oom_risk) == pytest.approx(p.tokens_per_s, rel=1e-3)
    for alt in plan.rationale.alternatives:
        assert alt.prediction is not None and alt.rejected_because


def test_fully_pinned_predicts_exactly_that():
    req = AdviseRequest(
        model=M7,
        seq_len=65536,
        cluster=cluster_from_flags("h200", 1),
        mode="data_parallel",
        checkpointing="full",
        checkpoint_layers=32,  # every layer: the plain policy, which the plan writes without a split
        sharding="ddp",
        optimizer="none",
        loss_impl="hf",
    )
    plan = advise_by_cost(req)
    assert plan.rationale.policy == "pinned"
    assert plan.strategy == Strategy(mode="data_parallel", checkpointing="full", sharding="ddp", loss_impl="hf")
    assert plan.prediction == predict(req.workload(), req.cluster, plan.strategy)


def test_pins_restrict_the_search():
    req = AdviseRequest(model=M7, seq_len=262144, cluster=default_cluster(), mode="ulysses_attn", sharding="zero3")
    plan = advise_by_cost(req)
    assert plan.strategy.mode == "ulysses_attn" and plan.strategy.sharding == "zero3"


def test_invalid_everywhere_raises_with_nearest():
    req = AdviseRequest(model=M7, seq_len=100001, cluster=default_cluster(), mode="zigzag_ring_attn", sp_degree=8)
    with pytest.raises(SeqparError, match="nearest valid: 100000 or 100016"):
        advise_by_cost(req)


def test_gqa_ulysses_degree_checked():
    req = AdviseRequest(model=get_model("llama-3.2-1b"), seq_len=65536, cluster=default_cluster())
    valid, invalid = enumerate_strategies(req, req.workload())
    assert valid and all(s.mode != "ulysses_attn" or 8 % s.sp_degree == 0 for s in valid)


def test_max_seq_len_is_the_edge():
    cl = cluster_from_flags("a100", 8)
    res = max_seq_len(M7, cl, ["zigzag_ring_attn", "data_parallel"], sharding="zero3", checkpointing="full", loss_impl="chunked")
    for mode, (n, s) in res.items():
        assert n > 0 and s is not None
        w = AdviseRequest(model=M7, seq_len=n, cluster=cl).workload()
        assert estimate_memory(w, cl, s, C).fits
        w2 = w.model_copy(update={"seq_len": 2 * n})
        valid, _ = enumerate_strategies(
            AdviseRequest(
                model=M7, seq_len=2 * n, cluster=cl, mode=mode, sharding="zero3", checkpointing="full", loss_impl="chunked"
            ),
            w2,
        )
        assert not any(estimate_memory(w2, cl, v, C).fits for v in valid)
    assert res["zigzag_ring_attn"][0] > res["data_parallel"][0]


def test_check_fits_and_fix():
    ok = check(
        AdviseRequest(
            model=M7,
            seq_len=65536,
            cluster=cluster_from_flags("h200", 1),
            mode="data_parallel",
            checkpointing="full",
            checkpoint_layers=32,  # every layer recomputed: the hf loss's logits are the largest term
            sharding="ddp",
            optimizer="none",
            loss_impl="hf",
        )
    )
    assert ok.fits and ok.exit_code == 0 and ok.biggest_terms[0][0] == "loss_fp32_logits"  # hf loss: (S, V) fp32 logits and grad
    bad = check(
        AdviseRequest(
            model=M7,
            seq_len=212992,
            cluster=cluster_from_flags("h200", 1),
            mode="data_parallel",
            checkpointing="full",
            sharding="ddp",
            optimizer="none",
            loss_impl="hf",
        )
    )
    assert not bad.fits and bad.exit_code == 1 and bad.fix and bad.fix_strategy is not None
    assert estimate_memory(bad.plan.workload, bad.plan.cluster, bad.fix_strategy, C).fits
    assert "-> fits" in bad.fix and bad.fix_strategy != bad.plan.strategy
    slower = check(bad.plan.model_copy(update={"strategy": bad.fix_strategy.model_copy(update={"checkpointing": "offload"})}))
    assert (
        slower.prediction.tokens_per_s
        <= check(bad.plan.model_copy(update={"strategy": bad.fix_strategy})).prediction.tokens_per_s
    )


def test_degree_pins_are_honoured():
    a100x8 = cluster_from_flags("a100", 8)
    with pytest.raises(SeqparError, match="sp_degree 3 does not divide the 8 ranks"):
        advise_by_cost(AdviseRequest(model=M7, seq_len=131072, cluster=a100x8, sp_degree=3))
    s = advise_by_cost(AdviseRequest(model=M7, seq_len=131072, cluster=a100x8, sp_degree=2)).strategy
    assert s.mode != "data_parallel" and s.sp_degree == 2
    s = advise_by_cost(AdviseRequest(model=M7, seq_len=131072, cluster=a100x8, ulysses_degree=4)).strategy
    assert (s.mode, s.ulysses_degree) == ("usp_attn", 4)


def test_deepspeed_only_with_adamw():
    # seqpar's DeepSpeed engine keeps an fp32 master for AdamW: other optimizers are searched on ddp / fsdp only
    req = AdviseRequest(model=M7, seq_len=524288, cluster=cluster_from_flags("a100", 8), optimizer="none")
    valid, _ = enumerate_strategies(req, req.workload())
    assert valid and not any(v.sharding.startswith("zero") for v in valid)


def test_fp16_only_where_losses_are_scaled():
    h100 = cluster_from_flags("h100", 8)
    req = AdviseRequest(model=M7, seq_len=65536, cluster=h100, dtype="fp16")
    valid, _ = enumerate_strategies(req, req.workload())
    assert valid and all(v.sharding.startswith("zero") for v in valid)  # DeepSpeed's loss scaling
    with pytest.raises(SeqparError, match="fp16 needs a zero"):
        advise_by_cost(AdviseRequest(model=M7, seq_len=65536, cluster=h100, dtype="fp16", sharding="ddp"))
    with pytest.raises(ValueError, match="fp16 needs DeepSpeed's loss scaling"):
        AdviseRequest(model=M7, seq_len=65536, cluster=h100, dtype="fp16", optimizer="none")
