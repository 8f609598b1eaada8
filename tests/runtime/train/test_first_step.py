"""The first step apart from warm ones: its prediction (a warm step plus the fixed one-off cost and the page-locking of the
offload's pinned blocks), the bill that counts it once per process, and calibration that fits time only from warm
steps. No torch."""

import json

import pytest

from seqpar.advisor.bill import plan_bill
from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.measurements import row_from_report
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

C = load_coefficients()
M7 = get_model("llama-2-7b")
H200 = cluster_from_flags("h200", 1).model_copy(update={"host_ram_gib": 125.0})


def test_first_step_is_a_warm_step_plus_its_one_off_costs():
    w = Workload(model=M7, seq_len=65536, optimizer="none")
    full = predict(w, H200, Strategy(mode="data_parallel", checkpointing="full"), C)
    assert full.first_step_s == pytest.approx(full.step_time_s + C.first_step_s, abs=1e-3)
    # offload: 32 layer inputs of 64K x 4096 bf16 = 0.5 GiB each, pinned (within 40% of 125 GiB), page-locked once
    off = predict(w, H200, Strategy(mode="data_parallel", checkpointing="offload"), C)
    assert off.first_step_s == pytest.approx(off.step_time_s + C.first_step_s + 32 * 0.5 / C.pinned_alloc_gib_s, abs=1e-3)
    # part of them on the GPU: fewer blocks to page-lock
    part = predict(w, H200, Strategy(mode="data_parallel", checkpointing="offload", offload_layers=8), C)
    assert part.first_step_s - part.step_time_s == pytest.approx(C.first_step_s + 8 * 0.5 / C.pinned_alloc_gib_s, abs=1e-3)


def test_host_kept_matmul_blocks_are_page_locked_at_the_register_rate():
    # 15 of 32 kept layers' matmul outputs in host memory (4.6875 GiB each at 64K), all within a 75 GiB pinned budget:
    # registered in place (touched, then cudaHostRegister), at their own rate, not the offload's cudaHostAlloc'd one
    w = Workload(model=M7, seq_len=65536, optimizer="none")
    cl = H200.model_copy(update={"pinned_host_gib": 75.0})
    s = Strategy(
        mode="data_parallel",
        checkpointing="full",
        checkpoint_layers=0,
        kept_saves="matmuls",
        kept_host_layers=15,
        fused_ops="liger",
    )
    p = predict(w, cl, s, C)
    assert p.first_step_s - p.step_time_s == pytest.approx(C.first_step_s + 15 * 4.6875 / C.pinned_register_gib_s, abs=1e-3)


def test_the_bill_counts_the_first_step_once_per_stage():
    plan = advise_by_cost(AdviseRequest(model=M7, seq_len=65536, cluster=H200, checkpointing="offload", mode="data_parallel"))
    p = plan.prediction
    bill = plan_bill(plan, steps=100)
    assert bill.wall_s == pytest.approx(p.first_step_s + 99 * p.step_time_s)
    older = plan.model_copy(update={"prediction": p.model_copy(update={"first_step_s": None})})  # plans before the field
    assert plan_bill(older, steps=100).wall_s == pytest.approx(100 * p.step_time_s)


def _report(step_times: list[float]) -> dict:
    plan = advise_by_cost(AdviseRequest(model=M7, seq_len=65536, cluster=H200, mode="data_parallel", checkpointing="full"))
    warm = step_times[1:] or step_times
    return {
        "plan": json.loads(plan.model_dump_json()),
        "measured": {
            "tokens_per_s": 65536 * len(warm) / sum(warm),
            "peak_memory_gib": 40.0,
            "step_time_s": sum(warm) / len(warm),
            "first_step_s": step_times[0],
            "warm_steps": len(step_times) - 1,
        },
        "step_times_s": step_times,
    }


def test_calibration_fits_time_only_from_warm_steps():
    warm = row_from_report(_report([20.0, 16.0, 16.0]), "warm.json")
    assert warm.tokens_per_s == pytest.approx(65536 / 16.0) and warm.peak_memory_gib == 40.0
    one = row_from_report(_report([20.0]), "one.json")  # one step: its time carries the one-off costs
    assert one.tokens_per_s is None and one.peak_memory_gib == 40.0
