"""Throughput model: FLOP counts by hand, one step time by hand, and the properties each mode's communication must have."""

import pytest

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.throughput import elementwise_time, estimate_time, linear_flops_per_token, width_efficiency
from seqpar.plan.flops import attention_fwd_flops, matmul_params, model_flops_per_sequence
from seqpar.plan.specs import LinkSpec, Strategy, Workload
from seqpar.profiles import get_model

from seqpar_testing.advisor import TINY

PLAIN = Coefficients(
    version="test",
    linear_time_factor=1.0,
    attn_time_factor=1.0,
    attn_block_tokens=0.0,
    kernel_tflops={"h200": {"matmul": 773, "cudnn": 570, "flash": 322}},
)


def test_attention_flops_by_hand():
    assert attention_fwd_flops(TINY, 1024) == 2 * 1024**2 * 4 * 16 * 2 == 268435456
    m = get_model("llama-2-7b")
    assert attention_fwd_flops(m, 65536) == 2 * 65536**2 * 4096 * 32


def test_linear_flops_by_hand():
    # matmul params: layers without norms 2 * (36992 - 128) = 73728, plus the LM head 256 * 64 = 16384
    assert matmul_params(TINY) == 90112
    assert linear_flops_per_token(TINY, "none", "hf") == 6 * 90112
    assert linear_flops_per_token(TINY, "full", "hf") == 6 * 90112 + 2 * 73728  # layers recomputed
    assert linear_flops_per_token(TINY, "full", "chunked") == 6 * 90112 + 2 * 73728 + 2 * 16384  # logits recomputed too


def test_model_flops_by_hand_and_predicted_mfu_counts_them():
    # 6 * matmul params per token (no input embedding, no norms) + 3.5 x the causal attention forward; no recompute
    assert model_flops_per_sequence(TINY, 1024) == 6 * 90112 * 1024 + 3.5 * 268435456
    m, cl = get_model("llama-2-7b"), cluster_from_flags("h200", 8)
    s = Strategy(mode="zigzag_ring_attn", sp_degree=4, dp_degree=2, checkpointing="full", gradient_accumulation_steps=3)
    t = estimate_time(Workload(model=m, seq_len=65536, micro_batch_size=2), cl, s, load_coefficients())
    sequences = 2 * 2 * 3  # micro-batch x dp x accumulation: what seqpar.runtime.train.report counts per step
    assert t.mfu == pytest.approx(sequences * model_flops_per_sequence(m, 65536) / t.step_time_s / (8 * 989e12), rel=1e-12)


def test_one_gpu_step_time_by_hand():
    cl = cluster_from_flags("h200", 1)
    w = Workload(model=TINY, seq_len=4096, optimizer="none")
    t = estimate_time(w, cl, Strategy(mode="data_parallel", checkpointing="none", sharding="ddp", loss_impl="hf"), PLAIN)
    lin = 4096 * 6 * 90112 / 773e12
    attn = 2 * 4096**2 * 4 * 16 * 2 * 3.5 / 570e12  # fwd + bwd = 3.5 x fwd
    # norms, RoPE, SwiGLU: (68h + 24(a+kv)d + 10I) bytes per token and layer, forward + backward (2) = 3 passes, H200 4.8 TB/s
    elem = 4096 * 2 * (68 * 64 + 24 * 6 * 16 + 10 * 128) * 3 / 4800e9
    assert t.breakdown_s["elementwise"] == pytest.approx(elem, rel=1e-12)
    assert t.step_time_s == pytest.approx(lin + attn + elem, rel=1e-12)
    assert t.tokens_per_s == pytest.approx(4096 / (lin + attn + elem), rel=1e-12)
    assert t.breakdown_s["exposed_comm"] == 0 and t.breakdown_s["optimizer"] == 0
    elem_ck = elem * 4 / 3  # checkpointing recomputes the forward: 4 passes
    t_full = estimate_time(w, cl, Strategy(mode="data_parallel", checkpointing="full", sharding="ddp", loss_impl="hf"), PLAIN)
    assert t_full.step_time_s == pytest.approx(lin + 4096 * 2 * 73728 / 773e12 + attn * 4.5 / 3.5 + elem_ck, rel=1e-12)
    # selective recomputes the layers' matmuls but not attention's forward: attention stays at 3.5 x forward
    t_sel = estimate_time(w, cl, Strategy(mode="data_parallel", checkpointing="selective", sharding="ddp", loss_impl="hf"), PLAIN)
    assert t_sel.step_time_s == pytest.approx(lin + 4096 * 2 * 73728 / 773e12 + attn + elem_ck, rel=1e-12)
    assert t_sel.step_time_s < t_full.step_time_s


def test_selective_drops_the_rings_recompute_pass_only():
    """zigzag over a slow link: full sends the K,V ring three times (forward, recompute, backward), selective twice;
    Ulysses' backward re-sends q, k, v and out under selective too, so its exposed communication does not drop (it
    grows a little: the gradient all-reduce has less backward compute to hide under)."""
    m = get_model("llama-2-7b")
    cl = cluster_from_flags("h200", 8)
    slow = cl.model_copy(update={"intra_node_link": LinkSpec(kind="pcie4", bandwidth_gb_s=1.0)})
    w = Workload(model=m, seq_len=65536, optimizer="none")

    def comm(mode, ck):
        return estimate_time(w, slow, Strategy(mode=mode, sp_degree=8, sharding="ddp", checkpointing=ck), PLAIN).breakdown_s[
            "exposed_comm"
        ]

    assert comm("zigzag_ring_attn", "selective") < comm("zigzag_ring_attn", "full")
    assert comm("dist_flash_attn", "selective") < comm("dist_flash_attn", "full")  # LightSeq's forward transfers, once
    assert comm("ulysses_attn", "selective") >= comm("ulysses_attn", "full")


def test_sp_divides_compute_and_breakdown_sums():
    m, cl = get_model("llama-2-7b"), cluster_from_flags("h200", 8)
    w = Workload(model=m, seq_len=262144)
    for mode, sp in (("zigzag_ring_attn", 8), ("ulysses_attn", 8), ("dist_flash_attn", 8), ("data_parallel", 1)):
        t = estimate_time(w, cl, Strategy(mode=mode, sp_degree=sp, dp_degree=8 // sp, sharding="zero3"), load_coefficients())
        assert sum(t.breakdown_s.values()) == pytest.approx(t.step_time_s)
        assert 0 < t.mfu < 1


def test_slow_link_exposes_ring_and_ulysses_communication():
    m = get_model("llama-2-7b")
    fast = cluster_from_flags("h200", 8)
    slow = fast.model_copy(update={"intra_node_link": LinkSpec(kind="pcie4", bandwidth_gb_s=1.0)})
    w = Workload(model=m, seq_len=65536, optimizer="none")
    c = load_coefficients()
    for mode in ("zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"):
        s = Strategy(mode=mode, sp_degree=8, sharding="ddp")
        a, b = estimate_time(w, fast, s, c), estimate_time(w, slow, s, c)
        assert b.breakdown_s["exposed_comm"] > a.breakdown_s["exposed_comm"] > 0
        assert b.tokens_per_s < a.tokens_per_s


def test_ulysses_all_to_all_volume_by_hand():
    """Ulysses, 2 ranks, no checkpointing: 2 passes x 4 all-to-alls, each moving half of a local q/k/v/o tensor."""
    cl = cluster_from_flags("h200", 2)
    w = Workload(model=TINY, seq_len=4096, optimizer="none")
    c = PLAIN.with_values(grad_comm_overlap=1.0)  # gradient all-reduce fully hidden, so the exposure is the all-to-alls
    t = estimate_time(w, cl, Strategy(mode="ulysses_attn", sp_degree=2, checkpointing="none", sharding="ddp"), c)
    bytes_ = 2 * 0.5 * 2048 * 2 * (2 * 4 * 16 + 2 * 2 * 16) * 2  # passes x (u-1)/u x t x bf16 x (q+o + k+v) x layers
    # NCCL's bus bandwidth at the size of one all-to-all (a quarter of a layer's q, k, v, o) and of DDP's 25 MiB
    # buckets on NVLink4 (seqpar/profiles/nccl_tests.json: 0.80 of 450 GB/s, 50 us per call)
    call = 2048 * 2 * (2 * 4 * 16 + 2 * 2 * 16) / 4
    a2a_bw = call / (50e-6 + call / (0.80 * 450e9))
    ar_bw = 25 * 2**20 / (50e-6 + 25 * 2**20 / (0.80 * 450e9))
    grad = 2 * 0.5 * TINY.num_params * 4 / ar_bw  # ring all-reduce of fp32 grads (autocast)
    exposed = t.breakdown_s["exposed_comm"]
    assert exposed == pytest.approx(bytes_ / a2a_bw + max(grad - 0.6 * t.breakdown_s["compute"], 0), rel=1e-9)


def test_dist_flash_balanced():
    m, cl = get_model("llama-2-7b"), cluster_from_flags("h200", 8)
    w = Workload(model=m, seq_len=524288, optimizer="none")
    zz = estimate_time(w, cl, Strategy(mode="zigzag_ring_attn", sp_degree=8, checkpointing="full"), PLAIN)
    df = estimate_time(w, cl, Strategy(mode="dist_flash_attn", sp_degree=8, checkpointing="full"), PLAIN)
    # dist flash's split last step gives every rank P/2 blocks, the same attention work as zigzag (both recompute it)
    ratio = df.parts_s["attn_ideal"] / zz.parts_s["attn_ideal"]
    assert ratio == pytest.approx(1.0)  # PLAIN has no call-length penalty (n0 = 0)


def test_width_efficiency_by_hand():
    assert width_efficiency(8192, 4096.0) == 1.0  # the kernel rate's own GEMM width
    assert width_efficiency(2048, 4096.0) == pytest.approx((2048 / 6144) / (8192 / 12288)) == pytest.approx(0.5)
    assert width_efficiency(4096, 4096.0) == pytest.approx(0.75)
    assert width_efficiency(2048, 0.0) == 1.0  # h0 = 0: no width penalty


def test_per_gpu_factors_scale_the_step_global_pair_otherwise():
    """A GPU with its own time_factors uses them; any other GPU the global pair (1.0 here), with h0 on the linear part."""
    w = Workload(model=TINY, seq_len=4096, optimizer="none")
    s = Strategy(mode="data_parallel", checkpointing="none", sharding="ddp", loss_impl="hf")
    c = PLAIN.with_values(matmul_width_h0=64.0, time_factors={"h200": {"linear_time_factor": 2.0, "attn_time_factor": 3.0}})
    lin = 4096 * 6 * 90112 / 773e12 / width_efficiency(64, 64.0)  # h = 64: (64/128) / (8192/8256)
    attn = 2 * 4096**2 * 4 * 16 * 2 * 3.5 / 570e12
    h200 = cluster_from_flags("h200", 1)
    t = estimate_time(w, h200, s, c)
    assert t.parts_s["linear_ideal"] == pytest.approx(lin, rel=1e-12)
    elem = elementwise_time(TINY, h200, s, 4096)  # unscaled: part of the fit's fixed rest
    assert t.parts_s["elementwise"] == pytest.approx(elem) and t.parts_s["rest"] == pytest.approx(elem)
    assert t.step_time_s == pytest.approx(2.0 * lin + 3.0 * attn + elem, rel=1e-12)
    other = estimate_time(w, cluster_from_flags("h100-sxm", 1), s, c)
    assert other.step_time_s == pytest.approx(
        other.parts_s["linear_ideal"] + other.parts_s["attn_ideal"] + other.parts_s["rest"], rel=1e-12
    )
