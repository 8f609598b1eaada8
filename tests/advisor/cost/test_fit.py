"""Fit: synthetic rows recover known coefficients; the shipped fit reproduces the published rows; calibrate from run reports."""

import json

import pytest

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.fit import D0_GRID, calibrate, evaluate, fit
from seqpar.advisor.cost.measurements import Measurement, load_measurements, row_from_report
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost
from seqpar.plan.errors import SeqparError
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

C = load_coefficients()


def _synthetic(true, gpu="h200", model="llama-2-7b", fused_ops="none"):
    m, cl = get_model(model), cluster_from_flags(gpu, 8)
    rows = []
    for mode, sp, n in (
        ("data_parallel", 1, 32768),
        ("zigzag_ring_attn", 8, 131072),
        ("zigzag_ring_attn", 8, 524288),
        ("ulysses_attn", 8, 262144),
        ("dist_flash_attn", 4, 65536),
    ):
        s = Strategy(mode=mode, sp_degree=sp, dp_degree=8 // sp, sharding="zero3", fused_ops=fused_ops)
        w = Workload(model=m, seq_len=n)
        tps = estimate_time(w, cl, s, true).tokens_per_s
        rows.append(Measurement(f"{mode} {n} {gpu} {model}", "synthetic", w, cl, s, tps, None, False))
    return rows


GLOBAL = C.with_values(time_factors={})  # the shipped values without per-GPU factors: every GPU on the global pair


def test_fit_recovers_known_factors():
    true = GLOBAL.with_values(linear_time_factor=1.37, attn_time_factor=0.83)
    got = fit(_synthetic(true), GLOBAL.with_values(linear_time_factor=1.0, attn_time_factor=1.0))
    assert got.linear_time_factor == pytest.approx(1.37, rel=1e-3)
    assert got.attn_time_factor == pytest.approx(0.83, rel=1e-3)
    assert got.time_factors["h200"]["linear_time_factor"] == pytest.approx(1.37, rel=1e-3)  # the only GPU: same rows, same pair
    assert got.matmul_width_h0 == C.matmul_width_h0  # one model width cannot tell h0 from the linear factor: kept


def test_fit_recovers_n0_on_a_grid():
    true = GLOBAL.with_values(linear_time_factor=1.2, attn_time_factor=1.1, attn_block_tokens=4096.0)
    got = fit(_synthetic(true), GLOBAL.with_values(attn_block_tokens=2048.0), n0_grid=(1024.0, 2048.0, 4096.0, 8192.0))
    assert got.attn_block_tokens == 4096.0 and got.attn_time_factor == pytest.approx(1.1, rel=1e-3)


def test_fit_recovers_h0_from_two_widths():
    true = GLOBAL.with_values(linear_time_factor=1.1, attn_time_factor=1.2, matmul_width_h0=2048.0)
    rows = _synthetic(true) + _synthetic(true, model="llama-3.2-1b")
    got = fit(rows, GLOBAL.with_values(matmul_width_h0=0.0))
    assert got.matmul_width_h0 == 2048.0 and got.linear_time_factor == pytest.approx(1.1, rel=1e-3)


def test_fit_recovers_the_shape_terms_from_widths_heads_and_fused_rows():
    """h0 (two widths), d0 (128- and 64-wide heads) and the elementwise efficiency (fused and unfused layers) at once,
    from a start at none of them; one width, one head width or one kind of layer leaves the term where it was."""
    true = GLOBAL.with_values(
        linear_time_factor=1.05, attn_time_factor=1.1, matmul_width_h0=1024.0, attn_head_dim_d0=48.0, elementwise_efficiency=0.6
    )
    rows = [
        r
        for model in ("llama-2-7b", "llama-3.2-1b", "llama-2-13b")
        for ops in ("none", "liger")
        for r in _synthetic(true, model=model, fused_ops=ops)
    ]
    start = GLOBAL.with_values(matmul_width_h0=0.0, attn_head_dim_d0=0.0, elementwise_efficiency=1.0)
    assert fit(rows, start).attn_head_dim_d0 == 0.0  # d0 is a kernel measurement: searched only when a grid is given
    got = fit(rows, start, d0_grid=D0_GRID)
    assert (got.matmul_width_h0, got.attn_head_dim_d0, got.elementwise_efficiency) == (1024.0, 48.0, 0.6)
    assert got.linear_time_factor == pytest.approx(1.05, rel=1e-3) and got.attn_time_factor == pytest.approx(1.1, rel=1e-3)
    one_kind = fit(_synthetic(true) + _synthetic(true, model="llama-2-13b"), start, d0_grid=D0_GRID)  # 128-wide, unfused
    assert (one_kind.attn_head_dim_d0, one_kind.elementwise_efficiency) == (0.0, 1.0)


def test_per_gpu_factors_where_rows_exist_global_fallback_otherwise():
    h200 = _synthetic(GLOBAL.with_values(linear_time_factor=1.37, attn_time_factor=0.83))
    a100 = _synthetic(GLOBAL.with_values(linear_time_factor=1.8, attn_time_factor=1.05), gpu="a100-80g-sxm")
    got = fit(h200 + a100, GLOBAL)
    assert got.time_factors["h200"]["linear_time_factor"] == pytest.approx(1.37, rel=1e-3)
    assert got.time_factors["h200"]["attn_time_factor"] == pytest.approx(0.83, rel=1e-3)
    assert got.time_factors["a100-80g-sxm"]["linear_time_factor"] == pytest.approx(1.8, rel=1e-3)
    assert got.time_factors["a100-80g-sxm"]["attn_time_factor"] == pytest.approx(1.05, rel=1e-3)
    assert 1.37 < got.linear_time_factor < 1.8  # the global pair, fitted on both GPUs' rows, lies between
    h100 = cluster_from_flags("h100-sxm", 8)  # no rows: the global pair, and the prediction says so
    assert got.factors(h100) == (got.linear_time_factor, got.attn_time_factor)
    w, s = h200[0].workload, h200[0].strategy
    assert predict(w, h100, s, got).coefficients_version == f"{got.version} (global factors, no h100-sxm rows)"
    assert predict(w, h200[0].cluster, s, got).coefficients_version == f"{got.version} (h200 factors)"
    one = fit(h200 + a100[:1], GLOBAL)  # one A100 row cannot pin two factors: the A100 stays on the global pair
    assert set(one.time_factors) == {"h200"}


ALL = load_measurements()
RES = evaluate(ALL, C)


def test_shipped_fit_reproduces_published_rows():
    """EasyContext's five rows: four within 10%; the 128K row is inconsistent with its neighbours (see BENCHMARKS.md)."""
    rows = [e for e in RES.rows if e["source"] == "easycontext_a100.csv"]
    assert len(rows) == 5
    for e in rows:
        limit = 0.30 if e["label"].startswith("zigzag_ring_attn 131072") else 0.10
        assert abs(e["tokens_residual"]) <= limit, e
        assert e["loo_tokens_error"] is not None


def test_shipped_fit_reproduces_our_h200_rows():
    """Every H200 row (seqpar runs of 7B and 1B in each checkpointing / fused / tiled option, stock transformers with its
    OOMs): warm tokens/s within 10% in and out of sample (16K to 160K), peak memory within 10%, every OOM of seqpar's runs
    predicted (no false fit), and with the gate's margin (the worst measured under-prediction of runs like each, see
    seqpar.advisor.cost.margin) no run that trained is flagged either. Stock transformers runs with the default CUDA allocator (seqpar launch sets expandable segments, which the
    model assumes): it can fail earlier than its tensors' sum from fragmentation, so for its rows a predicted OOM must be a
    measured one (no false alarm). The gate counts what seqpar launch needs with expandable segments (the allocator
    gives its cache back before it fails), so the default allocator's runs can fail earlier than it (the 7B at 192K is
    flagged since the gate counts the 1.66 GiB a training process holds outside the allocator, measured on an H100).
    Its early failures are the 7B at 176K, where the predicted peak (126.7 GiB) is the
    105.1 GiB it held plus the 21.5 GiB fp32 logits it could not place in 19.4 GiB free beside 14.6 GiB of fragments, and
    the Llama-3.1-8B (bf16 AdamW) at 48K, which failed holding 93.7 GiB with 23.4 GiB reserved but unallocated and 22.0
    GiB free: its fp32 logits of the 128K vocabulary are 23.5 GiB there."""
    rows = [e for e in RES.rows if e["source"].startswith("h200_")]
    assert len(rows) >= 29
    assert sum(e["measured_oom"] for e in rows) == 7  # stock 7B at 176K, 192K, 208K, 1B at 96K, 8B at 48K, 64K, 96K
    for e in rows:
        if e["measured_tokens_per_s"] is not None:
            assert abs(e["tokens_residual"]) <= 0.10 and abs(e["loo_tokens_error"]) <= 0.10, e
        if e["memory_residual"] is not None:
            assert abs(e["memory_residual"]) <= 0.10, e
        if e["source"] == "h200_stock_transformers.csv":
            assert e["measured_oom"] or not e["predicted_oom"], e
        else:
            assert e["predicted_oom"] or not e["measured_oom"], e
    flagged = [e["label"] for e in rows if e["predicted_oom"] and not e["measured_oom"]]
    assert flagged == []
    early = [e for e in rows if e["measured_oom"] and not e["predicted_oom"]]
    labels = ["data_parallel 180224 x1 h200", "data_parallel 49152 x1 h200"]
    assert [e["label"] for e in early] == labels
    held, logits = 105.14, 180224 * 32000 * 4 / 2**30  # from its OOM message; fp32 logits of the 32K vocabulary
    assert early[0]["predicted_peak_gib"] == pytest.approx(held + logits, rel=0.01)


def test_shipped_coefficients_are_the_fit_output():
    assert set(C.time_factors) == {"a100-80g-sxm", "h200"} == set(RES.coefficients.time_factors)
    for name in ("matmul_width_h0", "attn_head_dim_d0", "elementwise_efficiency"):
        assert getattr(C, name) == getattr(RES.coefficients, name), name
    for r in ALL:
        assert predict(r.workload, r.cluster, r.strategy).tokens_per_s == pytest.approx(
            estimate_time(r.workload, r.cluster, r.strategy, RES.coefficients).tokens_per_s, rel=1e-3
        )


def _report(tmp_path, tokens_per_s, peak, name="report.json"):
    plan = advise_by_cost(AdviseRequest(model=get_model("llama-2-7b"), seq_len=131072, cluster=cluster_from_flags("h200", 8)))
    path = tmp_path / name
    path.write_text(json.dumps({"plan": json.loads(plan.to_json()), "tokens_per_s": tokens_per_s, "peak_memory_gib": peak}))
    return path, plan


def test_calibrate_from_run_report(tmp_path):
    path, plan = _report(tmp_path, 30000.0, 50.0)
    row = row_from_report(json.loads(path.read_text()), "report.json")
    assert row.strategy == plan.strategy and row.tokens_per_s == 30000.0
    out = tmp_path / "coefficients.json"
    res = calibrate([path], out)
    again = load_coefficients(out)
    assert again.version != C.version and again.linear_time_factor == pytest.approx(res.coefficients.linear_time_factor, rel=1e-5)
    labels = [e["label"] for e in res.rows]
    assert len(labels) == len(ALL) + 1 and json.loads(out.read_text())["fit"]["rows"][-1]["measured_peak_gib"] == 50.0


def test_report_without_plan_is_rejected(tmp_path):
    with pytest.raises(SeqparError, match="no 'plan'"):
        row_from_report({"tokens_per_s": 1.0}, "x.json")
    with pytest.raises(SeqparError, match="does not exist"):
        load_measurements([tmp_path / "missing.json"])
