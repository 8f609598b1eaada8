"""The cost model's view of fused_ops (Liger-Kernel) and tiled_mlp (ALST's TiledMLP): memory and time terms by hand, the
search and its pins, the CLI flags."""

import json

import pytest
from typer.testing import CliRunner

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import load_coefficients
from seqpar.advisor.cost.memory import estimate_memory, kept_bytes_per_token, mlp_tile_tokens, saved_bytes_per_token
from seqpar.advisor.cost.predict import predict
from seqpar.advisor.cost.throughput import elementwise_time, estimate_time, linear_flops_per_token, width_efficiency
from seqpar.advisor.gate import check
from seqpar.advisor.request import AdviseRequest
from seqpar.advisor.search import advise_by_cost, describe, enumerate_strategies, max_seq_len
from seqpar.cli import app
from seqpar.plan.errors import SeqparError
from seqpar.plan.launch_plan import LaunchPlan
from seqpar.plan.specs import Strategy, Workload
from seqpar.profiles import get_model

from seqpar_testing.advisor import TINY

C = load_coefficients()
M7 = get_model("llama-2-7b")
H200 = cluster_from_flags("h200", 1)
W64 = Workload(model=M7, seq_len=65536, optimizer="none")


def dp(ck="offload", **kw) -> Strategy:
    return Strategy(mode="data_parallel", checkpointing=ck, sharding="ddp", loss_impl="chunked", **kw)


# --------------------------------------------------------------------------------------------- memory


def test_saved_bytes_per_token_by_hand():
    attn = 2 * 2 * 4 * 16 + 2 * 2 * 2 * 16 + 4 * 4  # q, out; k, v; fp32 lse (o_proj saves out itself)
    assert saved_bytes_per_token(TINY, "bf16") == 2 * (4 + 4) * 64 + attn + 4 * 2 * 128
    # liger: each norm's output (bf16) and fp32 rstd, the post-attention norm's input; SwiGLU keeps gate and up (+ the product)
    assert saved_bytes_per_token(TINY, "bf16", fused_ops="liger") == 2 * (2 * 64 + 4) + 2 * 64 + attn + 3 * 2 * 128
    assert saved_bytes_per_token(TINY, "bf16", residual=4, fused_ops="liger") == 2 * (2 * 64 + 4) + 4 * 64 + attn + 3 * 2 * 128
    # tiled: the MLP saves nothing, fused or not
    assert saved_bytes_per_token(TINY, "bf16", tiled_mlp=True) == 2 * (4 + 4) * 64 + attn
    assert saved_bytes_per_token(TINY, "bf16", fused_ops="liger", tiled_mlp=True) == 2 * (2 * 64 + 4) + 2 * 64 + attn
    # no checkpointing: Liger's input norm also keeps the layer input itself
    none_liger = kept_bytes_per_token(TINY, "bf16", dp("none", fused_ops="liger"))
    assert none_liger == saved_bytes_per_token(TINY, "bf16", fused_ops="liger") + 2 * 64
    assert kept_bytes_per_token(TINY, "bf16", dp("full", fused_ops="liger", tiled_mlp=True)) == 2 * 64  # the layer input only


def test_tile_is_about_h_tokens():
    assert mlp_tile_tokens(65536, 4096) == 4096
    assert mlp_tile_tokens(65536 + 1, 4096) == 3856  # ceil(65537 / 17)
    assert mlp_tile_tokens(1000, 4096) == 1000  # shorter than h: one tile


def test_tiled_lowers_the_peak_by_at_least_the_mlp_intermediates():
    """Llama-2-7B, 64K, one H200, offload, optimizer none: the peak is the end of backward (weights + all gradients + one
    layer's recompute); tiling removes the layer's four (t, I) MLP intermediates from the recompute and two of their
    gradients, and adds one 4096-token tile of them plus fp32 weight-gradient accumulators of one MLP. seqpar's runtime
    tiles the unfused norms too (their fp32 copies leave the recompute); a tool's TiledMLP leaves them whole, and their
    backward is then the layer's largest moment, which keeps half of what tiling removed."""
    from seqpar.advisor.cost.memory import NORM_BACKWARD_BYTES

    t, h, i, p = 65536, 4096, 11008, 2
    plain, tiled = (estimate_memory(W64, H200, dp(tiled_mlp=x), C) for x in (False, True))
    assert plain.peak_phase == tiled.peak_phase == "backward"
    removed = 4 * p * i * t
    assert plain.peak_bytes - tiled.peak_bytes >= removed  # 5.4 GiB of intermediates, plus their gradients, less the buffers
    # tiled, the layer's backward peaks in attention's backward (dq, dk, dv and cuDNN's fp32 softmax sum per head and
    # token: no GQA, so no full-head dK, dV), no longer in the MLP's; the tiled norms' moment is below it
    attn_grads = t * p * (32 + 2 * 32) * 128 + t * 32 * 4
    buffers = 4096 * 4 * p * i + 3 * h * i * 4
    assert t * 3 * p * h + 4096 * (NORM_BACKWARD_BYTES + 3 * p) * h < t * 2 * p * h + attn_grads
    # the two norms' fp32 copies, out of the rebuilt layer; the tiled input norm's input is the layer input, which the
    # checkpoint holds (counted once)
    norm_copies = 2 * 4 * h * t + p * h * t
    assert plain.peak_bytes - tiled.peak_bytes == pytest.approx(removed + 2 * p * i * t + norm_copies - buffers - attn_grads)
    assert tiled.breakdown["tiled_mlp_buffers"] == buffers
    assert tiled.breakdown["gradient_flow"] == t * 2 * p * h + attn_grads
    # the norms whole (a tool's runtime): the unfused norm's backward, the residual's gradient and five fp32 temporaries
    tool = estimate_memory(W64, H200, dp(tiled_mlp=True), C, norms_tiled=False)
    norm = t * (p + NORM_BACKWARD_BYTES) * h
    assert tool.breakdown["gradient_flow"] == norm
    assert removed > plain.peak_bytes - tool.peak_bytes > removed / 2  # 5.4 GiB of intermediates: 2.7 GiB lower
    assert "tiled_mlp_buffers" not in plain.breakdown
    # the forward's working set: one tile of the MLP instead of the whole sequence's
    assert plain.phases["forward"] - tiled.phases["forward"] == pytest.approx(3 * p * i * (t - 4096))
    # with liger the recomputed tile holds three intermediates, not four
    both = estimate_memory(W64, H200, dp(tiled_mlp=True, fused_ops="liger"), C)
    assert both.breakdown["tiled_mlp_buffers"] == 4096 * 3 * p * i + 3 * h * i * 4


@pytest.mark.parametrize("ck", ["none", "full", "selective", "offload"])
def test_options_lower_the_peak_at_long_context(ck):
    w = Workload(model=M7, seq_len=131072, optimizer="none")
    peaks = {
        (f, x): estimate_memory(w, H200, dp(ck, fused_ops=f, tiled_mlp=x), C).peak_bytes
        for f in ("none", "liger")
        for x in (False, True)
    }
    assert peaks[("liger", False)] < peaks[("none", False)]
    assert peaks[("none", True)] < peaks[("none", False)]
    assert peaks[("liger", True)] < min(peaks[("liger", False)], peaks[("none", True)])


# --------------------------------------------------------------------------------------------- time


def test_elementwise_traffic_by_hand():
    """Llama-2-7B at 64K on an H200 (4.8 TB/s), checkpointing: 4 passes of 68h + 24(a+kv)d + 10I bytes (unfused) or
    8h + 4(a+kv)d + 6I (liger) per token and layer: about 1.0 s against 0.23 s per step."""
    unfused = 65536 * 32 * (68 * 4096 + 24 * 64 * 128 + 10 * 11008) * 4 / 4800e9
    fused = 65536 * 32 * (8 * 4096 + 4 * 64 * 128 + 6 * 11008) * 4 / 4800e9
    assert elementwise_time(M7, H200, dp("full"), 65536) == pytest.approx(unfused) == pytest.approx(1.0227, abs=1e-3)
    assert (
        elementwise_time(M7, H200, dp("full", fused_ops="liger"), 65536)
        == pytest.approx(fused)
        == pytest.approx(0.2300, abs=1e-3)
    )
    assert elementwise_time(M7, H200, dp("none"), 65536) == pytest.approx(unfused * 3 / 4)  # no recompute pass
    # tiled: the SwiGLU's bytes once more (its extra forward), and in seqpar's runtime the unfused norms' (their tiles
    # recomputed in backward: 68h less the residual adds' 12h); a tool's TiledMLP, or Liger's norms, the SwiGLU's alone
    swiglu, norms = 65536 * 32 * 10 * 11008 / 4800e9, 65536 * 32 * 56 * 4096 / 4800e9
    assert elementwise_time(M7, H200, dp("full", tiled_mlp=True), 65536) == pytest.approx(unfused + swiglu + norms)
    assert elementwise_time(M7, H200, dp("full", tiled_mlp=True), 65536, norms_tiled=False) == pytest.approx(unfused + swiglu)


@pytest.mark.parametrize("ck", ["full", "selective", "offload"])
def test_fused_is_faster(ck):
    plain, fused = (estimate_time(W64, H200, dp(ck, fused_ops=f), C) for f in ("none", "liger"))
    assert fused.step_time_s < plain.step_time_s
    assert plain.step_time_s - fused.step_time_s == pytest.approx(
        plain.breakdown_s["elementwise"] - fused.breakdown_s["elementwise"]
    )
    assert sum(fused.breakdown_s.values()) == pytest.approx(fused.step_time_s)


@pytest.mark.parametrize("ck", ["none", "full", "selective", "offload"])
def test_tiled_costs_one_more_mlp_forward(ck):
    h, i, L, t = 4096, 11008, 32, 65536
    assert linear_flops_per_token(M7, ck, "chunked", True) - linear_flops_per_token(M7, ck, "chunked") == 2 * 3 * h * i * L
    plain, tiled = (estimate_time(W64, H200, dp(ck, tiled_mlp=x), C) for x in (False, True))
    extra_ideal = t * 2 * 3 * h * i * L / (C.kernel_rate_tflops(H200, "matmul") * 1e12) / width_efficiency(h, C.matmul_width_h0)
    assert tiled.parts_s["linear_ideal"] - plain.parts_s["linear_ideal"] == pytest.approx(extra_ideal)
    lin_factor = C.factors(H200)[0]
    # MLP matmuls + the SwiGLU pass + the tiled norms' pass (seqpar's runtime: 56h of the unfused norms' bytes)
    extra = lin_factor * extra_ideal + t * L * (10 * i + 56 * h) / (4800e9 * C.elementwise_efficiency)
    if ck == "offload":  # more compute hides a little more of the offload traffic
        assert tiled.step_time_s > plain.step_time_s + 0.2 * extra
    else:
        assert tiled.step_time_s - plain.step_time_s == pytest.approx(extra, rel=1e-9)


# --------------------------------------------------------------------------------------------- search


def _req(seq_len=65536, **pins) -> AdviseRequest:
    return AdviseRequest(model=M7, seq_len=seq_len, cluster=H200, optimizer="none", **pins)


def test_search_enumerates_tiled_and_pins_fused():
    valid, invalid = enumerate_strategies(_req(), W64)
    assert {s.tiled_mlp for s in valid} == {False, True} and {s.fused_ops for s in valid} == {"none"}
    valid, _ = enumerate_strategies(_req(fused_ops="liger", tiled_mlp=False), W64)
    assert {s.fused_ops for s in valid} == {"liger"} and not any(s.tiled_mlp for s in valid)
    # tiled with ZeRO-3: invalid, with the reason
    a100 = cluster_from_flags("a100", 8)
    req = AdviseRequest(model=M7, seq_len=131072, cluster=a100, sharding="zero3", tiled_mlp=True)
    valid, invalid = enumerate_strategies(req, req.workload())
    assert not valid and invalid and all("tiled_mlp with sharding zero3" in why for _, why in invalid if _ is not None)
    with pytest.raises(SeqparError, match="tiled_mlp with sharding zero3"):
        advise_by_cost(req)
    valid, invalid = enumerate_strategies(AdviseRequest(model=M7, seq_len=131072, cluster=a100), req.workload())
    assert not any(s.tiled_mlp and s.sharding.startswith("zero3") for s in valid)
    assert any(s is not None and s.tiled_mlp and s.sharding == "zero3_offload" for s, _ in invalid)


def test_search_honours_pins():
    pinned = advise_by_cost(
        _req(
            mode="data_parallel", checkpointing="offload", sharding="ddp", loss_impl="chunked", tiled_mlp=True, fused_ops="liger"
        )
    )
    assert pinned.strategy == dp(tiled_mlp=True, fused_ops="liger") and pinned.rationale.policy == "pinned"
    assert pinned.prediction == predict(W64, H200, pinned.strategy)
    free = advise_by_cost(_req())
    assert free.strategy.fused_ops == "none" and not free.strategy.tiled_mlp  # tiled is slower; it fits without it
    # liger is not picked unasked, but the rationale says what it would give
    assert any(r.startswith("fused_ops liger") and "pip install liger-kernel" in r for r in free.rationale.reasons)
    assert any(
        a.strategy.fused_ops == "liger" and a.prediction.tokens_per_s > free.prediction.tokens_per_s
        for a in free.rationale.alternatives
    )
    assert "liger" not in " ".join(advise_by_cost(_req(fused_ops="none")).rationale.reasons)


def test_tiled_under_a_split_is_explained_by_speed_not_by_a_negative_saving():
    """At 512K on one H200 with a 125 GiB host the untiled twin fits too, by offloading more layers: tiling buys the
    layers it keeps on the GPU (speed), and the reason says so with both rates, not a memory saving below zero."""
    cl = cluster_from_flags("h200", 1, host_ram_gib=125)
    req = AdviseRequest(
        model=M7,
        seq_len=524288,
        cluster=cl,
        optimizer="none",
        mode="data_parallel",
        checkpointing="offload",
        fused_ops="liger",
        sharding="ddp",
        loss_impl="chunked",
    )
    plan = advise_by_cost(req)
    assert plan.strategy.tiled_mlp and plan.strategy.offload_layers is not None
    line = next(r for r in plan.rationale.reasons if r.startswith("tiled_mlp: without it"))
    assert "fits at" in line and f"{plan.prediction.tokens_per_s:,.0f} tokens/s" in line and "saves -" not in line, line


def test_tiled_wins_only_where_the_untiled_twin_does_not_fit():
    """At the edge of what offload fits on one H200, the search turns tiling on and says why; max_seq_len honours the pin."""
    pins = dict(optimizer="none", checkpointing="offload", sharding="ddp", loss_impl="chunked")
    plain = max_seq_len(M7, H200, ["data_parallel"], tiled_mlp=False, **pins)["data_parallel"]
    tiled = max_seq_len(M7, H200, ["data_parallel"], tiled_mlp=True, **pins)["data_parallel"]
    free = max_seq_len(M7, H200, ["data_parallel"], **pins)["data_parallel"]
    assert tiled[0] > plain[0] > 0 and free[0] == tiled[0] and free[1].tiled_mlp and not plain[1].tiled_mlp
    plan = advise_by_cost(_req(seq_len=tiled[0], mode="data_parallel", **{k: v for k, v in pins.items() if k != "optimizer"}))
    assert plan.strategy.tiled_mlp and not plan.prediction.oom_risk and plan.rationale.policy == "cost"
    assert any(r.startswith("tiled_mlp: without it") for r in plan.rationale.reasons)
    # the untiled strategy pinned there risks OOM, and `check` names tiling as the fix
    res = check(
        _req(seq_len=tiled[0], mode="data_parallel", tiled_mlp=False, **{k: v for k, v in pins.items() if k != "optimizer"})
    )
    assert not res.fits and res.exit_code == 1
    assert res.fix_strategy == plan.strategy and res.fix.startswith("tiled_mlp")


def test_check_honours_the_plans_options():
    plan = advise_by_cost(
        _req(mode="data_parallel", checkpointing="full", sharding="ddp", loss_impl="chunked", tiled_mlp=True, fused_ops="liger")
    )
    res = check(plan)
    assert res.fits and res.prediction == predict(W64, H200, plan.strategy)
    assert "mlp=tiled ops=liger" in describe(plan.strategy)
    with pytest.raises(SeqparError, match="fused_ops liger runs"):
        check(plan.model_copy(update={"cluster": cluster_from_flags("cpu", 1)}), cluster_from_flags("cpu", 1))
    with pytest.raises(ValueError, match="fused_ops liger runs"):
        AdviseRequest(model=M7, seq_len=1024, cluster=cluster_from_flags("cpu", 2), fused_ops="liger")


# --------------------------------------------------------------------------------------------- CLI


runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_writes_the_options_into_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    r = run(
        "advise",
        "--seq-len",
        "64k",
        "--model",
        "llama-2-7b",
        "--gpu",
        "h200",
        "--gpus",
        "1",
        "--tiled-mlp",
        "--fused-ops",
        "liger",
        "-o",
        out,
    )
    assert r.exit_code == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["strategy"]["fused_ops"] == "liger" and data["strategy"]["tiled_mlp"] is True
    assert "fused ops" in r.stdout and "tiled MLP" in r.stdout
    plan = LaunchPlan.load(out)
    assert plan.prediction == predict(plan.workload, plan.cluster, plan.strategy)
    r = run("advise", "--seq-len", "64k", "--gpu", "h200", "--gpus", "1", "--optimizer", "none", "--no-tiled-mlp", "--json")
    s = json.loads(r.stdout)["strategy"]
    assert r.exit_code == 0 and s["tiled_mlp"] is False and s["fused_ops"] == "none"
    r = run("advise", "--seq-len", "64k", "--gpu", "h200", "--gpus", "1", "--tiled-mlp", "--policy", "rules", "--json")
    s = json.loads(r.stdout)["strategy"]  # the rules' ZeRO-3 offload cannot tile: FSDP instead
    assert r.exit_code == 0 and s["tiled_mlp"] is True and s["sharding"] == "fsdp"
    r = run(
        "check",
        "--seq-len",
        "64k",
        "--gpu",
        "h200",
        "--gpus",
        "1",
        "--optimizer",
        "none",
        "--mode",
        "data_parallel",
        "--checkpointing",
        "offload",
        "--sharding",
        "ddp",
        "--loss-impl",
        "chunked",
        "--tiled-mlp",
        "--fused-ops",
        "liger",
        "--json",
    )
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["strategy"]["tiled_mlp"] is True and d["strategy"]["fused_ops"] == "liger"
    assert d["prediction"]["step_time_breakdown_s"]["elementwise"] > 0


@pytest.mark.parametrize(
    "cmd",
    [
        ["advise", "--seq-len", "4k", "--model", "tiny", "--gpu", "cpu", "--gpus", "1"],
        ["advise", "--seq-len", "256", "--model", "tiny", "--cluster", "cpu:2"],
        ["check", "--seq-len", "256", "--model", "tiny", "--cluster", "cpu:2"],
    ],
)
def test_cli_refuses_liger_without_cuda(tmp_path, cmd):
    out = tmp_path / "plan.json"
    r = run(*cmd, "--fused-ops", "liger", *(["-o", out] if cmd[0] == "advise" else []))
    assert r.exit_code == 2, (r.stdout, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: fused_ops liger runs Triton kernels on CUDA GPUs (Liger-Kernel)") and "use fused_ops none" in last
    )
    assert r.stdout == "" and not out.exists()
