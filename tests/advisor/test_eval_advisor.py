"""The eval cost model (seqpar.advisor.cost.evaluate): every memory term by hand, forward-only time as training's terms
(a third of the linear FLOPs, 1/3.5 of attention's), and the longest evaluable length at the edge of the OOM verdict."""

import pytest

from seqpar.advisor.cluster import cluster_from_flags
from seqpar.advisor.cost.coefficients import Coefficients, load_coefficients
from seqpar.advisor.cost.evaluate import estimate_eval_memory, estimate_eval_time, max_eval_seq_len, predict_eval
from seqpar.advisor.cost.throughput import estimate_time
from seqpar.advisor.search import max_seq_len
from seqpar.plan.flops import attention_fwd_flops, matmul_params
from seqpar.plan.specs import Strategy, Workload
from seqpar.plan.units import GIB
from seqpar.profiles import get_model

from seqpar_testing.advisor import TINY

PSI = 106816  # test_memory.py: TINY's parameters by hand
H200 = cluster_from_flags("h200", 1)
DP = Strategy(mode="data_parallel")
C = load_coefficients()
PLAIN = Coefficients(  # unit factors, no short-call or width penalty: times are FLOPs over the kernel rate
    version="test",
    linear_time_factor=1.0,
    attn_time_factor=1.0,
    attn_block_tokens=0.0,
    matmul_width_h0=0.0,
    kernel_tflops={"h200": {"matmul": 773, "cudnn": 570, "flash": 322}},
)


@pytest.mark.parametrize(
    "seq_len, phase, expected",
    [
        # t = 1024 bf16 tokens: the loss chunk (1024 x 256 x (2 + 8) bytes) outweighs the MLP's 3 x 2 x 128 per token
        (
            1024,
            "loss",
            {
                "weights": 2 * PSI,
                "rope_tables": 2 * 1024 * 16 * 2,
                "final_hidden": 1024 * 2 * 64,
                "loss_chunk": 1024 * 256 * 10,
                "token_results": 1024 * 16,
            },
        ),  # fmt: skip
        # t = 65536: the chunk stays 4096 tokens; one layer's MLP moment (2 p h + 3 p I per token) + the two held streams
        (
            65536,
            "layer",
            {
                "weights": 2 * PSI,
                "rope_tables": 2 * 65536 * 16 * 2,
                "held_activations": 2 * 65536 * 2 * 64,
                "layer_working_set": 65536 * (2 * 2 * 64 + 3 * 2 * 128),
            },
        ),  # fmt: skip
    ],
)
def test_memory_terms_by_hand(seq_len, phase, expected):
    mem = estimate_eval_memory(TINY, seq_len, H200, DP, "bf16", C)
    assert mem["peak_phase"] == phase and mem["breakdown"] == pytest.approx(expected)
    assert mem["peak_bytes"] == pytest.approx(sum(expected.values()))
    slack = (
        min(mem["peak_bytes"] * C.allocator_reserve_fraction, C.allocator_reserve_cap_gib * GIB) + C.allocator_reserve_gib * GIB
    )
    reserved = mem["peak_bytes"] + slack + C.cuda_context_gib * GIB
    assert mem["reserved_bytes"] == pytest.approx(reserved) and mem["fits"]


def test_attention_moment_and_mode_buffers_by_hand():
    """The attention kernel's moment: normed input, q/k/v after RoPE, the (B, S, H, D) copies of q and k, out, lse; it
    wins for a model with a narrow MLP, and zigzag adds its ring buffers (memory.mode_buffers, forward)."""
    narrow = TINY.model_copy(update={"intermediate_size": 16})
    t = 262144
    attn = t * (2 * 64 + 2 * (3 * 64 + 3 * 32) + 4 * 4)
    mem = estimate_eval_memory(narrow, t, H200, DP, "bf16", C)
    assert mem["breakdown"]["layer_working_set"] == attn
    zz = Strategy(mode="zigzag_ring_attn", sp_degree=8)
    ring = (t / 8) * (2 * 2 * 2 * 16) + (t / 8) * (4 * 4 * 16 + 4 * 4)  # next K,V block; fp32 out + lse accumulators
    got = estimate_eval_memory(narrow, t, cluster_from_flags("h200", 8), zz, "bf16", C)["breakdown"]["layer_working_set"]
    assert got == pytest.approx(attn / 8 + ring)


def test_llama_2_7b_at_512k_on_one_h200():
    """The bench's largest point: weights 12.55 GiB + held 8 GiB + the MLP moment 40.25 GiB (+ RoPE tables) fits."""
    p = predict_eval(get_model("llama-2-7b"), 524288, H200, DP, "bf16")
    b = p.memory_breakdown_gib
    assert p.peak_phase == "layer" and p.fits
    assert b["weights"] == pytest.approx(get_model("llama-2-7b").num_params * 2 / GIB) == pytest.approx(12.55, abs=0.01)
    assert b["held_activations"] == 8.0 and b["layer_working_set"] == pytest.approx(524288 * (4 * 4096 + 6 * 11008) / GIB)
    assert p.tokens_per_s == pytest.approx(524288 / p.forward_time_s, rel=1e-3)


@pytest.mark.parametrize("model, seq_len", [("llama-2-7b", 65536), ("llama-3.2-1b", 131072), ("tiny", 4096)])
def test_forward_time_is_a_third_of_trainings_linear_and_1_over_3_5_of_its_attention(model, seq_len):
    m = get_model(model)
    ev = estimate_eval_time(m, seq_len, H200, DP, "bf16", PLAIN)["breakdown"]
    train = Strategy(mode="data_parallel", checkpointing="none", loss_impl="hf")
    parts = estimate_time(Workload(model=m, seq_len=seq_len, optimizer="none"), H200, train, PLAIN).parts_s
    assert ev["linear"] == pytest.approx(parts["linear_ideal"] / 3) == pytest.approx(seq_len * 2 * matmul_params(m) / 773e12)
    assert ev["attention"] == pytest.approx(parts["attn_ideal"] / 3.5) == pytest.approx(attention_fwd_flops(m, seq_len) / 570e12)
    assert ev["exposed_comm"] == 0.0  # one GPU: nothing to send


def test_sequence_parallel_forward_communication():
    """Ulysses: one set of all-to-alls per layer ((u-1)/u of q, k, v, o), not hidden; the ring hides part of its K,V
    passes under attention. Both divide the work by sp_degree."""
    m, cl8 = get_model("llama-2-7b"), cluster_from_flags("h200", 8)
    S, u = 262144, 8
    uly = estimate_eval_time(m, S, cl8, Strategy(mode="ulysses_attn", sp_degree=u), "bf16", PLAIN)
    bw = cl8.intra_node_link.bandwidth_gb_s * 1e9 * PLAIN.comm_bandwidth_efficiency
    a2a = (u - 1) / u * (S / u) * 2 * (2 * 4096 + 2 * 4096) * 32 / bw
    assert uly["breakdown"]["exposed_comm"] == pytest.approx(a2a)
    zz = estimate_eval_time(m, S, cl8, Strategy(mode="zigzag_ring_attn", sp_degree=8), "bf16", PLAIN)
    one = estimate_eval_time(m, S, H200, DP, "bf16", PLAIN)
    assert zz["breakdown"]["attention"] == pytest.approx(one["breakdown"]["attention"] / 8)
    assert 0 < zz["breakdown"]["exposed_comm"] < one["breakdown"]["attention"] / 8


def test_longest_evaluable_length_is_the_edge_and_beats_training():
    m = get_model("llama-2-7b")
    n = max_eval_seq_len(m, H200, DP, "bf16")
    assert n % 1024 == 0 and predict_eval(m, n, H200, DP).fits and not predict_eval(m, n + 1024, H200, DP).fits
    trained = max_seq_len(m, H200, ["data_parallel"], optimizer="none")["data_parallel"][0]
    assert n > trained  # no activations kept for backward, no gradients (1.29M vs 680K tokens)
    zz = Strategy(mode="zigzag_ring_attn", sp_degree=8)
    assert max_eval_seq_len(m, cluster_from_flags("h200", 8), zz, "bf16") > 4 * n  # activations split 8 ways, weights not
